"""Red team round 5: the levels where a cell shares an owner with what lies outside its scratch.

Root in a default rootful container (podman/docker with runc: no CAP_SYS_ADMIN, no CAP_SYS_PTRACE, read-only cgroups)
runs every session as uid 0, which owns root's files and the trainer's processes; a normal user without user
namespaces runs every session as the trainer's own uid. Landlock governs what a cell reads and writes, not the
metadata of files nor the calls that act on another process of its uid, and no cgroup counts its memory, tasks or
files. Each test runs one attack through the public API (`LocalSandbox(isolation="landlock")`, `session().run`) and
checks what the trainer itself observes (a file's stat, a process's limits, the cell's own count of what it held),
never the cell's word that it failed. `scripts/ci/test_containers.sh` runs this file inside a default container and as
a normal user with user namespaces allowed (the `bwrap` level, sessions sharing the user's uid) and blocked; on a
host where the trainer is root with every capability the same attacks meet a uid per session and cgroups, and must
fail there too. Each test runs on both levels, `landlock` and `bwrap`, where that level runs.
"""

import os
import subprocess
import sys
import time

import pytest

from retool_trl.sandbox import LocalSandbox
from retool_trl.sandbox.host.zygote import SandboxStartError

pytestmark = pytest.mark.timeout(240)

MEMORY_MB = 192
MAX_PROCESSES = 16
SCRATCH_MB = 32
MAX_FILES = 2000
FILE_MB = 64


@pytest.fixture(scope="module", params=["landlock", "bwrap"])
def sandbox(request):
    sb = LocalSandbox(
        isolation=request.param,
        num_workers=2,
        spares=2,
        timeout_s=20.0,
        memory_mb=MEMORY_MB,
        max_processes=MAX_PROCESSES,
        max_file_size_mb=FILE_MB,
        scratch_mb=SCRATCH_MB,
        max_files=MAX_FILES,
        preload=(),
    )
    try:
        sb.isolation_report()
    except SandboxStartError as exc:
        pytest.skip(f"the {request.param} level does not run here ({str(exc).rsplit(': ', 1)[-1][:80]})")
    yield sb
    sb.close()


def _healthy(sandbox):
    s = sandbox.session()
    r = s.run("print(6 * 7)")
    s.close()
    assert r.ok and r.output == "42\n", r


def test_a_cell_cannot_lock_its_neighbour_out_of_its_scratch(sandbox):
    """Root in a default container (sessions are uid 0): cell A set mode 0 (and its times) on neighbour B's scratch
    directory, whose name it derived from its own; B could then no longer create or open files in its own cwd, and
    its cells failed as the model's own errors. B must keep working in its scratch, mode and times unchanged."""
    a, b = sandbox.session(), sandbox.session()
    r = b.run("import os\nst = os.stat('.')\nprint(os.getcwd(), oct(st.st_mode & 0o7777), st.st_mtime_ns)")
    assert r.ok, r
    path, mode, mtime = r.output.split()
    attack = f"""
import os
for name, call in [("chmod", lambda: os.chmod({path!r}, 0)), ("utime", lambda: os.utime({path!r}, (1, 1))),
                   ("chown", lambda: os.chown({path!r}, 12345, 12345))]:
    try:
        call()
        print(name, "done")
    except OSError as exc:
        print(name, exc.errno)
"""
    a.run(attack)
    r = b.run(
        "import os\nopen('mine.txt', 'w').write('kept')\nst = os.stat('.')\n"
        "print(open('mine.txt').read(), oct(st.st_mode & 0o7777), st.st_mtime_ns)"
    )
    assert r.ok, r
    kept, mode_after, _ = r.output.split()
    assert (kept, mode_after) == ("kept", mode), r.output
    a.close()
    b.close()


