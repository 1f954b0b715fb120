"""A fleet of SandboxFusion servers with one down starts on the others."""

from __future__ import annotations

import pytest


# ---------------------------------------------------------------- the sandbox's start-up probe and all-failed stop
@pytest.fixture
def fusion():
    from helpers.fake_sandboxfusion import serve_fake

    yield from serve_fake()


def test_a_fleet_with_one_server_down_starts_on_the_others(fusion, monkeypatch):
    """`sandbox_url` lists two servers and one is down (connection refused). Before, the start-up probe opened one
    session, which hashed to the server that is down, and stopped the run (about one start in two here, 4 and 5 of
    8 trainers in two runs of a real fleet), though the rollout's own retry would have moved to the other server.
    Now the probe, like the rollout, tries another fresh session, placed away from the server found down."""
    from helpers.failing_sandboxes import closed_port
    from retool_trl.sandbox.remote import client as remote_client
    from retool_trl.sandbox.remote import transport
    from retool_trl.sandbox.remote.client import RemoteSandbox
    from retool_trl.training.sandbox_health import SandboxHealth

    down = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(remote_client.zlib, "crc32", lambda data: 0)  # the first session goes to the first server
    monkeypatch.setattr(transport, "_sleep", lambda s: None)
    with RemoteSandbox([down, fusion.url], timeout_s=5.0, retries=1, backoff_s=0.01, sessions="replay") as sandbox:
        health = SandboxHealth("training")
        with health.step(health.watch(sandbox)):
            pass
        assert sandbox._down_until.get(down)  # it did try the server that is down first
        assert len(fusion.requests) >= 1
