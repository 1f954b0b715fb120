"""The sandbox where most GPU training runs: root inside a default rootful container.

A real runtime (podman with runc) starts the trainer with its defaults: the runtime's seccomp profile and capability
set (no CAP_SYS_ADMIN, no CAP_SYS_PTRACE), read-only cgroups, its own network and pid namespace, the trainer as pid 1.
This machine's files are the container's root through an overlay (`--rootfs /:O`), so the checkout and its virtual
environment (under mode-700 /root) are the ones under test. bubblewrap cannot make namespaces there; `LocalSandbox()`
with its defaults must still start, on the Landlock level, and keep the contract checks in `sandbox_levels_probe.py`.
Skipped where podman or runc is not installed (`scripts/ci/test_containers.sh` installs them in CI).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.container_env import container_evidence

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).resolve().parents[2] / "helpers" / "sandbox_levels_probe.py"


def podman_command(*argv: str, workdir: Path = ROOT) -> list[str]:
    """A default rootful container running `argv` on this machine's files (the limits these VMs need, nothing else)."""
    return [
        "podman",
        "--runtime",
        "runc",
        "run",
        "--rm",
        "--ulimit",
        "nofile=4096:4096",
        "--ulimit",
        "nproc=8192:8192",
        "-w",
        str(workdir),
        "-e",
        f"PYTHONPATH={ROOT}",
        "--rootfs",
        "/:O",
        *argv,
    ]


@pytest.fixture(scope="module")
def container_run():
    if os.geteuid() != 0:
        pytest.skip("a rootful container needs root")
    if shutil.which("podman") is None or shutil.which("runc") is None:
        pytest.skip("podman and runc are not installed (apt-get install podman runc)")
    evidence = container_evidence()
    if evidence:
        pytest.skip(f"already inside a container ({evidence}): no nested container is started")
    done = subprocess.run(
        podman_command(sys.executable, str(PROBE)), capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    if done.returncode != 0 and "Traceback" not in done.stderr:  # the probe never ran: podman could not start it
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        pytest.skip(f"podman cannot start a container here: {last[:150]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_default_sandbox_starts_in_a_default_container(container_run):
    """A user's `LocalSandbox()` in a Docker/podman container: no refusal, no opt-in, no warning of a degraded
    level; the level in force is Landlock and the report says so."""
    out = container_run
    assert out["trainer_uid"] == 0
    assert "refused" not in out, out.get("refused")
    assert out["report"]["isolation"] == "landlock"
    assert out["report"]["landlock"] and out["report"]["seccomp"] and out["report"]["filesystem_confined"]
    assert not out["report"]["jail_per_session"]  # the runtime refuses namespaces: said, not claimed
    assert out["first_call"]["ok"] and not out["first_call"]["infra"], out["first_call"]


def test_cells_have_no_root_powers(container_run):
    """Cells ran as uid 0 with the container's capabilities: now a uid of their own, or uid 0 with none at all."""
    uid, capabilities = container_run["first_call"]["output"].split()
    assert uid != "0" or int(capabilities, 16) == 0, container_run["first_call"]


@pytest.mark.parametrize(
    "check",
    ["shadow", "dotenv", "trainer_environ", "tcp_loopback", "udp_out", "vsock", "other_scratch", "kill_other"],
)
def test_each_contract_check_is_refused_as_the_cells_own_error(container_run, check):
    """The container report's checks: /etc/shadow, a .env in the launch directory, the trainer's environment, TCP
    to the trainer's loopback, UDP out, AF_VSOCK, another session's scratch, SIGKILL of another session."""
    result = container_run["checks"][check]
    assert not result["ok"] and not result["infra"], result
    assert "hf_probe_secret" not in result["output"]


def test_nothing_reaches_the_trainer_and_the_neighbour_lives(container_run):
    out = container_run
    assert not out["tcp_accepted"] and not out["udp_received"]
    assert out["other_alive"]["ok"], out["other_alive"]


def test_no_leftover_process_and_memory_bounded(container_run):
    out = container_run
    assert out["checks"]["leftover"]["ok"] and out["leftovers"] == []
    for check in ("memory", "memory_spread"):  # one process over memory_mb; four within it, together over it
        memory = out["checks"][check]
        assert not memory["ok"] and not memory["infra"] and "MemoryError" in memory["output"], memory
    assert out["session_gone_after_close"]


def test_what_does_not_hold_is_named(container_run):
    """Without namespaces or writable cgroups, the report lists what the kernel cannot give without privileges."""
    missing = " | ".join(container_run["report"]["missing"])
    for words in ("per-session jail", "memory bound of a session as a whole", "private process list", "cgroup"):
        assert words in missing
