"""Budgets the sandbox shares with the trainer and the machine: descriptors, tasks, memory held in scratch files.

Each test runs a small trainer script in a child process, under the real limit it is about (a soft RLIMIT_NOFILE of
1,024, a pids cgroup standing for a container's task limit, a sandbox-wide memory bound), and attacks it through the
public API the way a reward-hacking policy would. Where the host cannot set that limit (not root, no pids cgroup),
the test is skipped with the reason.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from retool_trl.sandbox import LocalSandbox

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[3]
PIDS = Path("/sys/fs/cgroup/pids")


def _report() -> dict:
    with LocalSandbox(num_workers=1, spares=1) as sandbox:
        return sandbox.isolation_report()


@pytest.fixture(scope="module")
def report():
    return _report()


def _need_root_pids():
    if os.geteuid() != 0 or not (PIDS / "cgroup.procs").exists():
        pytest.skip("needs root and a cgroup v1 pids hierarchy to put the trainer under a task limit")
    own = next(
        (line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines() if ":pids:" in line),
        None,
    )
    if own is None:
        pytest.skip("this process is in no pids cgroup")
    return PIDS / own.lstrip("/")


def _run_trainer(script: str, pids_max: int | None = None, nofile: int | None = None, timeout_s: float = 200) -> dict:
    """Runs `script` as a trainer in a fresh child: in a pids cgroup of its own capped at `pids_max` (a container's
    task limit), with a soft RLIMIT_NOFILE of `nofile`. The script prints one JSON line last; it is returned."""
    cgroup = None
    if pids_max is not None:
        cgroup = _need_root_pids() / f"retool-test-budget-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        cgroup.mkdir()
        (cgroup / "pids.max").write_text(str(pids_max))
    prelude = "import os, resource, sys\n"
    if nofile is not None:
        hard = "resource.getrlimit(resource.RLIMIT_NOFILE)[1]"
        prelude += f"resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {hard}))\n"
    if cgroup is not None:
        prelude += f"open({str(cgroup / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        done = subprocess.run(
            [sys.executable, "-c", prelude + textwrap.dedent(script)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=str(REPO),
        )
    finally:
        if cgroup is not None:
            for child in sorted(cgroup.rglob("*"), reverse=True):
                if child.is_dir():
                    child.rmdir()
            cgroup.rmdir()
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"trainer script failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_128_first_calls_under_the_common_descriptor_limit():
    """A trainer started with the usual soft limit of 1,024 open files (most distributions' default) runs a rollout
    batch of 128 first calls at once: every call runs (the sandbox must not need more descriptors per live session
    than that limit allows, nor end the batch with "too many open files")."""
    result = _run_trainer(
        """
        import json
        from retool_trl.sandbox import LocalSandbox
        with LocalSandbox(num_workers=2, timeout_s=60, memory_mb=512, spares=2) as sandbox:
            sessions = [sandbox.session() for _ in range(128)]
            results = sandbox.run_many([(s, f"print({i} * 2)") for i, s in enumerate(sessions)])
            good = sum(r.ok and r.output == f"{i * 2}\\n" for i, r in enumerate(results))
            errors = sorted({r.output.strip().splitlines()[-1] for r in results if not r.ok})[:3]
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        print(json.dumps({"good": good, "errors": errors, "soft": soft}))
        """,
        nofile=1024,
    )
    assert result["good"] == 128, result


def test_parked_sessions_hold_few_descriptors_under_a_hard_limit_of_1024():
    """A trainer whose hard limit on open files is 1,024 too (a container started with `--ulimit nofile=1024`, where
    the soft limit cannot be raised): 150 live sessions, opened by rollout turns of 32 calls, all keep answering. A
    parked session must hold only the descriptors it cannot do without (before: 9 each, 1,350 for 150)."""
    result = _run_trainer(
        """
        import json
        from retool_trl.sandbox import LocalSandbox
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        with LocalSandbox(num_workers=2, timeout_s=60, memory_mb=512, spares=2) as sandbox:
            sessions = [sandbox.session() for _ in range(150)]
            good = 0
            for turn in range(2):
                for start in range(0, 150, 32):
                    batch = sessions[start : start + 32]
                    results = sandbox.run_many([(s, f"x = {turn}\\nprint(x + 1)") for s in batch])
                    good += sum(r.ok and r.output == f"{turn + 1}\\n" for r in results)
            fds = len(os.listdir("/proc/self/fd"))
        print(json.dumps({"good": good, "fds": fds}))
        """
    )
    assert result["good"] == 300, result


def test_out_of_descriptors_fails_the_calls_that_cannot_start_and_leaks_nothing():
    """A trainer that runs out of open files anyway (a hard limit of 200 here, far more sessions than fit): the
    calls whose sessions cannot start fail alone, as infrastructure errors that say which limit to raise, never as
    an exception out of `run_many` or a time-out blamed on the cell; closing sessions gives the descriptors back, and
    new sessions then work."""
    result = _run_trainer(
        """
        import json
        from retool_trl.sandbox import LocalSandbox
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
        with LocalSandbox(num_workers=2, timeout_s=20, memory_mb=512, spares=2) as sandbox:
            assert sandbox.session().run("1").ok
            base = len(os.listdir("/proc/self/fd"))
            sessions, results = [], []
            for _ in range(8):
                batch = [sandbox.session() for _ in range(8)]
                sessions += batch
                results += sandbox.run_many([(s, "print('up')") for s in batch])
            failed = [r for r in results if not r.ok]
            lines = sorted({r.output.strip().splitlines()[-1] for r in failed})
            shape = sorted({(r.infra_error, r.timed_out) for r in failed})
            slowest = max((r.duration_s for r in failed), default=0.0)
            for s in sessions:
                s.close()
            after = len(os.listdir("/proc/self/fd"))
            again = [sandbox.session() for _ in range(8)]
            good = sum(r.ok for r in sandbox.run_many([(s, "print('up')") for s in again]))
        print(json.dumps(dict(ok=len(results) - len(failed), failed=len(failed), lines=lines, shape=shape,
                              slowest=slowest, base=base, after=after, good=good)))
        """
    )
    assert result["failed"] > 0, f"every session fitted: the test did not run out of descriptors ({result})"
    assert result["shape"] == [[True, False]], result
    assert all("open-file limit" in line for line in result["lines"]), result
    assert result["slowest"] < 10, result  # told at once, not after the 30 s a jail may take to set up
    assert result["after"] <= result["base"] + 4 and result["good"] == 8, result


def test_failed_forks_leave_no_descriptors_or_cgroups(report):
    """A container's task limit reached while the zygote forks jails (a burst of sessions, or a policy's processes
    filling it): every fork refused must clean up after itself. After bursts of refused forks the zygote holds no more
    descriptors than before and no cgroup directory of a jail that never ran is left, and once tasks are free again
    64 sessions all work (before, each refused fork kept 7 descriptors and its cgroups, and later sessions failed)."""
    if not report["pids_cgroup"]:
        pytest.skip(f"needs a pids cgroup (isolation level here: {report['isolation']})")
    own = _need_root_pids()
    result = _run_trainer(
        f"""
        import json, time
        from pathlib import Path
        import psutil
        from retool_trl.sandbox import LocalSandbox

        here = Path({str(own)!r}) / Path(open("/proc/self/cgroup").read().split(":pids:")[1].split()[0]).name

        def zygote():
            procs = [p for p in psutil.Process().children(recursive=True) if "worker.py" in " ".join(p.cmdline())]
            pythons = {{p.pid for p in procs if "bwrap" not in p.name()}}
            return next(p for p in procs if p.pid in pythons and p.ppid() not in pythons)

        def jail_dirs(sandbox):
            return sum(1 for _, root in sandbox._cgroups.roots for d in Path(root).iterdir() if d.is_dir())

        with LocalSandbox(num_workers=2, timeout_s=30, memory_mb=512, spares=2) as sandbox:
            assert sandbox.session().run("1").ok
            time.sleep(0.5)
            z = zygote()
            fds_before, dirs_before = z.num_fds(), jail_dirs(sandbox)
            refused = 0
            for burst in range(4):
                (here / "pids.max").write_text(str(int((here / "pids.current").read_text())))
                sessions = [sandbox.session() for _ in range(16)]
                refused += sum(not r.ok for r in sandbox.run_many([(s, "1") for s in sessions]))
                for s in sessions:
                    s.close()
                time.sleep(0.3)  # the zygote's refill keeps trying (and failing) meanwhile
                (here / "pids.max").write_text("max")
                time.sleep(0.3)
            (here / "pids.max").write_text("max")
            time.sleep(1.0)
            fds_after = z.num_fds()
            dirs_after = jail_dirs(sandbox)
            sessions = [sandbox.session() for _ in range(64)]
            good = sum(r.ok and r.output == "3\\n" for r in sandbox.run_many([(s, "print(1 + 2)") for s in sessions]))
            live = len(sessions)
        print(json.dumps(dict(fds_before=fds_before, fds_after=fds_after, dirs_before=dirs_before,
                              dirs_after=dirs_after, refused=refused, good=good, live=live)))
        """,
        pids_max=100_000,
        nofile=1024,
    )
    assert result["refused"] > 0, f"no fork was refused: the test did not exercise its condition ({result})"
    assert result["fds_after"] <= result["fds_before"] + 4, result
    assert result["dirs_after"] <= result["dirs_before"] + 4, result
    assert result["good"] == 64, result


HOG = """
import os, time
kids = 0
for _ in range(80):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(8)
        os._exit(0)
    kids += 1
