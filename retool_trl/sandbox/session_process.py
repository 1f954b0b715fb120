"""The session side of the local sandbox: one jailed interpreter process that runs a session's cells.

Imported by `worker.py` inside the sandbox (stdlib-only, never by the trainer), which also keeps its handle on each
jail (`Jail`) here. The zygote forks this process as pid 1
of a fresh pid namespace; `session_main` enters its own mount, network, IPC and UTS namespaces, its cgroups, uid,
rlimits and seccomp filter, then runs cells read from fd 3 and reports each cell's ok and traceback on fd 4. What a
cell prints reaches fd 1, a memfd that only the zygote reads; the zygote decides when a call is over.
"""

import _signal
import ast
import base64
import ctypes
import fcntl
import json
import linecache
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections import deque

HEADER = struct.Struct("!I")
# In a session process: 0 /dev/null, 1 and 2 the output memfd, 3 requests, 4 statuses, 5 "set up" (closed early).
REQUEST_FD, STATUS_FD, READY_FD = 3, 4, 5
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000,
    0x4000000,
    0x8000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x4000, 1 << 18
PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_BACKGROUND_NICE = 10
_THIS_FILE = os.path.abspath(__file__)
libc = ctypes.CDLL(None, use_errno=True)


def frame(obj):
    data = json.dumps(obj).encode()
    return HEADER.pack(len(data)) + data


def read_exact(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def prctl(option, value):
    libc.prctl(option, value, 0, 0, 0)


def mount(source, target, fstype, flags=0, data=None):
    def enc(text):
        return None if text is None else text.encode()

    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


# ------------------------------------------------------------------------------------------------- session process


class _Capture:
    """A stdout/stderr replacement that keeps only the first and last `limit` characters (and counts the rest)."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, limit):
        self.limit = limit
        self.head = []
        self.head_len = 0
        self.tail = deque()
        self.tail_len = 0
        self.total = 0
        self.buffer = self  # `sys.stdout.buffer.write(b"...")` works too

    def write(self, text):
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", "replace")
        elif not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        n = len(text)
        if not n:
            return 0
        self.total += n
        if self.head_len < self.limit:
            piece = text[: self.limit - self.head_len]
            self.head.append(piece)
            self.head_len += len(piece)
        self.tail.append(text)
        self.tail_len += n
        while self.tail_len - len(self.tail[0]) >= self.limit:
            self.tail_len -= len(self.tail.popleft())
        return n

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        pass

    def isatty(self):
        return False

    def fileno(self):
        return 1  # native writers (and subprocesses) land in the fd-level capture

    def writable(self):
        return True

    def readable(self):
        return False

    @property
    def closed(self):
        return False

    def texts(self):
        tail = "".join(self.tail)
        return "".join(self.head), tail[len(tail) - self.limit :] if len(tail) > self.limit else tail, self.total


def _format_exception(exc, last_line=None):
    """A short, notebook-like traceback: cell frames (and the last library frames), no frames of this worker."""
    te = traceback.TracebackException.from_exception(exc)
    frames = [] if isinstance(exc, SyntaxError) else [f for f in te.stack if os.path.abspath(f.filename) != _THIS_FILE]
    lines = ["Traceback (most recent call last):\n", *traceback.StackSummary.from_list(frames[-5:]).format()]
    lines = lines if frames else []
    only = list(te.format_exception_only())
    if last_line is None and isinstance(exc, SyntaxError):
        lines += only  # file/line/caret lines, then "SyntaxError: ..." last
    else:
        # One final line, whatever the message: the model (and the tests) read the last line as "what happened".
        lines.append((last_line or " ".join("".join(only).split())) + "\n")
    return "".join(lines)


def _kill_leftover_threads(budget_s=0.25):
    """Stops threads a cell left running (SystemExit at their next bytecode); returns how many survived."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    for t in others:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(SystemExit))
    deadline = time.monotonic() + budget_s
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    return sum(t.is_alive() for t in others)


def children(pid="self"):
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return kids


def _kill_descendants(own_uid):
    """Kills and reaps every process the cell started (as pid 1 of the jail, orphans come back to us)."""
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return  # no child at all, the usual case: no need to list /proc
    for _ in range(200):
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        kids = children()
        if not kids:
            return
        if own_uid:
            os.kill(-1, signal.SIGKILL)  # every process of this session's uid but this one
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.001)


