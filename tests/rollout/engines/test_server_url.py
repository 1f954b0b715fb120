"""Where the training processes find TRL's vLLM server."""

from __future__ import annotations

import types

import httpx
import pytest


# ------------------------------------------------------------------------------------ several nodes, one server
def test_host_0000_connects_every_node_to_the_main_process_host(monkeypatch):
    """`vllm_server_host: 0.0.0.0` (TRL's default): the server listens on every interface of the main process's host.
    Processes on other nodes must connect there (the launcher's MASTER_ADDR), not to their own 127.0.0.1."""
    from retool_trl.rollout.engines.vllm_server import server_url

    args = types.SimpleNamespace(vllm_server_base_url=None, vllm_server_host="0.0.0.0", vllm_server_port=8000)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert server_url(args) == "http://10.1.2.3:8000"
    monkeypatch.delenv("MASTER_ADDR")
    assert server_url(args) == "http://127.0.0.1:8000"  # no launcher: this host
    args.vllm_server_host = "10.9.9.9"
    assert server_url(args) == "http://10.9.9.9:8000"


@pytest.mark.parametrize(
    ("master_addr", "host", "url"),
    [
        ("fd00::12", "0.0.0.0", "http://[fd00::12]:8000"),
        ("10.0.0.7", "0.0.0.0", "http://10.0.0.7:8000"),
        ("fd00::12", "::", "http://[fd00::12]:8000"),
        (None, "::1", "http://[::1]:8000"),
    ],
)
def test_an_ipv6_master_addr_gives_a_valid_server_url(monkeypatch, master_addr, host, url):
    """A cluster whose launcher sets an IPv6 `MASTER_ADDR` (IPv6-only nodes): the server URL puts the address in
    brackets (before: `http://fd00::12:8000`, which httpx reads as host `fd00` with a bad port)."""

    from retool_trl.rollout.engines.vllm_server import server_url

    if master_addr is None:
        monkeypatch.delenv("MASTER_ADDR", raising=False)
    else:
        monkeypatch.setenv("MASTER_ADDR", master_addr)
    args = types.SimpleNamespace(vllm_server_base_url=None, vllm_server_host=host, vllm_server_port=8000)
    assert server_url(args) == url
    assert httpx.URL(server_url(args)).port == 8000
