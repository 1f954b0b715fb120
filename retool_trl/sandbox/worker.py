"""The code that runs inside the sandbox: a zygote that forks one interpreter process per session.

Executed as a script (`python -I worker.py CONFIG_JSON CONTROL_FD`), never imported by the trainer, and stdlib-only:
neither the trainer's packages nor this package's path end up in the sandbox.

* The zygote starts once per `LocalSandbox` (inside bubblewrap when available), pre-imports the configured modules
  and then only forks: one child per session, so a session's globals live in its own process and a crash or a limit
  only ever takes down that session. Fork is a few ms; Python start-up and imports are paid once.
* A session process drops to its own unprivileged uid (so `RLIMIT_NPROC` is a per-session cap that also binds when the
  trainer runs as root, `kill(-1)` only reaches the session's own processes, and other sessions' files are private),
  applies the rlimits, then executes cells sent over its socket until the socket closes.

Frames on every socket: a 4-byte big-endian length, then UTF-8 JSON.
"""

import ast
import ctypes
import gc
import json
import linecache
import os
import resource
import select
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
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_THIS_FILE = os.path.abspath(__file__)
# Only root may lower its niceness again (the zygote after a fork, a spare becoming a session).
_BACKGROUND_NICE = 10 if os.geteuid() == 0 else 0
_REFILL_AFTER_S = 0.002
_libc = ctypes.CDLL(None, use_errno=True)


def _send(sock, obj, fds=()):
    data = json.dumps(obj).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
    else:
        sock.sendall(payload)


def _recv_exact(sock, n):
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock, max_bytes=_MAX_REQUEST, with_fds=False):
    """Reads one frame; returns (obj, fds) or (None, []) at EOF."""
    fds = []
    if with_fds:
        # Passed descriptors ride on the first byte of the frame, so read the header with recvmsg.
        header, anc, _, _ = sock.recvmsg(_HEADER.size, socket.CMSG_SPACE(4 * 4))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4]))
        if header and len(header) < _HEADER.size:
            rest = _recv_exact(sock, _HEADER.size - len(header))
            header = None if rest is None else header + rest
    else:
        header = _recv_exact(sock, _HEADER.size)
    if not header:
        return None, fds
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        return None, fds
    data = _recv_exact(sock, size)
    return (None if data is None else json.loads(data)), fds


def _prctl(option, value):
    _libc.prctl(option, value, 0, 0, 0)


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

    def skip(self, n):
        """Counts `n` characters that were dropped from the middle of a stream."""
        self.total += n

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


def _read_native(fd, capture):
    """Moves what subprocesses and C code wrote to fds 1/2 (a memfd) into `capture`, bounded, then empties it."""
    size = os.fstat(fd).st_size
    if not size:
        return
    limit = capture.limit * 4  # bytes; generous for multi-byte UTF-8
    if size <= 2 * limit:
        capture.write(os.pread(fd, size, 0).decode("utf-8", "replace"))
    else:
        head = os.pread(fd, limit, 0).decode("utf-8", "replace")
        tail = os.pread(fd, limit, size - limit).decode("utf-8", "replace")
        capture.write(head)
        capture.skip(size - 2 * limit)
        capture.write(tail)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)


def _format_exception(exc, last_line=None):
    """A short, notebook-like traceback: cell frames (and the last library frames), no frames of this worker."""
    te = traceback.TracebackException.from_exception(exc)
    # A syntax error has no frames worth showing (only ours and the ast module's).
    frames = [] if isinstance(exc, SyntaxError) else [f for f in te.stack if os.path.abspath(f.filename) != _THIS_FILE]
    frames = frames[-5:]
    lines = []
    if frames:
        lines = ["Traceback (most recent call last):\n", *traceback.StackSummary.from_list(frames).format()]
    only = list(te.format_exception_only())
    if last_line is None and isinstance(exc, SyntaxError):
        lines += only  # file/line/caret lines, then "SyntaxError: ..." last
    else:
        # One final line, whatever the message: the model (and the tests) read the last line as "what happened".
        lines.append((last_line or " ".join("".join(only).split())) + "\n")
    return "".join(lines)