class _CPUTimeExceeded(BaseException):
    """Raised by the SIGXCPU handler: pid 1 of a namespace ignores the signal's default action (death)."""


def _on_sigxcpu(*_):
    raise _CPUTimeExceeded


class _Cell:
    """Runs cells in one namespace, like a notebook kernel.

    Python-level output is kept bounded in memory (head and tail) and appended to fd 1, the memfd that the zygote
    reads (bounded too), after what native code and subprocesses wrote there."""

    def __init__(self, config, own_uid, signal_mask):
        import builtins

        self.config, self.own_uid, self.count = config, own_uid, 0
        self.signal_mask = signal_mask  # the cells' own signal mask; outside a cell every catchable one is blocked
        self.namespace = {"__name__": "__main__", "__builtins__": builtins}
        self.sink = open(os.devnull, "w")

    def run(self, code):
        self.count += 1
        filename = f"<cell-{self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        capture = _Capture(self.config["max_output_chars"])
        sys.stdout = sys.stderr = capture
        error, fatal, ok = None, None, True
        try:
            _signal.pthread_sigmask(signal.SIG_SETMASK, self.signal_mask)  # what was due meanwhile arrives here
            tree = ast.parse(code, filename)
            last = None
            if self.config["show_last_expression"] and tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), self.namespace)
            if last is not None:
                value = eval(compile(last, filename, "eval"), self.namespace)
                if value is not None and capture.total == 0 and os.fstat(1).st_size == 0:
                    capture.write(repr(value) + "\n")
        except MemoryError as exc:
            ok, fatal = False, "memory limit"
            error = _format_exception(exc, f"MemoryError: memory limit of {self.config['memory_mb']} MB exceeded")
        except _CPUTimeExceeded as exc:
            ok, fatal = False, "cpu time limit"
            error = _format_exception(exc, f"TimeoutError: CPU time limit of {self.config['cpu_time_s']:g} s exceeded")
        except SystemExit as exc:
            ok = exc.code in (None, 0)
            error = f"SystemExit: {exc.code}\n"
        except BaseException as exc:  # noqa: B036 - the cell's KeyboardInterrupt etc. are the cell's errors too
            ok, error = False, _format_exception(exc)
        finally:
            sys.stdout = sys.stderr = self.sink  # threads that keep printing after the cell print nowhere
            self.signal_mask = _quiet_signals()
        survivors = _kill_leftover_threads()
        _kill_descendants(self.own_uid)
        if survivors:
            ok, fatal = False, "background thread"
            error = (error or "") + f"RuntimeError: {survivors} background thread(s) still running after the cell\n"
        head, tail, total = capture.texts()
        text = head if total <= len(head) else head + tail
        try:
            os.write(1, text.encode("utf-8", "replace"))
        except OSError:
            pass  # the native output already reached the file size limit
        return {"ok": ok, "error": error, "fatal": fatal, "skipped": max(0, total - len(text))}


def _enter_jail(config):
    """Own mount/network/IPC/UTS namespaces (the pid namespace came with the fork): private size-bounded temp
    directories, a fresh /proc that shows only this jail, and a loopback interface that is up and reaches nothing."""
    network = 0 if config.get("network") else CLONE_NEWNET  # LocalSandbox(network=True) keeps the host's network
    check(libc.unshare(CLONE_NEWNS | network | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    tmpfs = f"size={config['scratch_mb']}m,nr_inodes={config['max_files']},mode=1777"
    for target in ("/tmp", "/dev/shm", "/var/tmp"):
        if os.path.isdir(target):
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if os.path.isdir("/dev/pts"):  # its own pseudo-terminals (bubblewrap's one instance is every jail's), 8 at most
        mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620,max=8")
    if os.path.isdir("/sys/fs/cgroup"):  # every session's (and other trainers') usage: not the cells' business
        mount("tmpfs", "/sys/fs/cgroup", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    if network:
        with socket.socket() as s:  # SIOCSIFFLAGS lo IFF_UP|IFF_RUNNING
            fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x40, b""))


# Plain ints and the C function: `signal.pthread_sigmask` turns every result into enum members (30x slower).
_CATCHABLE = {int(n) for n in signal.valid_signals()} - {int(signal.SIGKILL), int(signal.SIGSTOP)}
_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)


