"""The isolation contract of DESIGN.md §5, one test per red-team finding of issue 14.

Each test runs hostile code; the module moves this test process into a memory- and pids-bounded cgroup where the
machine lets it (cgroup v1 or v2, as root), so that a regression cannot take the machine down.
"""

import json
import os
import signal
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from retool_trl.sandbox import LocalSandbox
from retool_trl.sandbox.host.local import _WORKER, UnsafeSandboxError
from retool_trl.sandbox.isolation import fsuid

pytestmark = pytest.mark.timeout(120)


def _own_cgroup_dirs():
    """Writable cgroup directories (v1 memory/pids or v2) of this process, as {controller: path}."""
    found = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in ("memory", "pids"):
            if controller in controllers.split(","):
                base = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
                if os.access(base, os.W_OK):
                    found[controller] = base
    return found


@pytest.fixture(scope="module", autouse=True)
def bounded_test_process():
    """Runs this module inside cgroups of its own: 6 GB of memory and 2048 tasks at most."""
    made = []
    if os.geteuid() == 0:
        for controller, parent in _own_cgroup_dirs().items():
            path = parent / f"retool-test-jail-{os.getpid()}"
            try:
                path.mkdir()
                limit = {"memory": ("memory.limit_in_bytes", str(6 << 30)), "pids": ("pids.max", "2048")}[controller]
                (path / limit[0]).write_text(limit[1])
                (path / "cgroup.procs").write_text(str(os.getpid()))
                made.append((parent, path))
            except OSError:
                continue
    yield
    for parent, path in made:
        (parent / "cgroup.procs").write_text(str(os.getpid()))
        for _ in range(100):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.05)


@pytest.fixture(scope="module")
def sandbox():
    with LocalSandbox(
        num_workers=2,
        timeout_s=2.0,
        memory_mb=512,
        max_processes=32,
        max_output_chars=1000,
        scratch_mb=16,
        max_files=2000,
        preload=(),
    ) as sb:
        yield sb


@pytest.fixture(scope="module")
def report(sandbox):
    return sandbox.isolation_report()


def _require(report, key):
    if not report.get(key, True):  # a sandbox that does not report the key promises it: the test then decides
        pytest.skip(f"needs {key} (isolation level here: {report.get('isolation')})")


def _last_line(result):
    return result.output.rstrip("\n").splitlines()[-1]


# --------------------------------------------------------------------------------- finding 1: forged replies

FORGE = """
import json, os, struct, sys
ids = [f.f_locals[k].get("id") for f in [sys._getframe(i) for i in range(1, 6) if sys._getframe(i)]
       for k in ("request", "reply") if isinstance(f.f_locals.get(k), dict)]
for body in [{"id": i, "ok": True, "head": "x" * 20000, "tail": "x" * 20000, "total": 20000, "error": None,
              "fatal": None} for i in ids + [0, 1]] + [{"ok": True, "error": None, "fatal": None, "skipped": 0}]:
    data = json.dumps(body).encode()
    for fd in range(256):
        try:
            os.write(fd, struct.pack("!I", len(data)) + data)
        except OSError:
            pass
"""


@pytest.mark.parametrize("then", ["import time\ntime.sleep(30)", "while True:\n    pass"])
def test_a_forged_reply_neither_ends_the_call_nor_passes_the_limits(sandbox, then):
    s = sandbox.session()
    r = s.run(FORGE + then)
    assert not r.ok and r.timed_out, r.output[-300:]
    assert len(r.output) <= sandbox.max_output_chars
    s.close()


def test_a_forged_reply_does_not_outlive_the_session(sandbox):
    s = sandbox.session()
    assert s.run("print('hi')").ok
    pid = s._proc.host_pid
    r = s.run(FORGE + "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()")
    s.close()
    deadline = time.monotonic() + 10
    while _running(pid):
        assert time.monotonic() < deadline, f"the session process outlived close(): {r}"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie); it may vanish between any two checks."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------------- finding 2 and 8: deaths and reaping


