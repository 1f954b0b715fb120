"""A whole GRPO batch of sessions side by side: nothing of a finished call runs on, no session takes another's CPU or
memory, and an outer kill is the sandbox's failure, not the cell's.

Each test stands for an attack or accident seen in a red-team pass over a batch of jailed sessions (the docstrings
say which), and checks the outcome against the kernel's own view (pid namespaces, cgroup files), not the sandbox's.
"""

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from retool_trl.sandbox import LocalSandbox

pytestmark = pytest.mark.timeout(180)


def _jail_processes(host_pid: int) -> list[int]:
    """Live (non-zombie) processes of the jail whose pid 1 is `host_pid`, other than that pid 1: every process whose
    pid namespace is the jail's, found by scanning /proc (an account independent of the sandbox's cgroups)."""
    try:
        ns = os.readlink(f"/proc/{host_pid}/ns/pid")
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == host_pid:
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != ns:
                continue
            state = Path(f"/proc/{entry}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def _jailed(sandbox):
    report = sandbox.isolation_report()
    if not report["jail_per_session"] or not report["pids_cgroup"]:
        pytest.skip(f"needs per-session jails and a pids cgroup (isolation level here: {report['isolation']})")
    return report


HOPPER_C = r"""
#include <signal.h>
#include <unistd.h>
int main(void) {
    signal(SIGCHLD, SIG_IGN);
    for (;;) {
        pid_t pid = fork();
        if (pid > 0) _exit(0);  /* the parent leaves at once: its child is the next hop */
    }
}
"""
COMPILE = f"""
import subprocess
open('/tmp/hop.c', 'w').write({HOPPER_C!r})
subprocess.run(['gcc', '-O1', '-o', '/tmp/hop', '/tmp/hop.c'], check=True, capture_output=True)
print('built')
"""
# The session's own sweep runs in the cell's interpreter and can be replaced; pid 1 ignoring SIGCHLD leaves no
# zombies behind the hoppers (each hop's parent is gone before anyone can list it).
TRICKS = """
import os, signal, sys
sys.modules['session_process']._kill_descendants = lambda uid: None
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
"""
HOP_COMPILED = (
    TRICKS
    + """
for _ in range(3):
    if os.fork() == 0:
        os.execv('/tmp/hop', ['/tmp/hop'])
print('hopping')
"""
)
HOP_PYTHON = (
    TRICKS
    + """
for _ in range(3):
    if os.fork() == 0:
        os.setsid()
        while True:
            if os.fork() > 0:
                os._exit(0)
print('hopping')
"""
)


@pytest.mark.parametrize("hopper", ["compiled", "python"])
def test_no_process_of_a_finished_call_survives(hopper):
    """Finding: a cell that replaced the in-cell killer, ignored SIGCHLD in pid 1 and started fork-and-exit hoppers
    kept processes running after its call returned ok (7 of 30 calls), which then starved the neighbours until the
    session closed. Now a call settles only once its jail holds just the parked interpreter: 100 of 100 calls leave
    no process behind."""
    if hopper == "compiled" and shutil.which("gcc") is None:
        pytest.skip("no gcc on this machine (the jail sees the host's)")
    with LocalSandbox(num_workers=2, timeout_s=20.0, memory_mb=512, max_processes=32, preload=()) as sb:
        _jailed(sb)
        s = sb.session()
        if hopper == "compiled":
            r = s.run(COMPILE)
            assert r.ok and r.output == "built\n", r
        code = HOP_COMPILED if hopper == "compiled" else HOP_PYTHON
        survived = []
        for _ in range(100):
            r = s.run(code)
            assert r.ok and r.output == "hopping\n", r
            survived.append(len(_jail_processes(s._proc.host_pid)))
        assert survived == [0] * 100, survived
        assert s.run("print('still here')").output == "still here\n"


ALLOCATE = "import os\nblock = bytearray(os.urandom(1 << 20)) * {mb}\nprint('earlier output', len(block) >> 20)"


def test_an_oom_beyond_the_sessions_own_limit_kills_the_session_holding_the_most():
    """Finding: sessions each within `memory_mb` but together above what the machine allowed: the OOM killer took
    the trainer (jails ran at oom_score_adj 0, the sandbox as a whole had no bound), or took an idle session whose
    next call then showed the previous cell's output. Later finding: at the sandbox's own bound the kernel picked by
    resident memory, so a session holding its memory in tmpfs files lived and a neighbour died as an infrastructure
    error (unscored). Here the sandbox's bound (below the sessions' sum) is reached: the session holding the most is
    killed, as its own memory failure (a snippet that fills the sandbox cannot unscore its completion), and no call
    shows another call's output."""
    with LocalSandbox(num_workers=2, timeout_s=20.0, memory_mb=400, total_memory_mb=300, preload=(), spares=0) as sb:
        report = _jailed(sb)
        if not report["memory_cgroup"]:
            pytest.skip("needs a memory cgroup")
        a, b = sb.session(), sb.session()
        assert a.run("print(open('/proc/self/oom_score_adj').read().strip())").output == "1000\n"
        first = [a.run(ALLOCATE.format(mb=180)), b.run(ALLOCATE.format(mb=180))]
        later = [a.run("print('later')"), b.run("print('later')")]
    results = first + later
    failed = [r for r in results if not r.ok]
    assert failed, results  # 360 MB do not fit in 300: one of them was killed
    for r in failed:
        assert not r.infra_error and "held the most" in r.output.splitlines()[-1], r
        assert "earlier output" not in r.output or r in first, r
    assert [r for r in later if r.ok] == [r for r in later if r.output == "later\n"], later


def test_a_kill_between_calls_shows_no_earlier_output():
    """Finding: a session killed from outside between two calls reported its death after the previous call's
    output."""
    with LocalSandbox(num_workers=1, timeout_s=5.0, preload=()) as sb:
        s = sb.session()
        assert s.run("print('earlier output')").output == "earlier output\n"
        if not sb._sessions_are_pid_one():  # as its neighbours in sandbox/host/test_parked_sessions_cpu.py
            pytest.skip("needs a pid namespace per session: without one a SIGKILL is the cell's own death")
        os.kill(s._proc.host_pid, 9)
        r = s.run("print('later')")
    assert r.infra_error and "earlier output" not in r.output, r


def test_a_closed_session_is_killed_at_once():
    """Finding: closed sessions waited, stopped but holding their memory, in batches of up to 32 until the zygote
    was idle. Now `close()` kills the jail as soon as the sandbox is quiet: its pid 1 is gone without any further
    call to the sandbox."""
    with LocalSandbox(num_workers=1, timeout_s=5.0, preload=()) as sb:
        s = sb.session()
        assert s.run("x = bytearray(50 << 20)").ok
        pid = s._proc.host_pid
        s.close()
        deadline = time.monotonic() + 1.0
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not _running(pid), "the jail's pid 1 outlived close() by 1 s in a quiet sandbox"


class _Churn:
    """Other completions' first calls arriving without a pause (each opens a session, runs it and closes it), as
    in a burst: the zygote is never quiet while it runs."""

    def __init__(self, sb):
        self.sb, self.stop, self.calls = sb, threading.Event(), 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            s = self.sb.session()
            s.run("pass")
            s.close()
            self.calls += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


def test_a_session_closed_in_a_burst_waits_frozen_and_not_for_long():
    """Stands for a GRPO burst of first calls in which completions that answered after one call close their
    sessions: a closed session's death waits for a quiet moment (its teardown would take CPU from the first
    calls), but while it waits nothing of it runs (a policy's timer resuming it computes nothing), and it dies
    within `RETIRE_WAIT_S` even if the zygote is never quiet."""
    from retool_trl.sandbox.jail.worker import RETIRE_WAIT_S

    with LocalSandbox(num_workers=2, timeout_s=10.0, preload=()) as sb:
        s = sb.session()
        assert s.run("pass").ok
        if not ({"freezer", "v2"} & set(s._proc.cgroups)):
            pytest.skip("needs a writable cgroup freezer: elsewhere a closed session is killed at once")
        from helpers.process_state import COMPUTE_BETWEEN_CALLS, process_cpu_s

        r = s.run(COMPUTE_BETWEEN_CALLS)  # a timer sends SIGCONT every 50 ms into a handler that spins
        assert r.ok and "armed" in r.output, r
        pid = s._proc.host_pid
        with _Churn(sb) as churn:
            time.sleep(0.05)
            s._proc._cancel_freeze()  # closed within a few ms of its call, before the host's own freeze (parking.py)
            s._proc._thaw()
            before = process_cpu_s(pid)
            closed_at = time.monotonic()
            s.close()
            while _running(pid) and time.monotonic() - closed_at < 10:
                cpu = process_cpu_s(pid) if _running(pid) else before
                assert cpu - before < 0.05, f"the closed session computed {cpu - before:.2f} CPU-s while it waited"
                time.sleep(0.005)
            gone_after = time.monotonic() - closed_at
            calls = churn.calls
        assert calls > 5, "the churn did not keep the zygote busy"
        assert not _running(pid) and gone_after < RETIRE_WAIT_S + 0.5, f"the closed session lived {gone_after:.2f} s"


def test_closed_sessions_give_their_memory_before_a_live_one_is_evicted():
    """Stands for a burst on a node whose sandbox memory is nearly full: a session closed moments ago (waiting,
    frozen, for a quiet moment to be killed) still holds 100 MB when a live neighbour needs more than is left. The
    closed one goes first, thawed so that it can die; the live one keeps running and gets its memory."""
    with LocalSandbox(num_workers=2, timeout_s=20.0, memory_mb=500, total_memory_mb=450, preload=(), spares=1) as sb:
        closed = sb.session()
        assert closed.run("pass").ok
        if "memory1" not in closed._proc.cgroups or not ({"freezer", "v2"} & set(closed._proc.cgroups)):
            pytest.skip(
                "needs cgroup v1 memory and freezer: the sandbox-wide memory watch and a frozen closed session"
            )
        live = sb.session()
        assert live.run("pass").ok
        assert closed.run("x = bytearray(100 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1").ok
        with _Churn(sb):
            time.sleep(0.05)
            closed.close()
            r = live.run("y = bytearray(360 << 20)\nfor i in range(0, len(y), 4096): y[i] = 1\nprint(len(y))")
        assert r.ok and r.output.strip() == str(360 << 20), r


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (neither gone nor a zombie). It may exit between any two reads of /proc, so
    one read of its stat file decides, and a process gone while it is read counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # FileNotFoundError or ProcessLookupError (ESRCH): it exited
        return False
    return stat.rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")


def test_running_reads_a_process_that_exits_without_racing():
    """Stands for the CI run that failed reading /proc/PID/stat of a jail that exited after the check for it: the
    liveness check sees a live process, a zombie and a reaped one as the kernel does, and never raises."""
    import subprocess

    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert _running(proc.pid)
        proc.kill()
        deadline = time.monotonic() + 10
        while _running(proc.pid) and time.monotonic() < deadline:  # a zombie until reaped: not running
            time.sleep(0.01)
        assert not _running(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert not _running(proc.pid)


SPINNERS = """
import os, time
for _ in range(8):
    if os.fork() == 0:
        os.setsid()  # its own scheduler autogroup, outside any process group the cell could be judged by
        while True:
            pass
time.sleep(60)
"""
NEIGHBOUR = "t = time.process_time()\nwhile time.process_time() - t < 0.15:\n    pass\nprint('done')"


def test_a_session_spinning_in_many_children_neither_starves_its_neighbour_nor_passes_its_cpu_budget():
    """Finding: a cell forked children that each `setsid()` and spin: a neighbour's 0.64 s cell took 4.6 s at 16
    children and timed out at 62, and the spinning call used ~9 CPU-seconds against `cpu_time_s=6` (the rlimit
    counts per process). Now a session has one CPU at most (its cpu cgroup's quota) and a call's CPU budget counts
    all its processes (cpuacct): the spinning call ends on its CPU budget, long before its wall-clock limit, and the
    neighbour's calls all finish without a timeout."""
    import threading

    with LocalSandbox(num_workers=2, timeout_s=60.0, cpu_time_s=2.0, max_processes=32, preload=()) as sb:
        report = _jailed(sb)
        if not report["cpu_cgroup"]:
            pytest.skip("needs a cpu cgroup")
        hog, neighbour = sb.session(), sb.session()
        assert neighbour.run("import time").ok and hog.run("pass").ok
        quota = Path(hog._proc.cgroups["cpu"], "cpu.cfs_quota_us").read_text() if "cpu" in hog._proc.cgroups else ""
        box = []
        runner = threading.Thread(target=lambda: box.append(hog.run(SPINNERS)))
        runner.start()
        results = []
        while runner.is_alive() and len(results) < 200:
            results.append(neighbour.run(NEIGHBOUR))
        runner.join(90)
    assert box and box[0].timed_out and "CPU time limit of 2 s exceeded" in box[0].output, box
    assert "execution exceeded" not in box[0].output
    assert results and all(r.ok and r.output == "done\n" for r in results), results
    assert quota.strip() == "100000"


def _live_jails(sandbox) -> set[int]:
    """Pids (the host's) of the jails alive in this sandbox, from the kernel's list of its per-jail cgroups."""
    roots = [path for kind, path in sandbox._cgroups.roots if kind in ("pids", "v2")]
    found = set()
    for root in roots[:1]:
        for child in Path(root).iterdir():
            try:
                found.update(int(p) for p in (child / "cgroup.procs").read_text().split()[:1])
            except (OSError, ValueError):
                continue
    return found


def _wait_for(predicate, limit_s=60.0):
    end = time.monotonic() + limit_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.05)
    return predicate()


def test_reserve_prepares_jails_before_the_sessions_are_opened_and_releases_them_unused():
    """Finding: a GRPO step opens a whole batch of sessions at once, and their first calls waited for jails to be
    forked (p99 2.7 s, dozens waiting 0.5-4 s every other burst). `reserve(n)` forks them while the model
    generates: the sessions' first calls then run in jails that existed before they were opened. Spares beyond
    the usual few are bounded by the sandbox's memory and released when nobody takes them."""
    with LocalSandbox(num_workers=1, timeout_s=10.0, preload=(), spares=1, total_memory_mb=16 * 10) as sb:
        _jailed(sb)
        sb.reserve(6)
        assert _wait_for(lambda: len(_live_jails(sb)) >= 6), _live_jails(sb)
        before = _live_jails(sb)
        sessions = [sb.session() for _ in range(6)]
        results = sb.run_many([(s, "print('first')") for s in sessions])
        assert all(r.output == "first\n" for r in results), results
        assert {s._proc.host_pid for s in sessions} <= before
        for s in sessions:
            s.close()
        sb.reserve_idle_s = 2.0
        sb._zygote.terminate()  # a fresh zygote takes the shorter hold
        assert sb.session().run("1").ok
        sb.reserve(100)  # bounded: 160 MB for the whole sandbox holds 10 reserved jails (16 MB each)
        peak = max(len(_live_jails(sb)) for _ in range(20) if time.sleep(0.05) is None)
        assert 10 <= peak <= 10 + 2, peak  # the reserve, the live session and one jail the host keeps at hand
        assert _wait_for(lambda: len(_live_jails(sb)) <= 3), _live_jails(sb)  # released unused
