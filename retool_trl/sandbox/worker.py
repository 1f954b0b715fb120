"""The code that runs inside the sandbox: a zygote that forks one jailed interpreter process per session.

Executed as a script (`python -I worker.py CONFIG_JSON CONTROL_FD`), never imported by the trainer, and stdlib-only:
neither the trainer's packages nor this package's path end up in the sandbox.

* The zygote starts once per `LocalSandbox` (inside bubblewrap when available), pre-imports the configured modules
  and then forks one *jail* per session, ahead of demand (spares). A jail is one interpreter process that is pid 1 of
  its own pid namespace, in its own mount, network, IPC and UTS namespaces (private size-bounded /tmp, /dev/shm and
  /var/tmp, loopback only), in its own memory and pids cgroups, under its own uid, rlimits and a seccomp filter.
  When that process dies the kernel kills everything in its pid namespace and frees its mounts and IPC objects.
* The zygote is also the only channel between a session and the host: it relays requests, and it reports results
  itself. A cell's output goes to a memfd the zygote reads (bounded head and tail); the cell's process reports ok and
  its traceback on a status pipe, but the zygote settles a call only once that process is parked again (one thread,
  blocked reading its request pipe), then stops it (SIGSTOP) until the next request. A cell that forges a status frame
  and keeps running settles nothing; its wall-clock limit (kept by the host) still holds; a death is reported with the
  zygote's own wait status. The zygote only ever waits with WNOHANG: any number of deaths at once cost one pass.

Frames on every socket and pipe: a 4-byte big-endian length, then UTF-8 JSON.
"""

import ast
import base64
import ctypes
import errno
import fcntl
import gc
import json
import linecache
import os
import random
import resource
import selectors
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections import deque

_HEADER = struct.Struct("!I")
_MAX_REQUEST = 16 * 1024 * 1024
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 1, 38, 22, 2
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC, _CLONE_NEWPID, _CLONE_NEWNET = (
    0x20000, 0x4000000, 0x8000000, 0x20000000, 0x40000000)
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 0x4000, 1 << 18
_REQUEST_FD, _STATUS_FD = 3, 4  # in a session process: 0 /dev/null, 1 and 2 the output memfd
_THIS_FILE = os.path.abspath(__file__)
_REFILL_AFTER_S = 0.02  # idle this long before pre-starting a jail: a fork stalls the zygote for a few ms
_BACKGROUND_NICE = 10
_PARK_POLL_S = 0.0002
_SYS_READ = {"x86_64": 0, "aarch64": 63}.get(os.uname().machine)
_libc = ctypes.CDLL(None, use_errno=True)


def _frame(obj):
    data = json.dumps(obj).encode()
    return _HEADER.pack(len(data)) + data


def _read_exact(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _take_frames(buffer, max_bytes):
    """Pops complete frames off a bytearray; raises ValueError on an oversized or malformed one."""
    frames = []
    while len(buffer) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer)
        if size > max_bytes:
            raise ValueError(f"a frame of {size} bytes")
        if len(buffer) < _HEADER.size + size:
            break
        frames.append(json.loads(bytes(buffer[_HEADER.size : _HEADER.size + size])))
        del buffer[: _HEADER.size + size]
    return frames


def _check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _prctl(option, value):
    _libc.prctl(option, value, 0, 0, 0)


def _mount(source, target, fstype, flags=0, data=None):
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _write(path, text):
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


def _children(pid="self"):
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
    for _ in range(200):
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        kids = _children()
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

    def __init__(self, config, own_uid):
        import builtins

        self.config, self.own_uid, self.count = config, own_uid, 0
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
    _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS), "unshare")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    tmpfs = f"size={config['scratch_mb']}m,nr_inodes={config['max_files']},mode=1777"
    for target in ("/tmp", "/dev/shm", "/var/tmp"):
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", _MS_NOSUID | _MS_NODEV, tmpfs)
    _mount("proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    with socket.socket() as s:  # SIOCSIFFLAGS lo IFF_UP|IFF_RUNNING
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x40, b""))