def _quiet_signals():
    """Blocks every catchable signal and cancels the interval timers a cell may have set; returns the mask to give
    back to the next cell. While the interpreter waits for a request no handler of a cell can run (one run by the
    trainer's SIGCONT, a SIGCHLD or SIGIO, a timer) and take the request before the interpreter reads it."""
    mask = _signal.pthread_sigmask(signal.SIG_BLOCK, _CATCHABLE)
    for timer in _TIMERS:
        signal.setitimer(timer, 0)
    return mask


def _install_seccomp(program):
    """Loads a classic-BPF seccomp filter (built on the host with libseccomp) for this process and its children."""
    filt = ctypes.create_string_buffer(program)

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(len(program) // 8, ctypes.cast(filt, ctypes.c_void_p))
    check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


# What a pre-started jail runs (and forgets) before it is handed out: the request loop, a trailing expression, printing
# and a traceback, so that a session's first call does not pay for copying those pages from the zygote (fork's
# copy-on-write: 60-170 page faults, about a third of a first call's time, measured by scripts/bench_sandbox.py).
_WARM_UP_CELLS = (
    "values = [i * i for i in range(8)]\nprint(sum(values), max(values), values[-1] / 3)\n{'n': len(values)}",
    "import math\ntotal = math.sqrt(2.0)\nprint(f'{total:.3f}')\ntotal / 0",
)


def _serve(cell, payload, cpu_s):
    """One call: runs the request's cell with a fresh CPU budget; returns the status frame."""
    request = json.loads(payload)
    os.ftruncate(1, 0)
    os.lseek(1, 0, os.SEEK_SET)
    # RLIMIT_CPU is cumulative per process: give each cell its own budget on top of what was used so far.
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime + cpu_s) + 1
    # Only the soft limit moves (SIGXCPU): an unprivileged process cannot raise its hard limit again, and C code
    # that keeps SIGXCPU from taking effect is ended by the trainer's wall-clock timeout.
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
    try:
        status = cell.run(request["code"])
    except BaseException as exc:  # noqa: B036 - a cell's signal handler raising once the cell is over
        cell.signal_mask = _quiet_signals()
        status = {"ok": False, "error": _format_exception(exc), "fatal": "signal handler", "skipped": 0}
    return frame(status)