def _kill_leftover_threads(budget_s=0.25):
    """Stops threads a cell left running (SystemExit at their next bytecode); returns how many survived."""
    main = threading.main_thread()
    others = [t for t in threading.enumerate() if t is not main and t.is_alive()]
    if not others:
        return 0
    for t in others:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(SystemExit))
    deadline = time.monotonic() + budget_s
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    return sum(t.is_alive() for t in others)


def _children():
    """Direct children of this process (as a subreaper, every live descendant ends up here once its parent dies)."""
    kids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids.extend(int(p) for p in f.read().split())
        except OSError:
            pass
    return kids


def _kill_descendants(own_uid):
    """Kills and reaps every process the cell started, so nothing it spawned outlives the cell."""
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
        else:
            for pid in kids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.001)


class _Cell:
    """Runs cells in one namespace, like a notebook kernel."""

    def __init__(self, config, native_fd, own_uid):
        import builtins

        self.config = config
        self.native_fd = native_fd
        self.own_uid = own_uid
        self.count = 0
        self.namespace = {"__name__": "__main__", "__builtins__": builtins}
        self.sink = open(os.devnull, "w")

    @staticmethod
    def warm_up(config):
        """Runs a throwaway cell so the pages a cell touches are copied now rather than during the first call."""
        cell = _Cell(dict(config, show_last_expression=True), os.memfd_create("warm", 0), 0)
        json.dumps(cell.run("print(1)\n2"))
        os.close(cell.native_fd)
        cell.sink.close()

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
                if value is not None and capture.total == 0 and os.fstat(self.native_fd).st_size == 0:
                    capture.write(repr(value) + "\n")
        except MemoryError as exc:
            ok, fatal = False, "memory limit"
            error = _format_exception(exc, f"MemoryError: memory limit of {self.config['memory_mb']} MB exceeded")
        except SystemExit as exc:
            ok = exc.code in (None, 0)
            error = f"SystemExit: {exc.code}\n"
        except BaseException as exc:  # noqa: B036 - the cell's KeyboardInterrupt etc. are the cell's errors too
            ok = False
            error = _format_exception(exc)
        finally:
            sys.stdout = sys.stderr = self.sink  # threads that keep printing after the cell print nowhere
        survivors = _kill_leftover_threads()
        _kill_descendants(self.own_uid)
        _read_native(self.native_fd, capture)
        if survivors:
            ok, fatal = False, "background thread"
            error = (error or "") + f"RuntimeError: {survivors} background thread(s) still running after the cell\n"
        head, tail, total = capture.texts()
        return {"ok": ok, "head": head, "tail": tail, "total": total, "error": error, "fatal": fatal}


def _spare_main(link, config, zygote_pid, warm):
    """A pre-forked process waiting to become a session: forking and first-touch page faults happen before any
    cell needs it, so a session's first call costs about as much as its later ones."""
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:  # the zygote died before the death signal was armed
        os._exit(1)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGXCPU):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing us
    os.dup2(link.detach(), 3)
    os.closerange(4, 1 << 16)  # other spares' links, the zygote's control socket
    link = socket.socket(fileno=3)
    if warm:
        _Cell.warm_up(config)
    request, fds = _recv(link, with_fds=True)
    if request is None or len(fds) != 1:
        os._exit(0)
    link.close()
    os.setpriority(os.PRIO_PROCESS, 0, 0)  # a session's cells run at normal priority (we are still root)
    _session_main(fds[0], request["uid"], os.path.join(config["scratch_root"], request["name"]), config)