def _install_seccomp(program):
    """Loads a classic-BPF seccomp filter (built on the host with libseccomp) for this process and its children."""
    filt = ctypes.create_string_buffer(program)

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(len(program) // 8, ctypes.cast(filt, ctypes.c_void_p))
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def _session_main(config, jail):
    """Body of a session process (fds already in place): isolation and limits, then cells until EOF."""
    if jail["warm"]:  # a spare started ahead of demand sets up behind the running cells; reniced when handed out
        os.setpriority(os.PRIO_PROCESS, 0, _BACKGROUND_NICE)
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGXCPU):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing us
    signal.signal(signal.SIGXCPU, _on_sigxcpu)
    for directory in jail["cgroups"]:
        _write(os.path.join(directory, "cgroup.procs"), "0")
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
    limits = [(resource.RLIMIT_AS, config["memory_mb"] * mb), (resource.RLIMIT_FSIZE, config["max_file_size_mb"] * mb),
              (resource.RLIMIT_NOFILE, config["max_open_files"]), (resource.RLIMIT_CORE, 0)]
    if uid:  # RLIMIT_NPROC counts the uid's processes: only a per-session uid makes it a per-session cap
        limits.append((resource.RLIMIT_NPROC, config["max_processes"]))
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))
    if uid:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if config.get("seccomp"):
        _install_seccomp(base64.b64decode(config["seccomp"]))
    os.environ["HOME"] = os.environ["TMPDIR"] = scratch
    sys.argv = [""]
    if "random" in sys.modules:  # forked children would otherwise all draw the same "random" numbers
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if jail["warm"]:  # touch the pages a cell touches now rather than during the first call
        _Cell(dict(config, show_last_expression=True), uid).run("print(1)\n2")
    cell = _Cell(config, uid)
    cpu_s = config["cpu_time_s"]
    while True:
        header = _read_exact(_REQUEST_FD, _HEADER.size)  # the zygote sees us parked here between calls
        if header is None:
            break
        request = json.loads(_read_exact(_REQUEST_FD, _HEADER.unpack(header)[0]))
        os.ftruncate(1, 0)
        os.lseek(1, 0, os.SEEK_SET)
        # RLIMIT_CPU is cumulative per process: give each cell its own budget on top of what was used so far.
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime + cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 2))  # SIGKILL at the hard limit, if C code ignores
        status = cell.run(request["code"])
        os.write(_STATUS_FD, _frame(status))  # then park in the read above: the zygote kills us if fatal
    _kill_descendants(uid)
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------- zygote


class _Jail:
    """The zygote's handle on one session process: its pipes, output memfd, cgroups and the call in flight."""

    def __init__(self, pid, request_w, status_r, output, cgroups, scratch):
        self.pid, self.request_w, self.status_r, self.output = pid, request_w, status_r, output
        self.cgroups, self.scratch = cgroups, scratch
        self.host = None  # the session's socket to the host, once handed out
        self.host_buffer, self.status_buffer, self.pending = bytearray(), bytearray(), b""
        self.call_id = None  # the host's id of the call in flight
        self.status = None  # the last status frame of that call, settled once the process is parked
        self.closed = False
        self.cpu_before = 0.0  # CPU seconds the process had used when the call in flight started

    def close_fds(self):
        if self.closed:
            return
        self.closed = True
        for fd in (self.request_w, self.status_r, self.output):
            os.close(fd)
        if self.host is not None:
            self.host.close()