time.sleep(6)
print(kids)
"""


def test_sessions_together_cannot_exhaust_a_container_task_limit(report):
    """A container's task limit (here a pids cgroup of 400 tasks around the trainer, standing for Docker's
    `--pids-limit` or a Kubernetes pod's): 8 policy sessions each keep within their own process cap yet together hold
    more than the container allows. Sessions opened meanwhile by innocents still start and answer (not
    infrastructure errors), and the trainer can still start threads and `reserve()` jails."""
    if not report["pids_cgroup"]:
        pytest.skip(f"needs a pids cgroup (isolation level here: {report['isolation']})")
    result = _run_trainer(
        f"""
        import json, threading, time
        from retool_trl.sandbox import LocalSandbox
        HOG = {HOG!r}
        with LocalSandbox(num_workers=2, timeout_s=30, memory_mb=512, max_processes=64, spares=2) as sandbox:
            hogs = [sandbox.session() for _ in range(8)]
            hog_results = []
            runner = threading.Thread(target=lambda: hog_results.extend(sandbox.run_many([(s, HOG) for s in hogs])))
            runner.start()
            time.sleep(4)  # the hogs have forked what they could and hold it
            innocents = [sandbox.session() for _ in range(6)]
            results = sandbox.run_many([(s, "print(sum(range(10)))") for s in innocents])
            good = sum(r.ok and r.output == "45\\n" for r in results)
            infra = sum(r.infra_error for r in results)
            started, stop = 0, threading.Event()
            threads = []
            for _ in range(16):
                t = threading.Thread(target=stop.wait)
                try:
                    t.start()
                    threads.append(t)
                    started += 1
                except RuntimeError:
                    break
            try:
                sandbox.reserve(8)
                reserved = True
            except RuntimeError:
                reserved = False
            stop.set()
            for t in threads:
                t.join()
            runner.join()
            kids = [int(r.output) if r.ok else -1 for r in hog_results]
        print(json.dumps(dict(good=good, infra=infra, started=started, reserved=reserved, kids=kids)))
        """,
        pids_max=400,
    )
    assert result["good"] == 6 and result["infra"] == 0, result
    assert result["started"] == 16 and result["reserved"], result
    assert sum(result["kids"]) < 400, result  # the hogs were bounded below the container's limit


PARK_FILES = """
import os
for i in range(12):
    with open(f"/dev/shm/park{i}", "wb") as f:
        f.write(os.urandom(1 << 20) * 15)