def _session_main(sock_fd, uid, scratch, config):
    """Body of a session process: set up isolation and limits, then serve cells until the socket closes."""
    os.mkdir(scratch, 0o700)
    if uid:
        os.chown(scratch, uid, uid)
    os.chdir(scratch)

    # fds: 0 = /dev/null (reading stdin never blocks), 1/2 = a memfd for native output, 3 = our socket.
    devnull = os.open("/dev/null", os.O_RDONLY)
    native = os.memfd_create("output", 0)
    os.dup2(devnull, 0)
    os.dup2(native, 1)
    os.dup2(native, 2)
    os.dup2(sock_fd, 3)
    os.closerange(4, 1 << 16)
    sock = socket.socket(fileno=3)
    native = 1

    mb = 1024 * 1024
    limits = [
        (resource.RLIMIT_AS, config["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, config["max_file_size_mb"] * mb),
        (resource.RLIMIT_NOFILE, config["max_open_files"]),
        (resource.RLIMIT_CORE, 0),
    ]
    if uid:  # RLIMIT_NPROC counts the uid's processes: only a per-session uid makes it a per-session cap
        limits.append((resource.RLIMIT_NPROC, config["max_processes"]))
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))
    if uid:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    os.environ["HOME"] = os.environ["TMPDIR"] = scratch
    sys.argv = [""]
    if "random" in sys.modules:  # forked children would otherwise all draw the same "random" numbers
        sys.modules["random"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()

    # Tell the host our pid as *it* sees it (the kernel translates SCM_CREDENTIALS across pid namespaces).
    hello = json.dumps({"hello": True}).encode()
    creds = struct.pack("3i", os.getpid(), os.getuid(), os.getgid())
    sock.sendmsg([_HEADER.pack(len(hello)) + hello], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])

    cell = _Cell(config, native, uid)
    cpu_s = config["cpu_time_s"]
    while True:
        try:
            request, _ = _recv(sock)
        except OSError:
            request = None
        if request is None:
            break
        # RLIMIT_CPU is cumulative per process: give each cell its own budget on top of what was used so far.
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime + cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
        reply = cell.run(request["code"])
        reply["id"] = request["id"]
        try:
            _send(sock, reply)
        except OSError:
            break
        if reply["fatal"]:
            break
    os.setpriority(os.PRIO_PROCESS, 0, _BACKGROUND_NICE)  # tearing down this process is background work too
    _kill_descendants(uid)
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------- zygote


