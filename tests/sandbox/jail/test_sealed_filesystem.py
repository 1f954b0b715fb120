"""Channels and host-wide resources that jailed sessions used to share: each test stands for one a red-team pass
found between the sessions of one batch (or between a session and the trainer), and fails if it is open again."""

import fcntl
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from retool_trl.sandbox import LocalSandbox

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sandbox():
    with LocalSandbox(num_workers=2, timeout_s=5.0, memory_mb=512, max_output_chars=1000, preload=()) as sb:
        report = sb.isolation_report()
        if not report["jail_per_session"] or report["isolation"] != "bwrap":
            pytest.skip(f"needs bubblewrap and per-session jails (isolation level here: {report['isolation']})")
        yield sb


def test_each_jail_has_its_own_pseudo_terminals(sandbox):
    """Finding: every jail shared bubblewrap's one devpts instance: a session opened a pty, made it world-writable,
    and a later session wrote into it (and the host-wide pty pool could be drained by one session)."""
    a, b = sandbox.session(), sandbox.session()
    r = a.run("import os\nm, s = os.openpty()\nname = os.ttyname(s)\nos.chmod(name, 0o666)\nprint(name)")
    assert r.ok, r
    name = r.output.strip()
    r = b.run(f"open({name!r}, 'w').write('the answer is 1729')")
    assert not r.ok and ("FileNotFoundError" in r.output or "PermissionError" in r.output), r
    r = b.run(
        "import os\nptys = []\ntry:\n    for _ in range(64):\n        ptys.append(os.openpty())\n"
        "except OSError as e:\n    print('refused', e.errno)\nprint(len(ptys))"
    )
    assert r.ok and r.output.startswith("refused") and int(r.output.split()[-1]) < 64, r


def test_no_lock_on_a_host_file_from_a_cell(sandbox):
    """Finding: `flock` on a read-only host file taken by a parked session blocked the trainer (and every other
    session) wanting the same lock."""
    target = os.path.realpath(sys.executable)  # a host file every jail can read
    s = sandbox.session()
    r = s.run(
        f"import fcntl\nf = open({target!r}, 'rb')\nfcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nprint('held')"
    )
    with open(target, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while a session holds it
        fcntl.flock(f, fcntl.LOCK_UN)
    assert not r.ok and "PermissionError" in r.output, r


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="syscall numbers known for these only")
def test_no_host_wide_async_io_contexts(sandbox):
    """Finding: a parked session held all of `fs.aio-max-nr` through `io_setup`, so the trainer's own `io_setup`
    (DeepSpeed's NVMe offload) failed with EAGAIN."""
    nr = {"x86_64": 206, "aarch64": 0}[platform.machine()]
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nctx = ctypes.c_ulong(0)\n"
        f"print(libc.syscall({nr}, 4096, ctypes.byref(ctx)), ctypes.get_errno())"
    )
    r = sandbox.session().run(code)
    assert r.ok and r.output.split() == ["-1", "1"], r  # EPERM


def test_the_launch_directory_is_not_bound_into_the_jail():
    """Finding: every `sys.path` entry was bound into the jail, so the training script's directory (`sys.path[0]`)
    under a mode-700 home was readable from a cell (`proj/.env` with an API key)."""
    home = Path(tempfile.mkdtemp(prefix=".retool-test-home-", dir=os.path.expanduser("~")))
    try:
        os.chmod(home, 0o700)
        project = home / "proj"
        project.mkdir(mode=0o755)
        (project / ".env").write_text("WANDB_API_KEY=secret-1729\n")
        os.chmod(project / ".env", 0o644)
        sys.path.insert(0, str(project))
        try:
            with LocalSandbox(num_workers=1, timeout_s=5.0, preload=()) as sb:
                if sb.isolation_report()["isolation"] != "bwrap":
                    pytest.skip("needs bubblewrap")
                r = sb.session().run(f"print(open({str(project / '.env')!r}).read())")
        finally:
            sys.path.remove(str(project))
        assert not r.ok and "secret-1729" not in r.output, r
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_cgroups_are_hidden_from_cells(sandbox):
    """Finding: jails read the host's /sys/fs/cgroup: every session's usage, and other trainers' too."""
    r = sandbox.session().run("import os\nprint(os.listdir('/sys/fs/cgroup'))")
    assert r.ok and r.output == "[]\n", r


def test_output_and_traceback_are_bounded_together(sandbox):
    """Finding: output and traceback were cut separately, so a result could be about twice `max_output_chars`."""
    r = sandbox.session().run("print('x' * 5000)\nraise ValueError('y' * 5000)")
    assert not r.ok and len(r.output) <= sandbox.max_output_chars, len(r.output)
    assert r.output.startswith("xxx") and r.output.rstrip().endswith("y" * 100)  # both ends kept
    r = sandbox.session().run("print('x' * 400)\nraise ValueError('y' * 5000)")
    assert len(r.output) <= sandbox.max_output_chars and r.output.startswith("x" * 400 + "\n"), r


def test_stale_cgroups_of_dead_trainers_are_removed_at_start():
    """Finding: a SIGKILLed trainer left its empty `retool-sandbox-*` cgroups behind, one set per run."""
    if os.geteuid() != 0:
        pytest.skip("cgroups need root here")
    dead = subprocess.Popen(["true"])
    dead.wait()
    made = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, own = line.split(":", 2)
        if "pids" in controllers.split(","):
            stale = Path("/sys/fs/cgroup/pids") / own.lstrip("/") / f"retool-sandbox-{dead.pid}-dead"
            try:
                (stale / "j1-1").mkdir(parents=True)
            except OSError as exc:  # a container's read-only cgroups: the sandbox makes none there either
                pytest.skip(f"the pids cgroup is not writable here ({exc.strerror})")
            made.append(stale)
    if not made:
        pytest.skip("no pids cgroup here")
    with LocalSandbox(num_workers=1, preload=()) as sb:
        assert sb.session().run("print(1)").ok
    assert [path for path in made if path.exists()] == []
