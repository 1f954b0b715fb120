"""The watchdog's sample at scale: where no cgroup bounds a session (root in a default container, a normal user), the
zygote samples every live session ten times a second. At 1,024 live sessions most are parked between calls, and a
full sample of each (its process tree, each process's memory, its open files, its scratch tree) took half a core. A
session none of whose processes ran since a full sample found it within bounds is skipped; these tests hold that a
skipped session is still caught the moment it runs again, on real processes of this machine.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from retool_trl.sandbox.jail import watchdog

BOUNDS = {"memory": 200 << 20, "tasks": 64, "scratch": 64 << 20, "files": 1000, "by_fsuid": False}

# Waits for SIGUSR1 (as a parked session waits, until its own timer wakes it); then forks a child that takes 300 MB
# while the parent goes back to waiting: the memory is in a process the last full sample never saw.
WAKES_AND_FORKS = """
import os, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: None)
print("parked", flush=True)
signal.pause()
if os.fork() == 0:
    held = b"x" * (300 << 20)
    print("held", flush=True)
    time.sleep(60)
    os._exit(0)
signal.pause()
"""


def _private_mb(pids):
    return sum(watchdog.private_resident_bytes(p) for p in pids) >> 20


@pytest.fixture
def fresh_state():
    watchdog._quiet.clear()
    watchdog._next_walk.clear()
    yield
    watchdog._quiet.clear()
    watchdog._next_walk.clear()
    watchdog.enforce([], BOUNDS)  # closes what it kept open


def _start(code):
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "parked"
    time.sleep(0.2)  # into its wait
    return proc


def test_a_parked_session_is_skipped_until_it_runs_and_then_caught(fresh_state, monkeypatch, tmp_path):
    proc = _start(WAKES_AND_FORKS)
    try:
        sessions = [(proc.pid, str(tmp_path), 0)]
        assert watchdog.enforce(sessions, BOUNDS) == {}
        full = []
        real = watchdog.private_resident_bytes
        monkeypatch.setattr(watchdog, "private_resident_bytes", lambda pid: full.append(pid) or real(pid))
        for _ in range(5):
            assert watchdog.enforce(sessions, BOUNDS) == {}
        assert full == [], "a session that did not run was sampled in full again"
        proc.send_signal(signal.SIGUSR1)  # its own timer, say: it runs, forks, and the child takes 300 MB
        assert proc.stdout.readline().strip() == "held"
        child = [p for p in watchdog.process_tree(proc.pid)[0] if p != proc.pid]
        assert child and _private_mb(child) >= 290
        assert watchdog.enforce(sessions, BOUNDS) == {proc.pid: "memory"}
        assert full, "the session ran, and was not sampled in full"
        proc.wait(timeout=10)
    finally:
        proc.kill()
        proc.wait()


def test_a_session_with_threads_is_sampled_in_full_every_time(fresh_state, monkeypatch):
    """A process's run time in /proc/PID/schedstat is its main thread's: another thread's work would not show in it,
    so a session with a second thread is never skipped."""
    proc = _start(
        "import threading, signal, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('parked', flush=True)\nsignal.pause()\n"
    )
    try:
        full = []
        real = watchdog.private_resident_bytes
        monkeypatch.setattr(watchdog, "private_resident_bytes", lambda pid: full.append(pid) or real(pid))
        for _ in range(3):
            assert watchdog.enforce([(proc.pid, None, 0)], BOUNDS) == {}
        assert full == [proc.pid] * 3
    finally:
        proc.kill()
        proc.wait()


def test_a_skipped_session_whose_scratch_grew_is_walked_again(fresh_state, tmp_path):
    """Files take a process that runs: a parked session's tree is walked again once one of its processes has run."""
    proc = _start(
        "import signal, sys\nsignal.signal(signal.SIGUSR1, lambda *_: None)\nprint('parked', flush=True)\n"
        "signal.pause()\n"
        f"open({str(tmp_path / 'big')!r}, 'wb').write(b'x' * (80 << 20))\nprint('held', flush=True)\nsignal.pause()\n"
    )
    try:
        sessions = [(proc.pid, str(tmp_path), 0)]
        assert watchdog.enforce(sessions, BOUNDS) == {}
        assert proc.pid in watchdog._quiet
        proc.send_signal(signal.SIGUSR1)
        assert proc.stdout.readline().strip() == "held"
        os.sync()
        assert watchdog.enforce(sessions, BOUNDS) == {proc.pid: "scratch"}
    finally:
        proc.kill()
        proc.wait()


def test_a_skipped_session_is_sampled_in_full_once_a_second_all_the_same(fresh_state, monkeypatch, tmp_path):
    """What can grow while a session's processes do not run: on a kernel whose Landlock does not scope abstract UNIX
    sockets, another session writes into a parked session's file through a descriptor passed to it (here this test's
    process writes, the parked one never runs). Skipped at once, it is caught at the resample a second later."""
    assert watchdog.QUIET_RESAMPLE_S <= 1.0
    resample_s = watchdog.QUIET_RESAMPLE_S
    proc = _start("import signal\nprint('parked', flush=True)\nsignal.pause()\n")
    try:
        sessions = [(proc.pid, str(tmp_path), 0)]
        assert watchdog.enforce(sessions, BOUNDS) == {}
        # Writing 80 MB can itself take past the interval on a loaded machine: the skip is held open while it lasts.
        monkeypatch.setattr(watchdog, "QUIET_RESAMPLE_S", 3600.0)
        (tmp_path / "written_by_another").write_bytes(b"x" * (80 << 20))
        os.sync()
        assert watchdog.enforce(sessions, BOUNDS) == {}  # within the resample interval: not looked at
        monkeypatch.setattr(watchdog, "QUIET_RESAMPLE_S", resample_s)
        time.sleep(resample_s)
        assert watchdog.enforce(sessions, BOUNDS) == {proc.pid: "scratch"}
    finally:
        proc.kill()
        proc.wait()


