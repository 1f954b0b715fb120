"""Hostile cells: each must end in bounded time with a clear error while the host and the next session stay healthy.

The fork bomb only runs after the per-session process cap was seen to bind (and it is a bounded loop, not
`while True`): without a cap it would take the machine down.
"""

import os
import socket
import time
import uuid
from pathlib import Path

import psutil
import pytest

from retool_trl.sandbox import LocalSandbox

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 1.5
MAX_PROCESSES = 16


def _descendants():
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def baseline_children():
    return _descendants()


@pytest.fixture(scope="module")
def sandbox(baseline_children):
    os.environ["HF_TOKEN"] = "secret123"  # set before the sandbox starts: it must still not see it
    try:
        with LocalSandbox(
            num_workers=2,
            timeout_s=TIMEOUT_S,
            memory_mb=512,
            max_processes=MAX_PROCESSES,
            max_file_size_mb=4,
            max_open_files=32,
            max_output_chars=2000,
        ) as sb:
            yield sb
    finally:
        os.environ.pop("HF_TOKEN", None)


@pytest.fixture(scope="module")
def report(sandbox):
    return sandbox.isolation_report()


def _require(report, key, why, landlock_abi=None):
    """Guarantees that need kernel support are checked where it exists and skipped, with the reason, elsewhere.
    `landlock_abi`: the Landlock ABI from which the Landlock level gives the same guarantee without `key`."""
    if landlock_abi is not None and report.get("landlock") and report.get("landlock_abi", 0) >= landlock_abi:
        return
    if not report[key]:
        pytest.skip(f"{why} needs {key} (isolation level here: {report['isolation']})")


def _last_line(result):
    return result.output.rstrip("\n").splitlines()[-1]


def _assert_healthy(sandbox):
    """The host survived and a fresh session works."""
    s = sandbox.session()
    r = s.run("print(sum(range(10)))")
    assert r.ok and r.output == "45\n", r
    s.close()


def _run_bounded(sandbox, code, limit_s=TIMEOUT_S + 3.0):
    s = sandbox.session()
    start = time.monotonic()
    r = s.run(code)
    assert time.monotonic() - start < limit_s, r
    return s, r


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import time\ntime.sleep(60)",
        "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
    ],
    ids=["infinite-loop", "sleep", "ignores-signals"],
)
def test_runaway_cells_time_out(sandbox, code):
    s, r = _run_bounded(sandbox, code)
    assert not r.ok and r.timed_out and not r.infra_error
    assert _last_line(r) == f"TimeoutError: execution exceeded {TIMEOUT_S:g} s"
    assert s.broken
    follow = s.run("print(1)")
    assert not follow.ok and "broken" in follow.output
    _assert_healthy(sandbox)


def test_cpu_time_limit():
    with LocalSandbox(num_workers=1, timeout_s=20.0, cpu_time_s=1.0, preload=()) as sb:
        s = sb.session()
        start = time.monotonic()
        r = s.run("while True:\n    pass")
        assert time.monotonic() - start < 6.0
        assert not r.ok and r.timed_out and "CPU time limit" in _last_line(r)
        assert s.broken


@pytest.mark.parametrize(
    "code",
    [
        "blocks = [bytearray(1 << 20)]\nwhile True:\n    blocks.append(bytearray(len(blocks[-1]) * 8))",
        "import numpy\nnumpy.ones((1 << 15, 1 << 15))",
    ],
    ids=["growing", "numpy"],
)
def test_memory_bomb(sandbox, code):
    pytest.importorskip("numpy")
    s, r = _run_bounded(sandbox, code)
    assert not r.ok and not r.timed_out and not r.infra_error
    assert _last_line(r).startswith("MemoryError: memory limit of 512 MB")
    assert s.broken
    _assert_healthy(sandbox)


def test_huge_output_is_bounded(sandbox):
    s, r = _run_bounded(sandbox, "print('x' * 50_000_000)\nfor i in range(200_000):\n    print(i)")
    assert r.ok and len(r.output) <= 2000 and "characters elided" in r.output
    assert r.output.endswith("199999\n")
    native = s.run("import os\nfor _ in range(64):\n    os.write(1, b'y' * (1 << 20))\nprint('after')")
    assert len(native.output) <= 4100  # python output + native output, each cut to max_output_chars
    s.close()
    _assert_healthy(sandbox)


