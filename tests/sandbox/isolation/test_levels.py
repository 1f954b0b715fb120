"""The isolation levels where users train, each tried for real on this kernel.

A normal user runs the trainer (uid 65534, with nothing but what any user has): once with user namespaces allowed
(bubblewrap then runs through one, and the zygote's pid numbers are not the host's), once with them blocked as RHEL's
`user.max_user_namespaces=0` or Ubuntu's AppArmor rule leave a user (the Landlock level). The test process is root
here: it makes the interpreter (under mode-700 /root) reachable in a private mount namespace, blocks user namespaces
by setting the limit to 0 inside a user namespace of its own (the limit is per user namespace), then drops to the
user. The contract checks themselves are in `sandbox_levels_probe.py`; the default container is in
`sandbox/isolation/test_container.py`.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from retool_trl.sandbox import LocalSandbox, UnsafeSandboxError
from retool_trl.sandbox.isolation import landlock as landlock_level

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[3]
PROBE = Path(__file__).resolve().parents[2] / "helpers" / "sandbox_levels_probe.py"
AS_USER = ROOT / "scripts" / "ci" / "as_normal_user.py"
USER = 65534


def run_as_user(block_userns: bool, *args: str) -> dict:
    if os.geteuid() != 0:
        pytest.skip("needs root to set up a normal user's session (private mount and user namespaces)")
    for tool in ("setpriv", "mount", "sh"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    keep = f"{os.path.realpath(sys.executable)}:{ROOT}"  # as_normal_user.py lets the user reach both
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "LANG": "C.UTF-8"}
    command = [sys.executable, str(AS_USER), str(USER), "1" if block_userns else "0", keep]
    command += [sys.executable, str(PROBE), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, env=env, cwd="/")
    if done.returncode == 90:
        pytest.skip("cannot make the mount or user namespace that sets up a normal user here")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def user_with_userns():
    return run_as_user(False)


@pytest.fixture(scope="module")
def user_without_userns():
    if landlock_level.landlock_problem():
        pytest.skip(f"no Landlock on this kernel: {landlock_level.landlock_problem()}")
    return run_as_user(True)


def _assert_contract(out: dict) -> None:
    """Each check of the container report, plus the trainer's environment and AF_VSOCK: refused, as the cell's own
    error (never an infrastructure error), and the neighbour session unharmed."""
    assert out["trainer_uid"] == USER
    assert out["first_call"]["ok"] and not out["first_call"]["infra"], out["first_call"]
    for name, result in out["checks"].items():
        assert not result["infra"], (name, result)
        if name != "leftover":
            assert not result["ok"], (name, result["output"])
    assert "hf_probe_secret" not in json.dumps(out["checks"])
    assert "MemoryError" in out["checks"]["memory"]["output"]
    assert "MemoryError" in out["checks"]["memory_spread"]["output"]  # 4 x 200 MB under 512 MB: the session's bound
    assert not out["tcp_accepted"] and not out["udp_received"]
    assert out["other_alive"]["ok"], out["other_alive"]
    assert out["leftovers"] == []
    assert out["session_gone_after_close"]


def test_normal_user_with_user_namespaces_gets_bubblewrap_and_working_calls(user_with_userns):
    """A normal user on a workstation or Slurm node whose kernel allows user namespaces: bubblewrap runs through
    one, so the pids the zygote sees are not the host's. The first call must run at once (it waited 30 s and became an
    infrastructure error when the trainer took the namespace's pid for a host pid), and the pid the trainer holds
    (and signals) must be the session's own process."""
    out = user_with_userns
    assert out["report"]["isolation"] == "bwrap"
    assert out["first_call"]["ok"] and not out["first_call"]["infra"], out["first_call"]
    assert out["first_call_s"] < 10.0  # the broken path waited 30 s; a working one takes milliseconds
    assert out["host_pid_is_session"], out["host_pid"]
    assert out["session_gone_after_close"]


def test_normal_user_with_user_namespaces_keeps_the_contract(user_with_userns):
    """Same user: sessions share the zygote's uid and namespaces inside bubblewrap, so each also restricts itself
    with Landlock; every contract check holds."""
    _assert_contract(user_with_userns)