class _Zygote:
    """Forks session processes on request and cleans up after them; runs as root inside the sandbox."""

    def __init__(self, control, config):
        self.control = control
        self.config = config
        self.sessions = {}  # pid -> (uid, scratch)
        self.spares = {}  # pid -> link, oldest first: forked processes waiting to become sessions
        self.stopping = False
        self.exited = {}  # pid -> wait status, for the host's `kill` queries
        os.makedirs(config["scratch_root"], mode=0o711, exist_ok=True)
        os.chmod(config["scratch_root"], 0o711)

    def reap(self, block_pid=None):
        """Reaps every dead child (and orphaned descendant); with `block_pid`, waits until that one is reaped."""
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block_pid is not None else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.spares:  # a spare died before being used (killed from outside, out of memory)
                self.spares.pop(pid).close()
            if pid in self.sessions:
                self.exited[pid] = status
                if len(self.exited) > 4096:
                    self.exited.pop(next(iter(self.exited)))
                uid, scratch = self.sessions.pop(pid)
                self.cleanup(pid, uid, scratch, clean=os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0)
            if pid == block_pid:
                return

    def cleanup(self, pid, uid, scratch, clean):
        if not clean and not self.stopping:  # at shutdown, `shutdown` kills by uid in bulk
            self.sweep(pid, uid)
        shutil.rmtree(scratch, ignore_errors=True)

    def sweep(self, pid, uid):
        """Kills every process the session left behind: all of its uid, or its process group without one."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if not uid:
            return
        for _ in range(50):
            killer = os.fork()
            if killer == 0:
                try:
                    os.setresuid(uid, uid, uid)
                    os.kill(-1, signal.SIGKILL)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            self.reap(block_pid=killer)
            if not self._live_pids_of({uid}):
                return

    @staticmethod
    def _live_pids_of(uids):
        """Pids of live (non-zombie) processes owned by any of `uids`."""
        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.stat(f"/proc/{name}").st_uid not in uids:
                    continue
                with open(f"/proc/{name}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                pids.append(int(name))
        return pids

    def fork_spare(self, background=True):
        """Forks a process that waits to become a session. In the background (a refill while idle) the fork and the
        spare's warm-up run niced behind the cells; on demand (spares ran out) they run at full speed, no warm-up.
        """
        ours, theirs = socket.socketpair()
        # The spare is reniced to 0 when it becomes a session; as root we can lower our own niceness back too.
        nice = _BACKGROUND_NICE if background else 0
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return False
        finally:
            os.setpriority(os.PRIO_PROCESS, 0, nice if os.getpid() != self.pid else 0)
        if pid == 0:
            try:
                ours.close()
                _spare_main(theirs, self.config, self.pid, warm=background)
            except BaseException:  # noqa: B036 - a child must never return into the zygote's loop
                traceback.print_exc()  # the trainer's stderr while setting up; the cell's output capture afterwards
            os._exit(1)
        theirs.close()
        self.spares[pid] = ours
        return True

    def spawn(self, request, fds):
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            return {"error": "spawn needs exactly one socket"}
        try:
            for _ in range(3):
                if not self.spares and not self.fork_spare(background=False):
                    return {"error": "fork failed (out of processes or memory?)"}
                pid = next(iter(self.spares))
                link = self.spares.pop(pid)
                try:
                    _send(link, {"uid": request["uid"], "name": request["name"]}, fds)
                except OSError:  # that spare died just now (it is reaped like any child): take another
                    continue
                finally:
                    link.close()
                self.sessions[pid] = (request["uid"], os.path.join(self.config["scratch_root"], request["name"]))
                return {"pid": pid}
            return {"error": "spare processes keep dying"}
        finally:
            os.close(fds[0])

    def kill(self, request):
        pid = request["pid"]
        if pid in self.sessions:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.reap(block_pid=pid)
        return {"status": self.exited.pop(pid, None)}

    def shutdown(self):
        """Kills every session and what it started, in a few passes over /proc rather than one sweep per session."""
        self.stopping = True
        for link in self.spares.values():
            link.close()  # a spare exits at EOF
        uids = {uid for uid, _ in self.sessions.values() if uid}
        for pid in list(self.sessions):
            for kill in (os.kill, os.killpg):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for _ in range(100):
            victims = self._live_pids_of(uids) if uids else []
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.reap()
            if not victims and not self.sessions:
                break
            time.sleep(0.002)
        for _, scratch in self.sessions.values():
            shutil.rmtree(scratch, ignore_errors=True)

    def serve(self):
        self.pid = os.getpid()
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd to fire
        # No interface but loopback: the network namespace (bubblewrap's or our own) holds.
        interfaces = [name for _, name in socket.if_nameindex()]
        _send(self.control, {"ready": True, "pid": self.pid, "network_isolated": interfaces in ([], ["lo"])})
        while True:
            # Quiet for a moment: top up the spares. Busy: serve requests first (forking on demand if the spares
            # ran out), so a refill never competes with a session that was just handed out.
            refill = len(self.spares) < self.config["spares"]
            readable, _, _ = select.select([self.control, wake_r], [], [], _REFILL_AFTER_S if refill else None)
            if not readable:
                if not self.fork_spare():
                    time.sleep(0.1)  # out of processes or memory: do not spin
                continue
            if wake_r in readable:
                wake_r.recv(4096)
                self.reap()
            if self.control not in readable:
                continue
            try:
                request, fds = _recv(self.control, with_fds=True)
            except (OSError, ValueError):
                request, fds = None, []
            if request is None or request.get("op") == "shutdown":
                break
            op = request.get("op")
            if op == "spawn":
                reply = self.spawn(request, fds)
            elif op == "kill":
                reply = self.kill(request)
            else:
                reply = {"error": f"unknown op {op!r}"}
            self.reap()
            _send(self.control, reply)
        signal.set_wakeup_fd(-1)  # the wakeup socket goes away with this frame
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.shutdown()


def main():
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=int(sys.argv[2]))
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(_THIS_FILE):
        del sys.path[0]  # cells must not import this package's modules as top-level names
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of sessions come to us, so they are reaped and swept
    if config.get("unshare_net"):
        # Without bubblewrap, a root zygote can still leave the network on its own: a fresh netns has no interfaces.
        if _libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
            errno = ctypes.get_errno()
            _send(control, {"warning": f"unshare(CLONE_NEWNET) failed (errno {errno}): cells have network"})
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
    main()
