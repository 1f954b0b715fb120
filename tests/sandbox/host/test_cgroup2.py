"""The sandbox's cgroup v2 code on a real cgroup2 hierarchy: delegation, the no-internal-processes rule, freeze and
kill through `cgroup.freeze` and `cgroup.kill`, removal.

Every current distribution boots with cgroup v2 alone. The machines these tests run on boot with v1 hierarchies for
the memory, pids, cpu and freezer controllers, and the kernel binds each controller to one hierarchy: only
`hugetlb` is free for v2 (moving another would need its v1 hierarchy gone, which holds other cgroups; unmounting it in
a private mount namespace does not free it). So these tests drive the real `SandboxCgroups` on the real unified
hierarchy with `hugetlb` standing for the controllers a v2 host delegates: the kernel's rules about where
controllers and processes may be are the same for every controller, and freezing and killing are core v2 files.
`memory.max`, `pids.max` and `cpu.max` themselves are not exercised here (the docs say so).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from retool_trl.sandbox.host.cgroup_control import v2_freeze, v2_kill

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]


def _unified() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            return Path(left.split()[4])
    return None


@pytest.fixture
def v2_dir():
    """A fresh cgroup below the unified hierarchy's root, with `hugetlb` available to it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make cgroups")
    unified = _unified()
    if unified is None:
        pytest.skip("no cgroup2 hierarchy is mounted (mount -t cgroup2 none DIR)")
    if "hugetlb" not in (unified / "cgroup.controllers").read_text().split():
        pytest.skip("hugetlb (the one controller these tests use for v2) is bound to a v1 hierarchy here")
    enabled_here = "hugetlb" not in (unified / "cgroup.subtree_control").read_text().split()
    if enabled_here:
        (unified / "cgroup.subtree_control").write_text("+hugetlb")  # the root is exempt from the rule
    path = unified / f"retool-test-cg2-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    yield path
    v2_kill(path)
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        child.rmdir()
    path.rmdir()
    if enabled_here:
        try:
            (unified / "cgroup.subtree_control").write_text("-hugetlb")
        except OSError:
            pass  # another test's cgroup uses it now