def session_main(config, jail):
    """Body of a session process (fds already in place): isolation and limits, then cells until EOF."""
    if jail["warm"]:  # a spare started ahead of demand sets up behind the running cells; reniced when handed out
        os.setpriority(os.PRIO_PROCESS, 0, _BACKGROUND_NICE)
    os.setsid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGXCPU):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing us
    signal.signal(signal.SIGXCPU, _on_sigxcpu)
    for directory in dict.fromkeys(jail["cgroups"].values()):
        write_file(os.path.join(directory, "cgroup.procs"), "0")
    try:  # first in line for the OOM killer, before the trainer (a cell cannot lower it again)
        write_file("/proc/self/oom_score_adj", "1000")
    except OSError:
        pass
    if config["jail"]:
        _enter_jail(config)
    scratch = os.path.join(config["scratch_root"], jail["name"])
    os.makedirs(config["scratch_root"], mode=0o711, exist_ok=True)
    os.mkdir(scratch, 0o700)
    uid = jail["uid"]
    if uid:
        os.chown(scratch, uid, uid)
    os.chdir(scratch)
    mb = 1024 * 1024
    limits = [
        (resource.RLIMIT_AS, config["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, config["max_file_size_mb"] * mb),
        (resource.RLIMIT_NOFILE, config["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, resource.RLIM_INFINITY),  # while still root; each call then sets its soft limit
    ]
    if uid:  # RLIMIT_NPROC counts the uid's processes: only a per-session uid makes it a per-session cap
        limits.append((resource.RLIMIT_NPROC, config["max_processes"]))
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))
    if uid:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if config.get("seccomp"):
        _install_seccomp(base64.b64decode(config["seccomp"]))
    os.environ["HOME"] = os.environ["TMPDIR"] = scratch
    sys.argv = [""]
    if "random" in sys.modules:  # forked children would otherwise all draw the same "random" numbers
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    mask = _quiet_signals()
    cpu_s = config["cpu_time_s"]
    if jail["warm"]:  # touch the pages a call touches now rather than during the session's first call
        warm_up = _Cell(dict(config, show_last_expression=True), uid, mask)
        for code in _WARM_UP_CELLS:
            _serve(warm_up, json.dumps({"code": code}).encode(), cpu_s)
        os.ftruncate(1, 0)
    cell = _Cell(config, uid, mask)
    os.write(READY_FD, b"1")  # set up: a death from now on is a cell's doing, not the jail's
    os.close(READY_FD)
    while True:
        header = read_exact(REQUEST_FD, HEADER.size)  # the host sees us parked here between calls
        if header is None:
            break
        status_frame = _serve(cell, read_exact(REQUEST_FD, HEADER.unpack(header)[0]), cpu_s)
        os.write(STATUS_FD, status_frame)  # then park in the read above: the host kills us if fatal
    _kill_descendants(uid)
    os._exit(0)


def probe_jail():
    """Whether this process can build jails (namespaces and mounts need root, or a user namespace's root)."""
    if os.geteuid() != 0:
        return "not root"
    pid = os.fork()
    if pid == 0:
        try:
            check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID), "unshare")
            mount(None, "/", None, MS_REC | MS_PRIVATE)
            mount("tmpfs", "/tmp", "tmpfs", 0, "size=1m")
            os._exit(0)
        except BaseException:  # noqa: B036
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return None if status == 0 else "unshare or mount failed"


# ------------------------------------------------------------------------------- used by the zygote


class Jail:
    """The zygote's handle on one session process: its channels (until handed to the host) and its cgroups."""

    def __init__(self, pid, request_w, status_r, output, ready_r, cgroups, scratch):
        self.pid, self.request_w, self.status_r, self.output = pid, request_w, status_r, output
        self.ready_r = ready_r  # EOF (after a byte) once the jail is set up, before any cell
        self.cgroup_kinds, self.scratch = cgroups, scratch  # {kind: directory}
        self.cgroups = list(dict.fromkeys(cgroups.values()))
        self.host = None  # the session's socket to the host, once handed out
        self.set_up = False
        self.closed = False

    def hand_over(self, host):
        """The host now holds the request and status pipes: only it writes requests and reads statuses."""
        self.host = host
        host.setblocking(False)
        for fd in (self.request_w, self.status_r):
            os.close(fd)
        self.request_w = self.status_r = None

    def close_fds(self):
        if self.closed:
            return
        self.closed = True
        for fd in (self.request_w, self.status_r, self.output, self.ready_r):
            if fd is not None:
                os.close(fd)
        self.request_w = self.status_r = self.ready_r = None
        if self.host is not None:
            self.host.close()
            self.host = None


def recv_control(sock):
    """Reads one control frame and the descriptors riding on its first byte; (None, []) at EOF."""
    fds = []
    header, anc, _, _ = sock.recvmsg(HEADER.size, socket.CMSG_SPACE(4 * 4))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    while header and len(header) < HEADER.size:
        more = sock.recv(HEADER.size - len(header))
        header = header + more if more else b""
    if not header:
        return None, fds
    size = HEADER.unpack(header)[0]
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None, fds
        data += more
    return json.loads(data), fds