class _Zygote:
    """Forks jails, relays requests, settles calls and reaps; runs as root inside bubblewrap when it can."""

    def __init__(self, control, config):
        self.control, self.config = control, config
        self.jails = {}  # pid -> _Jail (spares and sessions)
        self.spares = []  # pids of jails waiting for a session, oldest first
        self.graveyard = []  # cgroup directories whose rmdir must wait for the kernel
        self.unsettled = set()  # jails whose status arrived, waiting for their process to park
        self.serial = 0
        self.uid_base = random.randrange(1 << 24, (1 << 31) - (1 << 21))
        self.selector = selectors.DefaultSelector()
        self.pid = os.getpid()
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY) if config["jail"] else None

    # -------------------------------------------------------------------------------------------- forking jails

    def _new_cgroups(self, name):
        made = []
        for kind, root in self.config["cgroups"]:
            path = os.path.join(root, name)
            os.mkdir(path)
            made.append(path)
            limits = {"memory1": {"memory.limit_in_bytes": self.config["memory_mb"] << 20},
                      "pids": {"pids.max": self.config["max_processes"]},
                      "v2": {"memory.max": self.config["memory_mb"] << 20, "memory.swap.max": 0,
                             "pids.max": self.config["max_processes"]}}[kind]
            for key, value in limits.items():
                if os.path.exists(os.path.join(path, key)):
                    _write(os.path.join(path, key), str(value))
        return made

    def fork_jail(self, warm):
        self.serial += 1
        name = f"j{self.pid}-{self.serial}"
        uid = self.uid_base + self.serial % (1 << 20) if self.config["drop_uid"] else 0
        request_r, request_w = os.pipe2(os.O_CLOEXEC)
        status_r, status_w = os.pipe2(os.O_CLOEXEC)
        output = os.memfd_create("output", os.MFD_CLOEXEC)
        try:
            cgroups = self._new_cgroups(name)
        except OSError:
            cgroups = []
        if self.config["jail"]:
            _check(_libc.unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # our next child is pid 1 of a new one
        try:
            pid = os.fork()
        finally:
            if self.config["jail"] and os.getpid() == self.pid:
                _check(_libc.setns(self.own_pidns, _CLONE_NEWPID), "setns(CLONE_NEWPID)")
        if pid == 0:
            try:
                devnull = os.open("/dev/null", os.O_RDONLY)
                mine = [os.dup(fd) for fd in (devnull, output, output, request_r, status_w)]
                for target, fd in enumerate(mine):
                    os.dup2(fd, target)
                os.closerange(5, 1 << 16)
                _session_main(self.config, {"name": name, "uid": uid, "cgroups": cgroups, "warm": warm})
            except BaseException:  # noqa: B036 - a child must never return into the zygote's loop
                traceback.print_exc()
            os._exit(70)
        os.close(request_r)
        os.close(status_w)
        os.set_blocking(request_w, False)
        os.set_blocking(status_r, False)
        scratch = None if self.config["jail"] else os.path.join(self.config["scratch_root"], name)
        self.jails[pid] = jail = _Jail(pid, request_w, status_r, output, cgroups, scratch)
        self.selector.register(status_r, selectors.EVENT_READ, ("status", jail))
        return pid

    def spawn(self, fds):
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return {"error": "spawn needs exactly one socket"}
        host = socket.socket(fileno=fds[0])
        if not self.spares:
            try:
                self.spares.append(self.fork_jail(warm=False))
            except OSError as exc:
                host.close()
                return {"error": f"could not start a jail: {exc}"}
        jail = self.jails[self.spares.pop(0)]
        jail.host = host
        try:
            os.setpriority(os.PRIO_PROCESS, jail.pid, 0)  # only root may lower niceness again: we are root here
        except OSError:
            pass
        host.setblocking(False)
        self.selector.register(host, selectors.EVENT_READ, ("host", jail))
        # Tell the host the session's pid as *it* sees it (SCM_CREDENTIALS are translated between pid namespaces;
        # naming another process's pid needs CAP_SYS_ADMIN, which the zygote has when it runs as root).
        try:
            creds = struct.pack("3i", jail.pid, os.getuid(), os.getgid())
            hello = _frame({"hello": True, "pid": jail.pid, "creds": True})
            host.sendmsg([hello], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
        except OSError:  # unprivileged, hence in the host's pid namespace: our pid numbers are the host's
            host.sendall(_frame({"hello": True, "pid": jail.pid, "creds": False}))
        return {"pid": jail.pid}

    # -------------------------------------------------------------------------------------------------- calls

    def on_host(self, jail):
        try:
            data = jail.host.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            return self.kill(jail)  # the session was closed (or the host is gone)
        jail.host_buffer += data
        try:
            requests = _take_frames(jail.host_buffer, _MAX_REQUEST)
        except ValueError:
            return self.kill(jail)
        for request in requests:
            if jail.call_id is not None:
                continue  # one call at a time; the host never sends another before a reply
            jail.call_id, jail.status = request.get("id"), None
            jail.status_buffer.clear()
            jail.pending += _frame({"code": str(request.get("code", ""))})
            jail.cpu_before = _cpu_seconds(jail.pid)
            os.kill(jail.pid, signal.SIGCONT)
            self.flush_request(jail)

    def flush_request(self, jail):
        try:
            written = os.write(jail.request_w, jail.pending) if jail.pending else 0
        except BlockingIOError:
            written = 0
        except OSError:
            written, jail.pending = 0, b""  # the process is gone: its death settles the call
        jail.pending = jail.pending[written:]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if jail.pending else 0)
        self.selector.modify(jail.host, events, ("host", jail))

    def on_status(self, jail):
        try:
            data = os.read(jail.status_r, 1 << 16)
        except BlockingIOError:
            return
        if not data:
            return
        jail.status_buffer += data
        try:
            frames = _take_frames(jail.status_buffer, 64 * self.config["max_output_chars"] + (1 << 16))
        except ValueError:  # garbage on the status pipe: the call still ends only when the process parks or dies
            jail.status_buffer.clear()
            frames = [{"ok": False, "error": "SystemError: the interpreter sent an invalid status\n",
                       "fatal": "invalid status"}]
        if frames and jail.call_id is not None and (jail.status or {}).get("fatal") != "invalid status":
            jail.status = frames[-1]
            self.unsettled.add(jail)  # a forged frame followed by more work is superseded by the real one

    def parked(self, jail):
        """True when the session process is single-threaded and blocked reading its request pipe: the cell is over
        (whatever it wrote on its status pipe before) and nothing of it can still run."""
        try:
            with open(f"/proc/{jail.pid}/syscall") as f:
                fields = f.read().split()
            with open(f"/proc/{jail.pid}/status") as f:
                threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        except (OSError, StopIteration, ValueError):
            return False
        return threads == 1 and len(fields) > 1 and fields[0] == str(_SYS_READ) and int(fields[1], 16) == _REQUEST_FD

    def settle(self, jail):
        os.kill(jail.pid, signal.SIGSTOP)  # between calls nothing of the session runs (timers, signal handlers)
        for pid in self.descendants(jail.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        status = jail.status if isinstance(jail.status, dict) else {}
        reply = dict(self.read_output(jail, status.get("skipped", 0)), id=jail.call_id, ok=status.get("ok") is True,
                     error=str(status.get("error") or ""), fatal=status.get("fatal") and str(status["fatal"]))
        jail.call_id, jail.status = None, None
        self.unsettled.discard(jail)
        self.send(jail, reply)
        if reply["fatal"]:
            self.kill(jail)

    def settle_crash(self, jail, crash):
        if jail.call_id is not None:
            self.send(jail, dict(self.read_output(jail), id=jail.call_id, crash=crash))
        jail.call_id = None
        self.kill(jail)

    def read_output(self, jail, skipped=0):
        """The bounded head and tail of what the cell wrote (bytes decoded with replacement: always valid text)."""
        size = os.fstat(jail.output).st_size
        limit = 4 * self.config["max_output_chars"]
        skipped = min(max(0, skipped), 1 << 40) if isinstance(skipped, int) else 0
        if size <= 2 * limit:
            text = os.pread(jail.output, size, 0).decode("utf-8", "replace")
            return {"head": text, "tail": text, "total": len(text) + skipped}
        head = os.pread(jail.output, limit, 0).decode("utf-8", "replace")
        tail = os.pread(jail.output, limit, size - limit).decode("utf-8", "replace")
        return {"head": head, "tail": tail, "total": len(head) + len(tail) + size - 2 * limit + skipped}

    def send(self, jail, reply):
        try:
            jail.host.setblocking(True)
            jail.host.sendall(_frame(reply))
            jail.host.setblocking(False)
        except OSError:
            pass  # the host gave up on this call (timeout): the session is being killed

    @staticmethod
    def descendants(pid):
        found, todo = [], _children(pid)
        while todo:
            found.append(todo.pop())
            todo.extend(_children(found[-1]))
        return found

    # ------------------------------------------------------------------------------------------ deaths, cleanup

    def kill(self, jail):
        # pid 1 of its namespace: the kernel takes the rest of the jail along (without one: its process group).
        for kill in (os.kill, os.killpg):
            try:
                kill(jail.pid, signal.SIGKILL)
            except OSError:
                pass
        jail.call_id = None
        self.forget(jail)

    def forget(self, jail):
        self.unsettled.discard(jail)
        if jail.closed:
            return
        for fileobj in (jail.status_r, jail.host):
            if fileobj is not None:
                try:
                    self.selector.unregister(fileobj)
                except (KeyError, ValueError):
                    pass
        jail.close_fds()
        jail.host = None

    def reap(self):
        """Reaps every dead child without ever blocking, so any number of deaths at once cost one pass."""
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            jail = self.jails.pop(pid, None)
            if jail is None:
                continue  # a scratch remover
            if pid in self.spares:
                self.spares.remove(pid)
            if jail.call_id is not None and not jail.closed:
                self.settle_crash(jail, self.describe_death(jail, status, usage))
            self.forget(jail)
            self.graveyard.extend(jail.cgroups)
            if jail.scratch:
                self.remove_later(jail.scratch)
        self.graveyard = [path for path in self.graveyard if not self._rmdir(path)]

    def describe_death(self, jail, status, usage):
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig == signal.SIGKILL and usage.ru_utime + usage.ru_stime - jail.cpu_before >= self.config["cpu_time_s"]:
                sig = signal.SIGXCPU  # the hard CPU limit's SIGKILL, after a SIGXCPU that C code did not let through
            return {"signal": sig, "oom": sig == signal.SIGKILL and self.oom_killed(jail)}
        return {"exit": os.WEXITSTATUS(status)}

    @staticmethod
    def oom_killed(jail):
        for path in jail.cgroups:
            for name in ("memory.oom_control", "memory.events"):
                try:
                    with open(os.path.join(path, name)) as f:
                        counts = dict(line.split() for line in f if len(line.split()) == 2)
                except OSError:
                    continue
                if int(counts.get("oom_kill", 0)):
                    return True
        return False

    @staticmethod
    def _rmdir(path):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        return True

    def remove_later(self, path):
        """Removes a scratch directory in a child: a million files cost that child, not the other sessions."""
        try:
            if os.fork() == 0:
                shutil.rmtree(path, ignore_errors=True)
                os._exit(0)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)

    def shutdown(self):
        for jail in list(self.jails.values()):
            self.kill(jail)
        deadline = time.monotonic() + 5
        while self.jails and time.monotonic() < deadline:  # cgroups left are the host's to remove
            self.reap()
            time.sleep(0.002)

    # --------------------------------------------------------------------------------------------- main loop

    def serve(self):
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd to fire
        self.selector.register(self.control, selectors.EVENT_READ, ("control", None))
        self.selector.register(wake_r, selectors.EVENT_READ, ("wake", None))
        interfaces = [name for _, name in socket.if_nameindex()]
        _send(self.control, {"ready": True, "pid": self.pid, "network_isolated": interfaces in ([], ["lo"]),
                             "jail": self.config["jail"], "own_uid_per_session": self.config["drop_uid"]})
        while True:
            waiting = [j for j in self.unsettled if j.status is not None and j.call_id is not None and not j.closed]
            refill = len(self.spares) < self.config["spares"]
            timeout = _PARK_POLL_S if waiting else _REFILL_AFTER_S if refill else None
            events = self.selector.select(timeout)
            if not events and refill and not waiting:
                try:
                    self.spares.append(self.fork_jail(warm=True))
                except OSError:
                    time.sleep(0.1)  # out of processes or memory: do not spin
            for key, mask in events:
                kind, jail = key.data
                if kind == "wake":
                    wake_r.recv(4096)
                    self.reap()
                elif kind == "control":
                    if not self.on_control():
                        signal.set_wakeup_fd(-1)
                        self.shutdown()
                        return
                elif jail.closed:
                    continue
                elif kind == "status":
                    self.on_status(jail)
                else:
                    if mask & selectors.EVENT_WRITE:
                        self.flush_request(jail)
                    if mask & selectors.EVENT_READ and not jail.closed:
                        self.on_host(jail)
            for jail in [j for j in self.unsettled if j.status is not None and j.call_id is not None]:
                for _ in range(20):  # it parks microseconds after its status: yield the CPU rather than sleep
                    if jail.closed or self.parked(jail):
                        break
                    os.sched_yield()
                if not jail.closed and self.parked(jail):
                    self.settle(jail)

    def on_control(self):
        try:
            request, fds = _recv_control(self.control)
        except (OSError, ValueError):
            request, fds = None, []
        if request is None or request.get("op") == "shutdown":
            return False
        reply = self.spawn(fds) if request.get("op") == "spawn" else {"error": f"unknown op {request.get('op')!r}"}
        _send(self.control, reply)
        return True


def _send(sock, obj):
    sock.sendall(_frame(obj))


def _recv_control(sock):
    """Reads one control frame and the descriptors riding on its first byte; (None, []) at EOF."""
    fds = []
    header, anc, _, _ = sock.recvmsg(_HEADER.size, socket.CMSG_SPACE(4 * 4))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
    while header and len(header) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(header))
        header = header + more if more else b""
    if not header:
        return None, fds
    size = _HEADER.unpack(header)[0]
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return None, fds
        data += more
    return json.loads(data), fds