def test_root_in_a_container_gives_each_session_a_uid_of_its_own(sandbox):
    """Root in a default container (CAP_SETUID but no CAP_SYS_PTRACE): every session ran as uid 0, which owns root's
    files and is exempt from RLIMIT_NPROC, because the trainer could not read a session of another uid's
    /proc/PID/syscall. Root that may change uids must give each session a uid of its own, and still run its calls."""
    with open("/proc/self/status") as f:
        capabilities = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    if os.geteuid() != 0 or not capabilities >> 7 & 1 or not capabilities >> 6 & 1:
        pytest.skip("needs root that may change uids (CAP_SETUID, CAP_SETGID): a normal user's sessions share its uid")
    from retool_trl.sandbox.isolation import fsuid

    if fsuid.needed() and not fsuid.works():
        pytest.skip("this kernel refuses a process of another uid's /proc/PID/syscall to root without CAP_SYS_PTRACE")
    assert sandbox.isolation_report()["own_uid_per_session"]
    uids = []
    for s in (sandbox.session(), sandbox.session()):
        r = s.run("import os\nos.getuid()")
        r2 = s.run("print(sum(range(10)))")
        assert r.ok and r2.ok and r2.output == "45\n", (r, r2)
        uids.append(int(r.output))
        s.close()
    assert 0 not in uids and uids[0] != uids[1], uids


def test_scratch_names_are_not_derivable_from_ones_own(sandbox):
    """Root in a default container: scratch names were a serial number after a per-sandbox prefix, so a cell that
    read its own `os.getcwd()` knew the next sessions' directories. Each name must carry a long random part."""
    sessions = [sandbox.session() for _ in range(3)]
    names = []
    for s in sessions:
        r = s.run("import os\nprint(os.path.basename(os.getcwd()))")
        assert r.ok, r
        names.append(r.output.strip())
        s.close()
    assert len(set(names)) == 3, names
    shared = len(os.path.commonprefix(names))
    assert all(len(name) - shared >= 16 for name in names), names


@pytest.fixture
def trainer_files(tmp_path):
    """A file and a checkpoint directory of the trainer's own, with known modes and times."""
    secret = tmp_path / ".env"
    secret.write_text("HF_TOKEN=hf_xxx\n")
    os.chmod(secret, 0o600)
    os.utime(secret, (1_000_000, 1_000_000))
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)  # reachable by a session of another uid: the modes, not the path, must stop it
    return secret, checkpoints


def test_a_cell_cannot_change_the_metadata_of_the_trainers_files(sandbox, trainer_files):
    """Root in a default container, and a normal user (`isolation="landlock"`): sessions own the trainer's files, and
    Landlock does not govern metadata. A cell made the trainer's `.env` world-readable, changed its times, set its
    checkpoint directory to mode 000 (the next checkpoint write failed and the run ended) and could chattr or
    setxattr them. The trainer must see every mode, time, owner and attribute unchanged, and still write its
    checkpoint."""
    secret, checkpoints = trainer_files
    before = {p: os.stat(p) for p in (secret, checkpoints)}
    attack = f"""
import ctypes, fcntl, os, struct
paths = [{str(secret)!r}, {str(checkpoints)!r}]
for path in paths:
    for name, call in [
        ("chmod", lambda: os.chmod(path, 0o666 if path.endswith(".env") else 0)),
        ("utime", lambda: os.utime(path, (2, 2))),
        ("chown", lambda: os.chown(path, 4242, 4242)),
        ("setxattr", lambda: os.setxattr(path, "user.owned", b"1")),
    ]:
        try:
            call()
            print(name, path, "done")
        except OSError as exc:
            print(name, path, exc.errno)
fd = os.open(paths[0], os.O_RDONLY)
for name, call in [("fchmod", lambda: os.fchmod(fd, 0o644)), ("futime", lambda: os.utime(fd, (3, 3))),
                   ("chattr", lambda: fcntl.ioctl(fd, 0x40086602, struct.pack("l", 0x40)))]:
    try:
        call()
        print(name, "done")
    except OSError as exc:
        print(name, exc.errno)
"""
    r = sandbox.session().run(attack)
    for path, st in before.items():
        now = os.stat(path)
        assert (now.st_mode, now.st_uid, now.st_gid, now.st_mtime_ns) == (
            st.st_mode,
            st.st_uid,
            st.st_gid,
            st.st_mtime_ns,
        ), (path, r.output)
        try:
            assert os.listxattr(path) == [], r.output
        except OSError:
            pass  # a file system without extended attributes: none could be set either
    (checkpoints / "step-1.pt").write_bytes(b"weights")


def test_a_cell_cannot_act_on_the_trainers_processes(sandbox):
    """Root in a default container, and a normal user: a session shares the uid of the trainer's processes, and
    Landlock scopes signals but not `prlimit`, `sched_setaffinity` or `setpriority`. A cell could lower the limits of
    a trainer's process (its open files, its stack), pin it to one CPU or renice it. The trainer's process (a child
    of it here, like a data loader worker) must keep its limits, CPUs and priority."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        before = (os.sched_getaffinity(victim.pid), os.getpriority(os.PRIO_PROCESS, victim.pid))
        import resource

        limit = resource.prlimit(victim.pid, resource.RLIMIT_NOFILE)
        attack = f"""