def test_concurrent_deaths_beside_sleepers_settle_every_cell(sandbox):
    for _ in range(3):
        crashers = [sandbox.session() for _ in range(4)]
        sleepers = [sandbox.session() for _ in range(8)]
        results = sandbox.run_many(
            [(s, "import os\nos._exit(1)") for s in crashers]
            + [(s, "import time\ntime.sleep(1)\nprint('slept')") for s in sleepers]
        )
        for r in results[:4]:
            assert not r.ok and not r.infra_error and not r.timed_out, r
            assert "exited with code 1" in _last_line(r)
        for r in results[4:]:
            assert r.ok and r.output == "slept\n", r
        for s in crashers + sleepers:
            s.close()


def test_a_segfault_names_its_signal(sandbox):
    r = sandbox.session().run("import ctypes\nctypes.string_at(0)")
    assert not r.ok and not r.infra_error and "SIGSEGV" in _last_line(r)


def _long_call_in_a_thread(session, settle_s: float):
    """Starts a 30 s cell of a live session in another thread; returns that thread and the list its result goes to."""
    assert session.run("x = 1").ok
    box = []
    runner = threading.Thread(target=lambda: box.append(session.run("import time\ntime.sleep(30)")))
    runner.start()
    time.sleep(settle_s)
    return runner, box


def test_a_kill_from_outside_is_an_infrastructure_error(sandbox, report):
    # Without a pid namespace a cell can SIGKILL its own interpreter: the sandbox then counts a SIGKILL as the
    # cell's doing (a policy must not make its own failures unscored), so this holds only with per-session jails.
    _require(report, "jail_per_session")
    s = sandbox.session()
    runner, box = _long_call_in_a_thread(s, 0.5)
    os.kill(s._proc.host_pid, signal.SIGKILL)  # what the OOM killer of the machine does
    runner.join(20)
    (r,) = box
    assert not r.ok and r.infra_error and not r.timed_out, r


def test_a_kill_between_calls_is_an_infrastructure_error(sandbox, report):
    # Without a pid namespace a cell can SIGKILL its own interpreter: the sandbox then counts a SIGKILL as the
    # cell's doing (a policy must not make its own failures unscored), so this holds only with per-session jails.
    _require(report, "jail_per_session")
    s = sandbox.session()
    assert s.run("x = 1").ok
    os.kill(s._proc.host_pid, signal.SIGKILL)  # while it waits (stopped) for its next call
    r = s.run("print(x)")
    assert not r.ok and r.infra_error and not r.timed_out, r
    assert "killed from outside" in _last_line(r)


def test_a_late_forged_status_does_not_settle_the_next_call(sandbox):
    """A status frame already waiting when a call starts (a writer the cell left, racing its kill) settles nothing."""
    forged = json.dumps({"ok": True, "error": None, "fatal": None, "skipped": 0}).encode()
    for _ in range(5):
        s = sandbox.session()
        assert s.run("print('first')").output == "first\n"
        with fsuid.acting_as(s._proc.watch_uid):  # a session of another uid, watched without CAP_SYS_PTRACE
            status_pipe = open(f"/proc/{s._proc.host_pid}/fd/4", "wb")  # the session's own status pipe
        with status_pipe:
            status_pipe.write(struct.pack("!I", len(forged)) + forged)
        start = time.monotonic()
        second = s.run("import time\ntime.sleep(0.3)\nprint('second')")
        assert second.ok and second.output == "second\n", second
        assert time.monotonic() - start >= 0.3
        s.close()


def test_closing_a_session_under_a_running_call_ends_that_call():
    with LocalSandbox(num_workers=2, timeout_s=20.0, preload=()) as sb:
        s = sb.session()
        runner, box = _long_call_in_a_thread(s, 0.3)
        pid = s._proc.host_pid
        start = time.monotonic()
        s.close()  # from another thread than the one waiting for the call
        runner.join(10)
        assert box and not box[0].ok and "closed" in box[0].output, box
        assert time.monotonic() - start < 5
        deadline = time.monotonic() + 10
        while _running(pid):
            assert time.monotonic() < deadline, "the closed session's process survived"
            time.sleep(0.05)