def test_a_long_proc_file_is_read_whole():
    """A session that forked many processes (up to its `max_processes`), or the zygote with hundreds of sessions: a
    /proc file of many records (a children list, the maps) comes back one kernel page per read whatever the buffer,
    and every record is still read (a child missed is memory never summed, a stray never killed)."""
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(40)]
    try:
        whole = open(f"/proc/self/task/{os.getpid()}/children", "rb").read().split()
        children = watchdog.read_proc(f"/proc/self/task/{os.getpid()}/children", size=16).split()
        assert children == whole  # 40 pids or more, of 2+ digits each: many 16-byte reads
        assert {kid.pid for kid in kids} <= {int(pid) for pid in children}
    finally:
        for kid in kids:
            kid.kill()
            kid.wait()
    for _ in range(5):  # the maps may change between the two reads (an allocation): equal on one of the tries
        expected = open("/proc/self/maps", "rb").read()
        assert len(expected) > 8192  # more than one page, and more than the default buffer
        if watchdog.read_proc("/proc/self/maps") == expected:
            break
    else:
        pytest.fail("read_proc never read /proc/self/maps whole")
    assert len(watchdog.read_proc("/proc/self/status", size=7)) == len(open("/proc/self/status", "rb").read())


def test_a_parked_session_s_run_time_is_read_through_one_descriptor_closed_when_it_ends(fresh_state, monkeypatch):
    """The zygote runs for the trainer's whole life while sessions come and go by the thousand (a GRPO run opens
    one per completion): the descriptor it keeps to re-read a parked session's run time is reused between samples,
    and closed once the session has ended, or the zygote would run out of descriptors."""
    proc = _start("import signal\nprint('parked', flush=True)\nsignal.pause()\n")
    opened = []
    real_open = os.open
    monkeypatch.setattr(watchdog.os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    try:
        sessions = [(proc.pid, None, 0)]
        for _ in range(5):
            assert watchdog.enforce(sessions, BOUNDS) == {}
        assert opened.count(f"/proc/{proc.pid}/schedstat") == 1
        fd = watchdog._schedstat_fds[proc.pid]
        assert os.readlink(f"/proc/self/fd/{fd}") == f"/proc/{proc.pid}/schedstat"
    finally:
        proc.kill()
        proc.wait()
    assert watchdog.enforce([], BOUNDS) == {}
    assert watchdog._schedstat_fds == {}
    held = {
        os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{n}")
    }
    assert f"/proc/{proc.pid}/schedstat" not in held


def test_a_sealed_parked_session_is_resampled_less_often(fresh_state, monkeypatch, tmp_path):
    """Landlock ABI 6+ with a uid per session (root in a default container, kernel 6.12+), or ABI 9+: no session can
    hand another a descriptor, and a parked session is one process of one thread held to `memory_mb` by its
    address-space limit, so nothing it holds grows while it does not run; it is resampled every `SEALED_RESAMPLE_S`,
    not every second. Where sessions may pass descriptors (older kernels, a shared uid), the 1 s resample stays."""
    config = {"memory_mb": 256, "max_processes": 64, "scratch_mb": 64, "max_files": 1000, "session_watchdog": True}
    assert not watchdog.session_bounds({**config, "landlock": {"abi": 5}, "drop_uid": True})["sealed"]
    assert not watchdog.session_bounds({**config, "landlock": {"abi": 7}, "drop_uid": False})["sealed"]
    assert not watchdog.session_bounds({**config, "landlock": None, "drop_uid": True})["sealed"]
    assert watchdog.session_bounds({**config, "landlock": {"abi": 9}, "drop_uid": False})["sealed"]
    sealed = watchdog.session_bounds({**config, "landlock": {"abi": 6}, "drop_uid": True})
    assert sealed["sealed"] and sealed["memory"] == 256 << 20
    proc = _start("import signal\nprint('parked', flush=True)\nsignal.pause()\n")
    try:
        sessions = [(proc.pid, str(tmp_path), 0)]
        assert watchdog.enforce(sessions, sealed) == {}
        # Writing 80 MB can itself take past either interval on a loaded machine: both are held open while it lasts.
        monkeypatch.setattr(watchdog, "SEALED_RESAMPLE_S", 3600.0)
        monkeypatch.setattr(watchdog, "QUIET_RESAMPLE_S", 3600.0)
        (tmp_path / "written_by_another").write_bytes(b"x" * (80 << 20))
        os.sync()
        monkeypatch.setattr(watchdog, "QUIET_RESAMPLE_S", 0.0)  # what an unsealed session would be due for by now
        assert watchdog.enforce(sessions, sealed) == {}
        monkeypatch.setattr(watchdog, "SEALED_RESAMPLE_S", 0.0)  # ...and a sealed one once its own interval passed
        assert watchdog.enforce(sessions, sealed) == {proc.pid: "scratch"}
    finally:
        proc.kill()
        proc.wait()