import os, resource
pid = {victim.pid}
for name, call in [("prlimit", lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (8, 8))),
                   ("affinity", lambda: os.sched_setaffinity(pid, {{0}})),
                   ("nice", lambda: os.setpriority(os.PRIO_PROCESS, pid, 19))]:
    try:
        call()
        print(name, "done")
    except OSError as exc:
        print(name, exc.errno)
"""
        r = sandbox.session().run(attack)
        after = (os.sched_getaffinity(victim.pid), os.getpriority(os.PRIO_PROCESS, victim.pid))
        assert after == before, r.output
        assert resource.prlimit(victim.pid, resource.RLIMIT_NOFILE) == limit, r.output
    finally:
        victim.kill()
        victim.wait()


# Several memfds, each under the per-file size limit (RLIMIT_FSIZE bounds a memfd too).
_MEMFD = f"""
import os, time
held, fds = 0, []
try:
    while held < {3 * MEMORY_MB} << 20:
        fds.append(os.memfd_create("hidden"))
        for _ in range({FILE_MB // 16}):
            os.write(fds[-1], b"x" * (16 << 20))
            held += 16 << 20
except OSError as exc:
    print("refused", exc.errno)
time.sleep(0.5)
print("held", held >> 20)
"""

# SysV shared memory: each of a few child processes attaches a segment under its address-space limit, marked for
# removal so that nothing outlives the session whatever the sandbox does; attached shared pages are not private
# resident memory. The children hold it while the cell waits.
_SYSV = f"""
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
piece, pieces = {MEMORY_MB // 2} << 20, 6
ready_r, ready_w = os.pipe()
for _ in range(pieces):
    if os.fork() == 0:
        sid = libc.shmget(0, piece, 0o1600)
        address = libc.shmat(sid, None, 0) if sid >= 0 else None
        libc.shmctl(sid, 0, None)  # IPC_RMID: gone with its last user
        ok = address not in (None, ctypes.c_void_p(-1).value)
        if ok:
            ctypes.memset(address, 1, piece)
        os.write(ready_w, b"1" if ok else b"0")
        time.sleep(3)
        os._exit(0)
held = sum(piece for byte in os.read(ready_r, 1) + b"".join(os.read(ready_r, 1) for _ in range(pieces - 1))
           if byte == ord("1"))
time.sleep(0.5)
print("held", held >> 20)
"""


# Shared anonymous maps (`mmap.mmap(-1, n)`, what multiprocessing uses): shmem pages, which /proc/PID/statm's
# "shared" column holds, so resident minus shared hid them. Each child maps and fills one under its address-space
# limit and holds it while the cell waits.
_SHARED_ANON = f"""
import mmap, os, time
piece, pieces = {MEMORY_MB // 2} << 20, 6
ready_r, ready_w = os.pipe()
for _ in range(pieces):
    if os.fork() == 0:
        try:
            area, chunk = mmap.mmap(-1, piece), b"x" * (1 << 20)
            for offset in range(0, piece, len(chunk)):
                area[offset : offset + len(chunk)] = chunk
            os.write(ready_w, b"1")
        except (OSError, MemoryError):
            os.write(ready_w, b"0")
        time.sleep(3)
        os._exit(0)
held = sum(piece for byte in os.read(ready_r, 1) + b"".join(os.read(ready_r, 1) for _ in range(pieces - 1))
           if byte == ord("1"))
time.sleep(0.5)
print("held", held >> 20)
"""


@pytest.mark.parametrize("code", [_MEMFD, _SYSV, _SHARED_ANON], ids=["memfd", "sysv_shm", "shared_anon"])
def test_memory_hidden_outside_the_resident_set_is_refused_or_counted(sandbox, code):
    """Root in a default container, and a normal user: no memory cgroup, and the watchdog sums private resident
    memory. A cell held 600 MB under memory_mb=256 in a memfd (in no process's resident set, outside RLIMIT_AS), or
    in SysV shared memory. Holding three times `memory_mb` must be refused or end the session."""
    r = sandbox.session().run(code)
    held = [int(line.split()[1]) for line in r.output.splitlines() if line.startswith("held ")]
    assert not (r.ok and held and held[0] > MEMORY_MB), r.output
    _healthy(sandbox)


def test_threads_count_against_max_processes(sandbox):
    """Root in a default container (RLIMIT_NPROC does not apply to uid 0, no pids cgroup), and a normal user: the
    watchdog counted processes, not threads, so a cell ran hundreds of threads under max_processes=64, each a task
    of the container's pids limit that the trainer shares. Four times `max_processes` threads must not run."""
    code = f"""
import threading, time
threading.stack_size(256 << 10)
started, threads = 0, []
try:
    for _ in range({4 * MAX_PROCESSES}):
        threads.append(threading.Thread(target=time.sleep, args=(1.5,)))
        threads[-1].start()
        started += 1
except RuntimeError as exc:
    print("refused", exc)
for thread in threads:
    thread.join()
print("started", started)
"""
    r = sandbox.session().run(code)
    started = [int(line.split()[1]) for line in r.output.splitlines() if line.startswith("started ")]
    assert not (r.ok and started and started[0] > MAX_PROCESSES), r.output
    _healthy(sandbox)


def test_scratch_is_bounded_as_a_tree(sandbox):
    """Root in a default container, and a normal user: the scratch lies on the host's temp file system (often the
    checkpoint disk) and only each file was bounded, so a cell wrote 75 MB under scratch_mb=32 in several files. Two
    times `scratch_mb` in files under the per-file bound must fail or end the session."""
    r = sandbox.session().run(fill_scratch(pause_s=0.02))
    assert not wrote_past_scratch(r), r.output
    _healthy(sandbox)


def fill_scratch(setup: str = "", into: str = "", pause_s: float = 0.05) -> str:
    """A cell that writes two times `scratch_mb` in 4 MB files (each under the per-file bound) into `into` after
    running `setup`, then says how much it wrote."""
    return f"""
import os, time
{setup}
written = 0
try:
    for i in range({2 * SCRATCH_MB // 4}):
        with open(f"{into}part-{{i}}.bin", "wb") as f:
            f.write(os.urandom(4 << 20))
        written += 4
        time.sleep({pause_s})
except OSError as exc:
    print("refused", exc.errno)
time.sleep(0.5)
print("written", written)
"""


def wrote_past_scratch(result) -> bool:
    """Whether a `fill_scratch` cell ended well having written more than `scratch_mb`."""
    written = [int(line.split()[1]) for line in result.output.splitlines() if line.startswith("written ")]
    return bool(result.ok and written and written[0] > SCRATCH_MB)


# 20 levels of 250-character names: past PATH_MAX from the scratch, reached by relative paths.
_DEEP = fill_scratch('for _ in range(20):\n    os.mkdir("d" * 250)\n    os.chdir("d" * 250)')
# Writable and enterable, not listable: by the zygote either where it is the same uid.
_UNLISTABLE = fill_scratch('os.mkdir("hidden", 0o300)', into="hidden/")


@pytest.mark.parametrize("code", [_DEEP, _UNLISTABLE], ids=["past_path_max", "unlistable_dir"])
def test_scratch_the_watchdog_cannot_walk_still_counts(sandbox, code):
    """A normal user (the zygote shares the cell's uid, so a directory of mode 0o300 is unlistable to it) and root in a
    default container (paths past PATH_MAX): the scratch walk skipped what it could not open, so files there were
    never counted. A tree the zygote cannot walk must count as over its bound, and the cell's writes must end."""
    r = sandbox.session().run(code)
    assert not wrote_past_scratch(r), r.output
    _healthy(sandbox)


def test_an_unlistable_directory_does_not_outlive_its_session(tmp_path):
    """A normal user: the cell may not chmod, so a 0o300 directory it made stayed unremovable by a plain rmtree run
    as the same uid, and the scratch leaked. The zygote's removal opens it up first. (Run as whoever runs the tests:
    as root the plain removal already succeeds, and the test still checks that nothing is left.)"""
    from retool_trl.sandbox.jail.watchdog import remove_scratch

    scratch = tmp_path / "jscratch"
    deep = scratch / "hidden" / "inner"
    deep.mkdir(parents=True)
    (deep / "f.bin").write_bytes(b"x" * 1000)
    (scratch / "hidden" / "inner").chmod(0o300)
    (scratch / "hidden").chmod(0o300)
    remove_scratch(str(scratch))
    assert not scratch.exists()


def test_scratch_file_count_is_bounded(sandbox):
    """Root in a default container, and a normal user: no tmpfs bounds the inodes of the scratch, so a cell could fill
    the host disk's inode table with empty files. More than `max_files` entries must fail or end the session."""
    code = f"""
import os, time
made = 0
try:
    for i in range({MAX_FILES + 500}):
        open(f"f{{i}}", "w").close()
        made += 1
except OSError as exc:
    print("refused", exc.errno)
time.sleep(0.5)
print("made", made)
"""
    r = sandbox.session().run(code)
    made = [int(line.split()[1]) for line in r.output.splitlines() if line.startswith("made ")]
    assert not (r.ok and made and made[0] > MAX_FILES), r.output
    _healthy(sandbox)


def test_ordinary_work_still_runs_in_the_scratch(sandbox):
    """Every condition: with metadata changes and memfds refused, a cell's ordinary work (files in its scratch,
    temporary files, numpy, sympy, a matplotlib figure, threads and a subprocess) still runs as it did."""
    code = """
import os, subprocess, tempfile, threading
import numpy as np
import sympy as sp
with open("data.csv", "w") as f:
    f.write("1,2\\n3,4\\n")
a = np.loadtxt("data.csv", delimiter=",")
x = sp.symbols("x")
with tempfile.NamedTemporaryFile("w+") as t:
    t.write("ok")
    t.flush()
    t.seek(0)
    tmp = t.read()
results = []
workers = [threading.Thread(target=lambda: results.append(1)) for _ in range(4)]
[w.start() for w in workers]
[w.join() for w in workers]
echo = subprocess.run(["echo", "hi"], capture_output=True, text=True).stdout.strip()
print(int(a.sum()), sp.integrate(x**2, (x, 0, 3)), tmp, len(results), echo)
"""
    r = sandbox.session().run(code)
    assert r.ok and r.output == "10 9 ok 4 hi\n", r
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    r = sandbox.session().run(
        "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nimport os\n"
        "plt.plot([1, 2], [3, 4])\nplt.savefig('figure.png')\nprint(os.path.getsize('figure.png') > 0)"
    )
    assert r.ok and r.output.endswith("True\n"), r


def test_every_test_the_threat_model_names_exists():
    """The threat-model table of docs/sandbox.md names, per resource and level, the test that attacks it: each
    named test must exist (a renamed or dropped test would leave a row that nothing checks)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    text = (root / "docs" / "sandbox.md").read_text()
    section = text.split("## Threat model", 1)[1].split("\n## ", 1)[0]
    named = 0
    for row in section.splitlines():
        current = None
        for file, test in re.findall(r"`((?:\w+/)*test_\w+\.py)?::(test_\w+)`", row):
            current = file or current
            assert current, row
            source = (root / "tests" / current).read_text()
            assert f"def {test}(" in source, f"{current}::{test}"
            named += 1
    assert named >= 30, named


@pytest.mark.skipif(os.geteuid() != 0, reason="switching the file-system uid needs root (CAP_SETUID)")
def test_whatever_raises_during_a_watch_leaves_the_trainer_its_own_credentials():
    """Root in a default container: the trainer reads a session's /proc files with its fsuid set to the session's uid
    and its capabilities raised. A signal handler that raised in that window (a Ctrl-C's KeyboardInterrupt, at any
    bytecode of the main thread) could leave the thread with the session's ids, so that the checkpoint written next
    belonged to the session's uid or failed. Whatever raises in the window, the thread's own ids and capabilities
    must be back when it propagates."""
    import signal as signals

    from retool_trl.sandbox.isolation.fsuid import acting_as

    def fs_ids():
        with open("/proc/thread-self/status") as f:
            fields = {line.split(":")[0]: line.split()[1:] for line in f}
        return int(fields["Uid"][3]), int(fields["Gid"][3]), fields["CapEff"][0]

    def interrupt(*_):
        raise KeyboardInterrupt

    before = fs_ids()
    previous = signals.signal(signals.SIGUSR1, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt), acting_as(54321):
            assert fs_ids()[:2] == (54321, 54321)
            os.kill(os.getpid(), signals.SIGUSR1)
            time.sleep(1)  # the handler raises at the next bytecode
        assert fs_ids() == before
        with pytest.raises(ValueError), acting_as(54321):
            raise ValueError("the body failed")
        assert fs_ids() == before
    finally:
        signals.signal(signals.SIGUSR1, previous)