def test_cannot_write_outside_scratch(sandbox, report):
    _require(report, "own_uid_per_session", "keeping cells out of the host file system", landlock_abi=1)
    marker = f"retool-escape-{uuid.uuid4().hex}"
    targets = ["/etc/" + marker, str(REPO / marker), "/" + marker, "/usr/" + marker]
    s = sandbox.session()
    for target in targets:
        r = s.run(f"open({target!r}, 'w').write('pwned')")
        # Refused (read-only or not ours), or not even there: a repository under /tmp is hidden by the jail's own /tmp.
        refusals = ("PermissionError", "Read-only file system", "No such file or directory")
        assert not r.ok and any(refusal in r.output for refusal in refusals), r
        assert not os.path.exists(target)
    if report["private_filesystem"]:  # the sandbox's /tmp is private: nothing written there shows up on the host
        s.run(f"open('/tmp/{marker}', 'w').write('x')")
        assert not os.path.exists(f"/tmp/{marker}")
    assert s.run("open('ok.txt', 'w').write('fine')").ok  # the scratch directory is writable
    s.close()


def test_file_size_and_open_file_limits(sandbox):
    s = sandbox.session()
    big = s.run("with open('big.bin', 'wb') as f:\n    f.write(b'0' * (8 * 1024 * 1024))")
    assert not big.ok and "File too large" in _last_line(big)
    many = s.run("handles = [open(f'f{i}', 'w') for i in range(100)]")
    assert not many.ok and "Too many open files" in _last_line(many)
    assert s.run("print('still here')").output == "still here\n"
    s.close()


def test_secrets_of_the_trainer_are_invisible(sandbox, report):
    assert os.environ.get("HF_TOKEN") == "secret123"
    s = sandbox.session()
    r = s.run("import os\nprint(dict(os.environ))")
    assert r.ok and "secret123" not in r.output and "HF_TOKEN" not in r.output
    if not report["own_uid_per_session"] and not report.get("landlock"):  # Landlock: no ptrace-mode access out
        s.close()
        pytest.skip("cells running as the trainer's uid can read its /proc/PID/environ")
    probe = s.run(
        "import os\nfound = []\nfor pid in os.listdir('/proc'):\n    try:\n"
        "        found.append(open(f'/proc/{pid}/environ', 'rb').read())\n    except Exception:\n        pass\n"
        "print(any(b'secret123' in e for e in found))"
    )
    assert probe.output == "False\n"
    s.close()