def _cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _probe_jail(config):
    """Whether this process can build jails (namespaces and mounts need root, or a user namespace's root)."""
    if os.geteuid() != 0:
        return "not root"
    pid = os.fork()
    if pid == 0:
        try:
            _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWPID), "unshare")
            _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
            _mount("tmpfs", "/tmp", "tmpfs", 0, "size=1m")
            os._exit(0)
        except BaseException:  # noqa: B036
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return None if status == 0 else "unshare or mount failed"


def main():
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=int(sys.argv[2]))
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(_THIS_FILE):
        del sys.path[0]  # cells must not import this package's modules as top-level names
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    problem = _probe_jail(config) if config["jail"] else "not asked for"
    if config["jail"] and problem:
        _send(control, {"warning": f"per-session jails are unavailable ({problem}): sessions share /tmp, network "
                                   "and IPC namespaces"})
        config["jail"] = False
    for name in config.get("preload", ()):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - an optional accelerator; cells report their own ImportError
            pass
    with open("/proc/self/status") as f:
        vm_mb = next((int(line.split()[1]) // 1024 for line in f if line.startswith("VmSize:")), 0)
    if vm_mb + 64 > config["memory_mb"]:
        _send(control, {"warning": f"memory_mb={config['memory_mb']} leaves cells almost nothing: the interpreter "
                                   f"with its preloaded modules already maps {vm_mb} MB of address space"})
    os.chdir("/")
    gc.freeze()  # keep the collector off the preloaded objects, so forked children do not copy their pages
    _Zygote(control, config).serve()


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