print("parked")
"""


def test_files_parked_in_tmpfs_count_against_their_own_session(report):
    """A policy parks files in its sessions' `/dev/shm` (a tmpfs: memory that belongs to no process) until the
    sandbox-wide memory bound is nearly reached, then an innocent session needs memory, both by allocating and by
    writing files of its own. A session holding the most (its files included) must be the one killed, reported as
    its own memory failure, not the innocent, whose kill would read as an infrastructure error and take its
    completion out of the loss (and whose writes must not fail for lack of memory)."""
    if not (report["memory_cgroup"] and report["jail_per_session"]):
        pytest.skip(f"needs a memory cgroup and a private /dev/shm per session (level here: {report['isolation']})")
    with LocalSandbox(num_workers=2, timeout_s=30, memory_mb=300, total_memory_mb=700, spares=1) as sandbox:
        hogs = [sandbox.session() for _ in range(3)]
        parked = sandbox.run_many([(s, PARK_FILES) for s in hogs])
        innocent = sandbox.session()
        result = innocent.run("data = b'x' * (100 << 20)\nprint(len(data) >> 20)")
        assert result.ok and result.output == "100\n" and not result.infra_error, result
        # The kernel frees a killed session's files a moment after its death (documented): then writes work too.
        root = dict(sandbox._cgroups.roots)["memory1"]
        deadline = time.monotonic() + 10
        while int(Path(root, "memory.usage_in_bytes").read_text()) > 600 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        written = innocent.run(PARK_FILES.replace("range(12)", "range(2)").replace("/dev/shm", "/tmp"))
        assert written.ok and written.output == "parked\n", written
        after = [r if not r.ok else s.run("print('alive')") for s, r in zip(hogs, parked)]
        killed = [r for r in after if not r.ok]
        assert killed, "no session was killed, yet the sandbox's memory bound was exceeded"
        for r in killed:
            assert not r.infra_error and "held the most" in r.output.strip().splitlines()[-1], r
        assert innocent.run("print(len(data) >> 20)").output == "100\n"


def test_ranks_on_one_node_share_the_task_budget(report):
    """`accelerate launch` starts 4 trainers in one container (`LOCAL_WORLD_SIZE=4`), each with its own sandbox:
    together their sessions may start no more tasks than one sandbox alone would, so that the 4 of them cannot
    exhaust the container's task limit either."""
    if not report["pids_cgroup"]:
        pytest.skip(f"needs a pids cgroup (isolation level here: {report['isolation']})")
    script = """
        import json
        from pathlib import Path
        from retool_trl.sandbox import LocalSandbox
        from retool_trl.sandbox.host.machine_limits import task_budget
        left = task_budget()
        with LocalSandbox(num_workers=1, spares=1) as sandbox:
            sandbox.isolation_report()
            root = dict(sandbox._cgroups.roots)["pids"]
            written = int(Path(root, "pids.max").read_text())
        print(json.dumps({"left": left, "written": written}))
        """
    alone = _run_trainer(script, pids_max=2000)
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "4", "0"
    try:
        shared = _run_trainer(script, pids_max=2000)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"]
    assert alone["written"] <= alone["left"] - 64, alone
    assert 4 * shared["written"] <= alone["written"] + 8, (alone, shared)


def test_a_session_filling_its_own_tmpfs_past_its_memory_bound_fails_alone(report):
    """A cell writes more into its private `/dev/shm` than its own `memory_mb`: the files are charged to its own
    memory cgroup, whose limit ends the session at once with its own `MemoryError` (not a hang until the time-out,
    which is what a session cgroup that inherited the sandbox's disabled OOM killer would give), and a neighbour's
    next call runs."""
    if not (report["memory_cgroup"] and report["jail_per_session"]):
        pytest.skip(f"needs a memory cgroup and a private /dev/shm per session (level here: {report['isolation']})")
    code = PARK_FILES.replace("range(12)", "range(20)")
    with LocalSandbox(num_workers=2, timeout_s=30, memory_mb=200, spares=1) as sandbox:
        hog, neighbour = sandbox.session(), sandbox.session()
        assert neighbour.run("x = 1").ok
        result = hog.run(code)
        assert not result.ok and not result.timed_out and not result.infra_error, result
        assert result.output.strip().splitlines()[-1].startswith("MemoryError: memory limit of 200 MB"), result
        assert neighbour.run("print(x + 1)").output == "2\n"