def test_no_network(sandbox, report):
    _require(report, "network_isolated", "blocking the network", landlock_abi=1)  # with seccomp: no IP sockets
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        s, r = _run_bounded(sandbox, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert not r.ok and ("ConnectionRefusedError" in r.output or "OSError" in r.output or "timed out" in r.output)
        with pytest.raises(socket.timeout):
            listener.accept()
        s.close()
    finally:
        listener.close()


def test_killing_the_parent_or_everything_hurts_nobody_else(sandbox, report):
    _require(report, "own_uid_per_session", "protecting the zygote and other sessions from signals", landlock_abi=6)
    keeper = sandbox.session()
    keeper.run("kept = 'state'")
    s, r = _run_bounded(sandbox, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    # In a jail the parent is outside the pid namespace (getppid() is 0, so the kill hits the cell's own group,
    # whose leader is pid 1 and ignores it); without one, the zygote runs under another uid.
    assert ("PermissionError" in _last_line(r)) if not report["jail_per_session"] else r.ok, r
    s, r = _run_bounded(sandbox, "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('survived')")
    assert psutil.pid_exists(os.getpid())
    assert keeper.run("print(kept)").output == "state\n"  # another session's process was out of reach
    keeper.close()
    _assert_healthy(sandbox)


@pytest.mark.parametrize(
    "code, expected",
    [
        ("import os\nos._exit(3)", "exited with code 3"),
        ("import ctypes\nctypes.string_at(0)", "segmentation fault"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "SIGKILL"),
    ],
    ids=["os-exit", "segfault", "self-kill"],
)
def test_crashing_cells(sandbox, report, code, expected):
    s, r = _run_bounded(sandbox, code)
    if expected == "SIGKILL" and report["jail_per_session"]:
        # The interpreter is pid 1 of its jail: the kernel drops signals it sends itself without a handler, so
        # nothing inside a session can SIGKILL it (and a SIGKILL seen by the zygote always came from outside).
        assert r.ok and not s.broken
        return
    assert not r.ok and not r.timed_out and not r.infra_error
    assert expected in _last_line(r)
    assert s.broken and "broken" in s.run("print(1)").output
    _assert_healthy(sandbox)


def test_stdin_does_not_hang(sandbox):
    s, r = _run_bounded(sandbox, "input()", limit_s=1.0)
    assert not r.ok and _last_line(r).startswith("EOFError")
    assert s.run("import sys\nprint(repr(sys.stdin.read()))").output == "''\n"
    s.close()


def test_threads_do_not_outlive_the_cell(sandbox):
    s = sandbox.session()
    r = s.run(
        "import threading, time\nticks = []\n"
        "def spin():\n    while True:\n        ticks.append(1)\n        time.sleep(0.005)\n"
        "threading.Thread(target=spin, daemon=True).start()\ntime.sleep(0.05)\nprint('started')"
    )
    assert r.output.startswith("started")
    r = s.run(
        "import time, threading\nn = len(ticks)\ntime.sleep(0.2)\nprint(len(ticks) - n, threading.active_count())"
    )
    assert r.output == "0 1\n", r
    s.close()


def test_children_do_not_outlive_the_cell(sandbox):
    s = sandbox.session()
    r = s.run(
        "import os, subprocess, time\nchild = subprocess.Popen(['sleep', '100'])\n"
        "r, w = os.pipe()\npid = os.fork()\nif pid == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.write(w, str(os.getpid()).encode())\n        time.sleep(100)\n    os._exit(0)\n"
        "os.waitpid(pid, 0)\ndaemon = int(os.read(r, 32))\nprint(child.pid, daemon)"
    )
    assert r.ok, r
    child, daemon = map(int, r.output.split())
    r = s.run(
        f"import os\nalive = []\nfor p in ({child}, {daemon}):\n    try:\n        os.kill(p, 0)\n"
        "        alive.append(p)\n    except ProcessLookupError:\n        pass\nprint(alive)"
    )
    assert r.output == "[]\n", r
    s.close()


def test_process_cap_then_bounded_fork_bomb(sandbox):
    s = sandbox.session()
    probe = s.run(
        "import subprocess\nprocs = []\ntry:\n    for _ in range(200):\n"
        "        procs.append(subprocess.Popen(['sleep', '30']))\nexcept OSError:\n    pass\nprint(len(procs))"
    )
    started = int(probe.output.strip()) if probe.ok else -1
    if not 0 <= started < MAX_PROCESSES:
        pytest.skip(f"the per-session process cap does not bind here ({started} processes started); no fork bomb")
    s.close()
    bomb = (
        "import os, time\nfor _ in range(3000):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        "time.sleep(30)"
    )
    s, r = _run_bounded(sandbox, bomb, limit_s=TIMEOUT_S + 5.0)
    assert not r.ok and s.broken
    _assert_healthy(sandbox)


def test_no_leftover_processes_after_close(sandbox, baseline_children):
    """Kept last: closes the module's sandbox too, then nothing of either may remain (no zombies either)."""
    with LocalSandbox(num_workers=2, timeout_s=1.0, max_processes=MAX_PROCESSES, preload=()) as sb:
        sessions = [sb.session() for _ in range(4)]
        sb.run_many(
            [
                (sessions[0], "import subprocess\np = subprocess.Popen(['sleep', '100'])"),
                (sessions[1], "import threading, time\nthreading.Thread(target=time.sleep, args=(100,)).start()"),
                (sessions[2], "while True:\n    pass"),
                (sessions[3], "x = 1"),
            ]
        )
        sessions[3].close()
    sandbox.close()
    deadline = time.monotonic() + 5
    while (_descendants() - baseline_children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (_descendants() - baseline_children)