def _trainer(v2_dir: Path, script: str) -> dict:
    """Runs `script` as a trainer whose own cgroup is `v2_dir` (moved there first), with the v1 hierarchies hidden
    from `SandboxCgroups` (as on a host that has none) and `hugetlb` as the controller it wants."""
    prelude = textwrap.dedent(
        f"""
        import json, os
        from pathlib import Path
        open({str(v2_dir / "cgroup.procs")!r}, "w").write(str(os.getpid()))
        from retool_trl.sandbox.host import cgroups
        cgroups._V1 = ()
        cgroups._V2_CONTROLLERS = ("hugetlb",)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1])


def test_sandbox_delegates_controllers_from_a_cgroup_that_holds_the_trainer(v2_dir):
    """A trainer started in a cgroup of its own on a v2 host (a container's cgroup, a systemd scope): the kernel lets
    that cgroup pass no controller to the sandbox's cgroups while the trainer is in it. The sandbox moves the trainer
    into a leaf first, then each session's cgroup gets the controllers; the sandbox's own cgroup, which delegates,
    may hold no process (the kernel refuses one)."""
    result = _trainer(
        v2_dir,
        """
        sandbox = cgroups.SandboxCgroups("retool-sandbox-1-ab")
        root = Path(dict(sandbox.roots)["v2"])
        session = root / "j1"
        session.mkdir()
        try:
            (root / "cgroup.procs").write_text(str(os.getpid()))
            internal = "accepted"
        except OSError as exc:
            internal = exc.strerror
        own = open("/proc/self/cgroup").read().split("0::")[1].strip()
        print(json.dumps(dict(
            kinds=sorted(sandbox.kinds), missing=sandbox.missing, own=own,
            session_files=sorted(p.name for p in session.iterdir() if p.name.startswith("hugetlb.")),
            internal=internal,
        )))
        sandbox.remove()
        """,
    )
    assert "hugetlb" in result["kinds"] and "v2" in result["kinds"], result
    assert result["own"].endswith(f"/{v2_dir.name}/retool-trainer-" + result["own"].rsplit("-", 1)[1]), result
    assert any(name.endswith(".max") for name in result["session_files"]), result
    assert result["internal"] != "accepted", result
    assert not (v2_dir / "retool-sandbox-1-ab").exists()


def test_a_cgroup_shared_with_other_processes_is_named_not_taken(v2_dir):
    """A trainer sharing its cgroup with processes that are not its own (a container's init, a login shell): they
    are left where they are, the sandbox says in one line which controllers it could not get and how to fix it."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        (v2_dir / "cgroup.procs").write_text(str(other.pid))
        result = _trainer(
            v2_dir,
            """
            sandbox = cgroups.SandboxCgroups("retool-sandbox-1-cd")
            own = open("/proc/self/cgroup").read().split("0::")[1].strip()
            print(json.dumps(dict(kinds=sorted(sandbox.kinds), missing=sandbox.missing, own=own)))
            sandbox.remove()
            """,
        )
        assert str(other.pid) in (v2_dir / "cgroup.procs").read_text().split()
    finally:
        other.kill()
        other.wait()
    assert "hugetlb" not in result["kinds"], result
    assert result["own"].endswith(v2_dir.name), result
    line = next(m for m in result["missing"] if m.startswith("cgroup v2"))
    assert "holds other processes" in line and "Delegate=yes" in line, line


SPIN_AND_FORK = """
import os, time
for _ in range(8):
    if os.fork() == 0:
        while True:
            if os.fork() == 0:
                time.sleep(0.01)
                os._exit(0)
            time.sleep(0.005)
while True:
    pass
"""


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_freeze_stops_and_kill_ends_every_process_of_a_session(v2_dir):
    """A cell that spins and keeps forking (each child forks again): freezing its session's v2 cgroup stops every
    process at once (the spinner's CPU time stands still), thawing resumes it, and killing leaves no process, not
    one forked during the kill, so that the directory can be removed."""
    session = v2_dir / "j1"
    session.mkdir()
    cell = subprocess.Popen(
        [sys.executable, "-c", f"open({str(session / 'cgroup.procs')!r}, 'w').write('0')\n" + SPIN_AND_FORK]
    )
    try:
        deadline = time.monotonic() + 20
        while len((session / "cgroup.procs").read_text().split()) < 9 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert v2_freeze(session, True)
        before = _cpu_ticks(cell.pid)
        time.sleep(0.5)
        assert _cpu_ticks(cell.pid) == before, "a frozen process ran"
        assert v2_freeze(session, False)
        deadline = time.monotonic() + 20
        while _cpu_ticks(cell.pid) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _cpu_ticks(cell.pid) > before, "a thawed process did not run again"
        members = {int(p) for p in (session / "cgroup.procs").read_text().split()}
        assert v2_kill(session)
        assert not (session / "cgroup.procs").read_text().split()
        assert cell.wait(10) == -signal.SIGKILL
        alive = [pid for pid in members if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]
        assert not alive, alive
        session.rmdir()
    finally:
        cell.kill()
        cell.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_removing_a_v2_sandbox_ends_what_its_sessions_left(v2_dir):
    """A trainer killed without its clean-up (or a zygote that died) leaves a session's process in the sandbox's v2
    cgroup: removing the sandbox must end it (a v2 cgroup with a process cannot be removed), not leave both."""
    result = _trainer(
        v2_dir,
        """
        import subprocess, sys
        sandbox = cgroups.SandboxCgroups("retool-sandbox-1-ef")
        session = Path(dict(sandbox.roots)["v2"]) / "j1"
        session.mkdir()
        code = f"open({str(session / 'cgroup.procs')!r}, 'w').write('0')\\nimport time\\ntime.sleep(60)"
        left = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        while not (session / "cgroup.procs").read_text().split():
            pass
        sandbox.remove()
        status = left.wait(10)
        print(json.dumps(dict(status=status, exists=session.parent.exists())))
        """,
    )
    assert result == {"status": -signal.SIGKILL, "exists": False}, result