def test_normal_user_without_user_namespaces_gets_the_landlock_level(user_without_userns):
    """A normal user where user namespaces are blocked (RHEL default, Ubuntu 24.04's AppArmor rule): bubblewrap
    cannot start, `LocalSandbox()` with its defaults starts on the Landlock level and keeps the contract."""
    out = user_without_userns
    assert "refused" not in out, out.get("refused")
    assert out["report"]["isolation"] == "landlock"
    assert out["report"]["landlock"] and out["report"]["filesystem_confined"]
    assert out["warnings"] == []  # a level that holds the contract is not a degraded one
    _assert_contract(out)


def test_the_report_names_what_the_landlock_level_cannot_give(user_without_userns):
    """What does not hold without namespaces or cgroups is listed in words, not claimed."""
    missing = " | ".join(user_without_userns["report"]["missing"])
    for words in ("private process list", "memory bound of a session as a whole", "own uid per session"):
        assert words in missing


def test_a_normal_users_report_speaks_of_a_normal_user(user_without_userns):
    """A normal user's report said "sessions then run as uid 0" (true of a container's root only); its flags and its
    summary say what holds for this user: cells cannot open IP sockets, so the network is out of their reach."""
    report = user_without_userns["report"]
    assert "uid 0" not in " ".join(report["missing"]) and "normal user" in " ".join(report["missing"])
    assert report["network_isolated"] and "no network" in report["summary"].split("does not hold")[0]
    assert report["summary"].startswith("isolation level landlock: holds:")


def _vsock_available() -> bool:
    try:
        socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM).close()
        return True
    except (OSError, AttributeError):
        return False


def test_no_vsock_from_a_cell_at_any_level():
    """AF_VSOCK (the VM's host channel) is not network-namespaced: a cell on a VM could listen on and reach the host's
    vsock ports even with the network isolated. Refused at the level this host gives root (bubblewrap), the
    Landlock level and the level without isolation alike."""
    if not _vsock_available():
        pytest.skip("this host cannot make AF_VSOCK sockets at all (no vsock transport)")
    levels = ["auto", "landlock"] + (["none"] if os.geteuid() == 0 else [])
    for level in levels:
        allow = level == "none"
        with LocalSandbox(preload=(), isolation=level, allow_root_without_isolation=allow) as sandbox:
            result = sandbox.session().run("import socket\nsocket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)")
            assert not result.ok and "Address family not supported" in result.output, (level, result.output)
            assert not result.infra_error


def test_root_refusal_names_the_missing_kernel_feature_and_the_fix(monkeypatch):
    """Root on a host where neither bubblewrap nor Landlock runs: refused in one message naming both and the fix."""
    if os.geteuid() != 0:
        pytest.skip("the refusal is for root")
    from retool_trl.sandbox.isolation import bubblewrap

    monkeypatch.setattr(
        bubblewrap, "problem", lambda network: "Creating new namespace failed: Operation not permitted"
    )
    monkeypatch.setattr(landlock_level, "landlock_problem", lambda: "the kernel has no Landlock (needs Linux 5.13+)")
    sandbox = LocalSandbox(preload=())
    with pytest.raises(UnsafeSandboxError) as info:
        sandbox.session().run("print(1)")
    sandbox.close()
    message = str(info.value)
    assert "Landlock" in message and "namespace" in message and "Fix:" in message
    assert "\n" not in message


def test_a_normal_user_reaches_a_checkout_in_a_folder_others_cannot_enter():
    """CI run from a clone in a folder other users cannot enter (a `mktemp -d` folder, mode 700): the normal-user
    stage ended with `Permission denied` on the interpreter, after the other stages passed. The user now gets through
    that folder (o+x, not listed) while the command runs; its mode is restored after."""
    import stat
    import tempfile

    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("mount") is None:
        pytest.skip("needs root, setpriv and mount to set up a normal user's session")
    closed = Path(tempfile.mkdtemp())  # mode 700, as `mktemp -d` makes it
    try:
        clone = closed / "clone"
        (clone / "pkg").mkdir(parents=True)
        (clone / "pkg" / "__init__.py").write_text("import os\nprint('imported as uid', os.getuid())\n")
        needed = f"{os.path.realpath(sys.executable)}:{clone}"
        done = subprocess.run(
            [sys.executable, str(AS_USER), str(USER), "0", needed, sys.executable, "-c", "import pkg"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(clone)},
            cwd="/",
        )
        if done.returncode == 90:
            pytest.skip("cannot make the mount namespace that sets up a normal user here")
        assert done.returncode == 0 and f"imported as uid {USER}" in done.stdout, done.stderr[-2000:]
        assert stat.S_IMODE(closed.stat().st_mode) == 0o700  # restored
    finally:
        shutil.rmtree(closed)