def test_a_jail_that_fails_to_set_up_is_an_infrastructure_error():
    # An open-file limit above the kernel's maximum: setrlimit fails in the jail before any cell can run.
    with LocalSandbox(num_workers=1, timeout_s=5.0, max_open_files=1 << 30, preload=()) as sb:
        r = sb.session().run("print('never runs')")
    assert not r.ok and r.infra_error and not r.timed_out, r
    assert "could not set up the session's jail" in _last_line(r), r


def _sandbox_processes():
    found = {p.pid for p in psutil.process_iter(["cmdline"]) if _WORKER in " ".join(p.info["cmdline"] or ())}
    return {pid for pid in found if _running(pid)}


def test_nothing_of_the_sandbox_survives_close():
    before = _sandbox_processes()  # the module's sandbox
    with LocalSandbox(num_workers=2, timeout_s=1.0, preload=()) as sb:
        sessions = [sb.session() for _ in range(6)]
        sb.run_many(
            [(s, "import os\nos._exit(1)") for s in sessions[:3]]
            + [(s, "import subprocess\nsubprocess.Popen(['sleep', '100'])") for s in sessions[3:]]
        )
    deadline = time.monotonic() + 10
    while (left := _sandbox_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left


# ------------------------------------------------------------------------------ finding 3: one jail per session


def test_tmp_is_private_bounded_and_gone_after_close(sandbox, report):
    _require(report, "jail_per_session")
    a, b = sandbox.session(), sandbox.session()
    fill = a.run(
        "open('/tmp/secret', 'w').write('a')\nblock = b'x' * (1 << 20)\nn = 0\ntry:\n"
        "    with open('/tmp/fill', 'wb') as f:\n        while n < 64:\n            f.write(block)\n"
        "            f.flush()\n            n += 1\nexcept OSError as e:\n    print('full', e.errno)"
    )
    assert "full 28" in fill.output, fill  # ENOSPC at scratch_mb=16 in A's own /tmp
    assert b.run("import os\nprint(os.path.exists('/tmp/secret'))").output == "False\n"
    assert b.run("open('/tmp/mine', 'w').write('b' * 100000)").ok  # A's full /tmp is not B's
    a.close()
    c = sandbox.session()
    # Nothing of A's: only the scratch root, and what the interpreter needs from under /tmp (a venv there, bound in
    # read-only: a checkout under /tmp, as a CI run may use).
    from retool_trl.sandbox.host.zygote import _WORKER
    from retool_trl.sandbox.isolation import needed_under_temp

    interpreter = {p.split("/")[2] for p in needed_under_temp(_WORKER) if p.startswith("/tmp/")}
    listed = c.run("import os\nprint(sorted(os.listdir('/tmp')))").output
    assert listed == f"{sorted({'retool-sandbox', *interpreter})}\n"


def test_network_and_abstract_sockets_are_private(sandbox, report):
    _require(report, "jail_per_session")
    a, b = sandbox.session(), sandbox.session()
    listen = (
        "import socket\nsrv = socket.socket()\nsrv.bind(('127.0.0.1', 0))\nsrv.listen()\n"
        "u = socket.socket(socket.AF_UNIX)\nu.bind('\\0retool-jail-test')\nu.listen()\n"
        "print(srv.getsockname()[1])"
    )
    port = int(a.run(listen).output)
    assert a.run(f"socket.create_connection(('127.0.0.1', {port}), 1).close()").ok  # it does listen
    probe = b.run(
        f"import socket\nfor addr in [('127.0.0.1', {port})]:\n    try:\n"
        "        socket.create_connection(addr, 1)\n        print('tcp reached')\n"
        "    except OSError:\n        print('tcp refused')\nu = socket.socket(socket.AF_UNIX)\ntry:\n"
        "    u.connect('\\0retool-jail-test')\n    print('unix reached')\nexcept OSError:\n"
        "    print('unix refused')"
    )
    assert probe.output == "tcp refused\nunix refused\n", probe


SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(0x5EED, {size}, {flags})
print(shmid >= 0)
"""


def test_ipc_objects_are_private_and_die_with_the_session(sandbox, report):
    _require(report, "jail_per_session")
    a, b = sandbox.session(), sandbox.session()
    assert a.run(SHM.format(size=1 << 20, flags=0o1000 | 0o666)).output == "True\n"  # IPC_CREAT
    assert a.run(SHM.format(size=0, flags=0)).output == "True\n"
    assert b.run(SHM.format(size=0, flags=0)).output == "False\n"
    a.close()
    assert sandbox.session().run(SHM.format(size=0, flags=0)).output == "False\n"


def test_own_process_tree(sandbox, report):
    _require(report, "jail_per_session")
    s = sandbox.session()
    r = s.run("import os\nprint(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    assert r.output == "1 [1]\n", r


# ------------------------------------------------------------------------- finding 4: one memory bound in all


def test_memory_is_bounded_for_the_whole_session(report):
    _require(report, "memory_cgroup")
    code = (
        "import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
        "        block = bytearray(150 << 20)\n        for i in range(0, len(block), 4096):\n"
        "            block[i] = 1\n        time.sleep(1)\n        os._exit(0)\n    kids.append(pid)\n"
        "print(sum(os.waitpid(k, 0)[1] == 0 for k in kids), 'held')"
    )
    with LocalSandbox(num_workers=1, timeout_s=20.0, memory_mb=256, preload=()) as sb:
        r = sb.session().run(code)
    assert not (r.ok and r.output == "4 held\n"), r  # 600 MB at once cannot fit in one 256 MB session
    assert not r.infra_error


# ---------------------------------------------------------------------- finding 5: no privilege inside


@pytest.mark.parametrize(
    "code",
    [
        "import ctypes\nprint(ctypes.CDLL(None, use_errno=True).unshare(0x10000000), ctypes.get_errno())",
        "import subprocess\nprint(subprocess.run(['unshare', '-r', '-m', 'true']).returncode != 0)",
    ],
)
def test_no_user_namespaces_inside(sandbox, report, code):
    _require(report, "seccomp")
    r = sandbox.session().run(code)
    assert _last_line(r) in ("-1 1", "True"), r


# ------------------------------------------------------------------------- finding 6: a million files


def test_many_files_are_bounded_and_do_not_stall_others(sandbox, report):
    _require(report, "jail_per_session")
    s, other = sandbox.session(), sandbox.session()
    r = s.run(
        "import os\nn = 0\ntry:\n    while n < 20000:\n        open(f'/tmp/f{n}', 'w').close()\n"
        "        n += 1\nexcept OSError as e:\n    print(n, e.errno)"
    )
    count, err = map(int, r.output.split())
    assert count < 2000 and err == 28, r  # max_files inodes in its /tmp
    s.close()
    assert other.run("print('fine')").output == "fine\n"


# ------------------------------------------------------------------------- finding 7: no unsafe defaults


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is for root")
def test_root_without_isolation_is_refused_unless_asked_for():
    sb = LocalSandbox(isolation="none", preload=())
    with pytest.raises(UnsafeSandboxError, match="allow_root_without_isolation"):
        sb.session().run("print(1)")
    sb.close()
    with LocalSandbox(isolation="none", preload=(), allow_root_without_isolation=True) as sb:
        assert sb.session().run("print(1)").output == "1\n"
        assert "read-only host file system (bubblewrap)" in sb.isolation_report()["missing"]


# ----------------------------------------------------------------------- output is always valid text


def test_output_is_valid_text_whatever_is_printed(sandbox):
    r = sandbox.session().run(
        "import sys, os\nprint(chr(0xD800))\nsys.stdout.buffer.write(b'\\xff\\n')\nos.write(1, b'\\xfe\\n')"
    )
    r.output.encode("utf-8")  # strict: no lone surrogates
    assert r.ok and r.output.count("\ufffd") + r.output.count("?") >= 3, r


# ------------------------------------------------------------- the second red-team pass (the trainer's direct line)

FORGED_OK = (
    "import json, os, struct\n"
    "data = json.dumps({'ok': True, 'error': None, 'fatal': None, 'skipped': 0}).encode()\n"
    "os.write(4, struct.pack('!I', len(data)) + data)\n"
)


def test_a_status_nested_past_the_parser_fails_only_its_own_cell(sandbox):
    attacker, victim = sandbox.session(), sandbox.session()
    assert victim.run("v = 42").ok
    evil = "import os, struct\nos.write(4, struct.pack('!I', 200000) + b'[' * 200000)\nimport time\ntime.sleep(0.5)"
    hit, other = sandbox.run_many([(attacker, evil), (victim, "import time\ntime.sleep(1)\nprint(v)")])
    assert not hit.ok and not hit.infra_error and "invalid status" in hit.output, hit
    assert other.ok and other.output == "42\n", other


@pytest.mark.parametrize(
    "code", ["import os\nos.close(4)\nimport time\ntime.sleep(5)", "import os\nos.dup2(os.open('/dev/null', 1), 4)"]
)
def test_closing_the_status_channel_is_the_cells_own_error(sandbox, code):
    r = sandbox.session().run(code)
    assert not r.ok and not r.infra_error and "status channel" in _last_line(r), r


def test_replacing_the_request_channel_is_the_cells_own_error(sandbox):
    s = sandbox.session()
    assert s.run("import os\nr, w = os.pipe()\nos.dup2(r, 3)").ok
    r = s.run("print(1)")
    assert not r.ok and not r.infra_error and "request channel" in _last_line(r), r


@pytest.mark.parametrize(
    "evil",
    [
        FORGED_OK + "os.read(3, 1 << 16)\n",  # looks parked: blocked reading the request pipe, after a forged status
        # A handler run by the trainer's SIGCONT at the next call, inside the interpreter's own wait for a request.
        "import signal\ndef h(*_):\n"
        + "".join("    " + line + "\n" for line in (FORGED_OK + "os.read(3, 1 << 16)").splitlines())
        + "signal.signal(signal.SIGCONT, h)\n",
        "import signal\ndef h(*_):\n"
        + "".join("    " + line + "\n" for line in (FORGED_OK + "os.read(3, 1 << 16)").splitlines())
        + "signal.signal(signal.SIGALRM, h)\nsignal.setitimer(signal.ITIMER_REAL, 0.05)\n",
    ],
)
def test_reading_fd_3_or_a_signal_handler_does_not_take_over_later_calls(sandbox, evil):
    s = sandbox.session()
    results = [s.run(evil), s.run("1/0"), s.run("print(6 * 7)")]
    assert not results[1].ok, results  # the ZeroDivisionError (or a broken session), never a forged success
    assert "ZeroDivisionError" in results[1].output or "Error" in results[1].output, results
    assert results[2].output in ("42\n",) or not results[2].ok, results
    assert not any(r.infra_error for r in results), results


def test_the_sandbox_outlives_the_thread_that_started_it():
    with LocalSandbox(num_workers=1, timeout_s=5.0, preload=()) as sb:
        s = sb.session()
        with ThreadPoolExecutor(1) as pool:  # what the async rollout does: a pool per rollout
            assert pool.submit(s.run, "v = 41").result().ok
        time.sleep(0.5)  # that thread has exited
        zygote_pid = sb._zygote.proc.pid
        assert s.run("print(v + 1)").output == "42\n"
        assert sb._zygote.proc.poll() is None and sb._zygote.proc.pid == zygote_pid


def test_a_kill_from_outside_after_cpu_heavy_children_is_still_infrastructure():
    # CPU burnt in children the cells wait for (more in all than the per-call limit): the zygote's wait4 counts it,
    # so it must be counted before the next call too, or an outside kill looks like the CPU limit.
    burn = "import os\nif (pid := os.fork()) == 0:\n    x = sum(range(3 * 10**7))\n    os._exit(0)\nos.waitpid(pid, 0)"
    with LocalSandbox(num_workers=1, timeout_s=10.0, cpu_time_s=1.0, preload=()) as sb:
        _require(sb.isolation_report(), "jail_per_session")  # as above: a SIGKILL is the cell's doing without one
        s = sb.session()
        assert all(s.run(burn).ok for _ in range(3))
        runner, box = _long_call_in_a_thread(s, 0.3)
        os.kill(s._proc.host_pid, signal.SIGKILL)
        runner.join(20)
    assert box and box[0].infra_error and not box[0].timed_out, box


# ---------------------------------------------------------------------------------------- the third pass

GRANDCHILD_FROM_A_THREAD = r"""
import os, sys, threading, time, struct, json
sp = next(m for m in list(sys.modules.values()) if hasattr(m, "_Cell") and hasattr(m, "session_main"))
sp._kill_descendants = lambda uid: None  # the session's own sweep runs in the cell's interpreter: not trusted
if os.fork() == 0:
    def forker():
        if os.fork() == 0:  # a child of the child's *second* thread: not in its main thread's children list
            while os.getppid() != 1:
                time.sleep(0.005)
            header = os.read(3, 4)  # the next request, taken while the session process is stopped
            os.read(3, struct.unpack("!I", header)[0])
            os.ftruncate(1, 0)
            os.lseek(1, 0, 0)
            os.write(1, b"forged\n")
            body = json.dumps({"ok": True, "error": None, "fatal": None, "skipped": 0}).encode()
            os.write(4, struct.pack("!I", len(body)) + body)
            os._exit(0)
        while True:
            time.sleep(1)
    threading.Thread(target=forker).start()
    while True:
        time.sleep(1)
time.sleep(0.3)
print("set up")
"""


def test_nothing_a_cell_forked_from_any_thread_survives_its_call(sandbox):
    s = sandbox.session()
    assert s.run(GRANDCHILD_FROM_A_THREAD).output == "set up\n"
    time.sleep(0.5)
    r = s.run("1/0")
    assert not r.ok and "ZeroDivisionError" in r.output, r
    assert s.run("print('real')").output == "real\n"


def test_a_session_keeps_its_state_past_any_total_cpu():
    """Each call gets its own CPU budget however much the session used before (the hard limit cannot rise again
    once the session runs as its own uid)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\nn += 1\nprint(n)"
    with LocalSandbox(num_workers=1, timeout_s=5.0, cpu_time_s=1.0, preload=()) as sb:
        s = sb.session()
        assert s.run("n = 0").ok
        outputs = [s.run(burn).output for _ in range(4)]
    assert outputs == ["1\n", "2\n", "3\n", "4\n"], outputs


def test_a_signal_handler_in_a_cell_works_like_in_python(sandbox):
    code = (
        "import signal, time\ndef h(*a):\n    raise TimeoutError('alarm')\nsignal.signal(signal.SIGALRM, h)\n"
        "signal.alarm(1)\ntry:\n    while True:\n        pass\n"
        "except TimeoutError as e:\n    print('caught', e)\n"
    )
    s = sandbox.session()
    r = s.run(code)
    assert r.ok and r.output == "caught alarm\n", r
    # The zygote's signal wakeup fd is not inherited (handlers would write signal numbers into a cell's own file).
    assert s.run("import signal\nsignal.set_wakeup_fd(-1)").output == "-1\n"


def test_a_jail_that_never_reaches_its_wait_is_infrastructure(monkeypatch):
    from retool_trl.sandbox.host import channel

    # As if the fresh jail never got to its wait for requests (stuck in set-up) within what the trainer waits.
    monkeypatch.setattr(channel, "SETUP_WAIT_S", 0.05)
    monkeypatch.setattr(channel.SessionProcess, "_waiting_point", lambda self: None)
    with LocalSandbox(num_workers=1, timeout_s=5.0, preload=()) as sb:
        r = sb.session().run("print('never runs')")
    assert not r.ok and r.infra_error and "could not set up" in _last_line(r), r
