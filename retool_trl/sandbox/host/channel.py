"""The host's direct line to one jailed session process: request pipe, status pipe, output memfd, pidfd.

The zygote forks the jail and hands these over once (with the jail's pid as this process sees it); every call then
goes straight from here to the session process and back, without a hop through the zygote. What a cell could forge
does not decide anything: a call is over only when `parked()` sees the process blocked, single-threaded, reading its
empty request pipe; its output is read from the memfd with a bound; its timeout is kept here and enforced through
the pidfd. The zygote's only message on the socket is how the process died (its own wait status). What a finished
call leaves running in the jail is killed by `sweep.py` before the call settles; what the kernel says of the process
(parked, its CPU, exited) is read by `process_watch.py`.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import socket
import struct
import threading
import time

from ..isolation import fsuid
from ..jail.wire import CREDS, frame, take_frames
from .parking import FREEZE_AFTER_S, ParkedFreeze, freeze_later
from .process_watch import _FDS_LOCK, ProcessWatch, _kept_files
from .sweep import JailSweep

_HELLO_FDS = 3  # request pipe (write end), status pipe (read end), output memfd
_MAX_STATUS = 1 << 20
# The interpreter writes one status frame per call; a cell that writes more than this many (or this many bytes)
# floods the channel, and its call ends as its own failure: the trainer reads and parses no more of it.
_STATUS_FLOOD_FRAMES, _STATUS_FLOOD_BYTES = 64, 4 * _MAX_STATUS
STATUS_FLOOD = "status flood"
SETUP_WAIT_S = 30.0  # how long a fresh jail may take to reach its wait for requests (a loaded machine)


def pid_of_pidfd(fd: int) -> int | None:
    """The pid, in our own pid namespace, of the process a pidfd refers to (its fdinfo is written for the reader's
    /proc); closes the pidfd. None if the process is gone (-1) or the kernel has no such line."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            pid = next((int(line.split()[1]) for line in f if line.startswith("Pid:")), None)
    except (OSError, ValueError):
        pid = None
    finally:
        os.close(fd)
    return pid if pid and pid > 0 else None


class SessionProcess(ProcessWatch, JailSweep, ParkedFreeze):
    """The host's handle on one session process, created from the zygote's hello on the session's socket.

    Args:
        sock (`socket.socket`): The session's socket to the zygote (closing it ends the session).
        pid (`int`): The process's pid as the zygote sees it (inside the sandbox's pid namespace).
        host_pid (`int`): The same process as this process sees it (from the hello's SCM_CREDENTIALS).
        fds (`list[int]`): The request pipe's write end, the status pipe's read end and the output memfd.
    """

    __slots__ = (
        "sock",
        "pid",
        "host_pid",
        "pidfd",
        "request_w",
        "status_r",
        "output",
        "proc_fds",
        "socket_buffer",
        "status_buffer",
        "status_frames",
        "status_bytes",
        "frozen",
        "park_lock",
        "park_ticket",
        "long_parked",
        "parked_at",
        "pending",
        "status",
        "zygote_gone",
        "parked_cpu",
        "idle_point",
        "cgroups",
        "cpu_start",
        "setup_problem",
        "watch_uid",
        "__weakref__",
    )

    def __init__(self, sock: socket.socket, pid: int, host_pid: int, fds: list[int]):
        self.sock, self.pid, self.host_pid = sock, pid, host_pid
        self.request_w, self.status_r, self.output = fds
        os.set_blocking(self.request_w, False)
        os.set_blocking(self.status_r, False)
        try:
            self.pidfd: int | None = os.pidfd_open(host_pid)  # signals through it cannot hit a recycled pid
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # without it no signal would reach the process
                raise
            self.pidfd = None
        self.proc_fds: dict[str, int] = {}  # /proc files kept open: a pread is 5x cheaper than an open
        self.socket_buffer, self.status_buffer = bytearray(), bytearray()
        self.pending = b""  # the part of a large request the pipe did not take yet
        self.status: dict | None = None  # the last status frame of the call in flight
        self.status_frames = self.status_bytes = 0  # how many came in this call (see _STATUS_FLOOD_FRAMES)
        self.zygote_gone = False  # the socket closed from the zygote's side: no account of a death will come
        self.idle_point: tuple[int, int] | None = None  # (sp, pc) where the interpreter's own loop reads fd 3
        self.cgroups: dict[str, str] = {}  # the jail's own cgroup directories, by kind (see cgroups.py)
        self.cpu_start: float | None = None  # the jail's CPU seconds (all its processes) when the call began
        self.frozen = False  # parked in its frozen cgroup (see `freeze_parked`): thawed for the next call
        # A call, kill or close moves the ticket on, cancelling a freeze still waiting (parking.py), under the lock.
        self.park_lock, self.park_ticket = threading.Lock(), 0
        self.long_parked = True  # its call came long after the last one (see `settle`), or it is its first
        self.parked_at = self.parked_cpu = None  # when it was parked, and its own CPU seconds then (see `begin`)
        self.setup_problem: str | None = None  # why `begin` said "not set up", where it knows
        self.watch_uid: int | None = None  # its own uid, where only that uid may read its syscall (fsuid.py)

    @classmethod
    def from_hello(cls, sock: socket.socket, timeout_s: float = 10.0) -> SessionProcess:
        """Reads the zygote's hello (sent before its reply to the spawn request, so already here)."""
        sock.settimeout(timeout_s)
        space = socket.CMSG_SPACE(CREDS.size) + socket.CMSG_SPACE(4 * (_HELLO_FDS + 1))
        data, ancdata, flags, _ = sock.recvmsg(1 << 12, space, socket.MSG_CMSG_CLOEXEC)
        fds, host_pid = [], None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += struct.unpack(f"{len(payload) // 4}i", payload[: len(payload) - len(payload) % 4])
            elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= CREDS.size:
                host_pid = CREDS.unpack(payload[: CREDS.size])[0]
        buffer = bytearray(data)
        hello = take_frames(buffer, 1 << 12)
        if hello and hello[0].get("pidfd") and len(fds) == _HELLO_FDS + 1:
            host_pid = pid_of_pidfd(fds.pop())  # a zygote in a pid namespace it cannot name pids of (see worker.py)
        if (
            len(fds) != _HELLO_FDS
            or not hello
            or not hello[0].get("hello")
            or host_pid is None
            and hello[0].get("creds")
        ):
            for fd in fds:
                os.close(fd)
            if flags & socket.MSG_CTRUNC:  # the kernel had no descriptor slot for the channels it carried
                raise OSError(errno.EMFILE, "Too many open files (the session's channels could not be received)")
            raise ConnectionError("the sandbox zygote sent an invalid hello")
        if host_pid is None:  # the zygote shares our pid namespace
            host_pid = int(hello[0]["pid"])
        sock.setblocking(False)
        try:
            proc = cls(sock, int(hello[0]["pid"]), int(host_pid), fds)
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        proc.socket_buffer = buffer
        cgroups = hello[0].get("cgroups")
        proc.cgroups = {str(k): str(v) for k, v in cgroups.items()} if isinstance(cgroups, dict) else {}
        proc.watch_uid = int(hello[0]["uid"]) if hello[0].get("uid") and fsuid.needed() else None
        return proc

    # --------------------------------------------------------------------------------------------------- calls

    @property
    def closed(self) -> bool:
        return self.request_w is None

    def begin(self, request: dict, setup_wait_s: float) -> str | None:
        """Sends a request and lets the process run. Returns None, or why it could not: "gone" (it died, or its
        request pipe has no reader), "not set up" (a fresh jail that did not reach its wait for requests within
        `setup_wait_s`) or "ran while parked" (it computed since its last call ended: see `ran_while_parked`)."""
        if self.closed:
            return "gone"
        self._cancel_freeze()
        self.setup_problem = None
        try:  # the files a call is watched through, opened now: a call must not wait on one it cannot open
            for name in ("syscall", "stat"):
                self._proc_fd(name)
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self.setup_problem = f"the trainer is out of descriptors ({exc.strerror}): raise its open-file limit"
                return "not set up"
        if not self.learn_idle_point(timeout_s=setup_wait_s):
            return "gone" if self.exited(grace_s=0.0) else "not set up"
        if self.ran_while_parked():
            return "ran while parked"
        self.status, self.status_buffer = None, bytearray()
        self.status_frames = self.status_bytes = 0
        self._drain_status()  # nothing a cell's late writer left there may count for this call
        try:  # the last call's output must not show in this one's, even if the process dies before it starts
            os.ftruncate(self.output, 0)
        except OSError:
            pass
        self.pending = frame(request)
        self.cpu_start = self.cpu_seconds()
        if not self.flush():
            return "gone"
        self.long_parked = self.parked_at is None or time.monotonic() - self.parked_at > FREEZE_AFTER_S
        self._thaw()
        self.signal(signal.SIGCONT)  # after the write: it resumes with its request already there
        return None

    def flush(self) -> bool:
        """Writes what the request pipe takes of the pending request; False when the process is gone."""
        if self.closed:
            return False
        try:
            written = os.write(self.request_w, self.pending) if self.pending else 0
        except BlockingIOError:
            written = 0
        except OSError:
            self.pending = b""
            return False
        self.pending = self.pending[written:]
        return True

    def read_status(self) -> bool:
        """Reads the status pipe; keeps the last complete frame as the call's status. False at EOF (a death)."""
        if self.closed:  # closed from another thread while a call ran: nothing more will come
            return False
        try:
            data = os.read(self.status_r, 1 << 16)
        except BlockingIOError:
            return True
        if not data:
            return False
        if (self.status or {}).get("fatal") == STATUS_FLOOD:
            return True  # already over: nothing more of it is parsed
        self.status_buffer += data
        self.status_bytes += len(data)
        # Counted before any is parsed (frames already taken left the buffer): a flood costs one cheap walk.
        self.status_frames += _count_frames(self.status_buffer, _STATUS_FLOOD_FRAMES + 1)
        if self.status_frames > _STATUS_FLOOD_FRAMES or self.status_bytes > _STATUS_FLOOD_BYTES:
            self.status_buffer.clear()
            error = "SystemError: the cell flooded the sandbox's status channel (fd 4)\n"
            self.status = {"ok": False, "error": error, "fatal": STATUS_FLOOD}
            return True
        try:
            frames = take_frames(self.status_buffer, _MAX_STATUS)
        except (ValueError, RecursionError):  # garbage (or JSON nested past the parser's depth): the call still
            # ends only when the process parks or dies, and fails
            self.status_buffer.clear()
            error = "SystemError: the interpreter sent an invalid status\n"
            frames = [{"ok": False, "error": error, "fatal": "invalid status"}]
        if frames and (self.status or {}).get("fatal") != "invalid status":
            self.status = frames[-1] if isinstance(frames[-1], dict) else {"fatal": "invalid status"}
        return True

    def _drain_status(self) -> None:
        try:
            while os.read(self.status_r, 1 << 16):
                pass
        except OSError:
            pass

    def settle(self, output_limit: int) -> dict:
        """Ends a call whose process is parked: stops it until the next call, kills what its cell left running,
        and returns the reply (the status, and the bounded head and tail of its output)."""
        self.signal(signal.SIGSTOP)  # between calls nothing of the session runs (timers, signal handlers)
        quiet = self.quiet()
        if quiet is None:  # no cgroup of its own to list: the processes are found through /proc
            self._kill_descendants()
        status = self.status if isinstance(self.status, dict) else {}
        skipped = status.get("skipped", 0)
        reply = dict(
            self.read_output(skipped if isinstance(skipped, int) else 0, output_limit),
            ok=status.get("ok") is True,
            error=str(status.get("error") or ""),
            fatal=status.get("fatal") and str(status["fatal"]),
        )
        # Stopped is not enough between calls: a signal the cell arranged (a POSIX timer's SIGCONT) resumes a stopped
        # process, not a frozen one. Frozen now, unless its calls come back to back: then a moment later, unless its
        # next call comes first (parking.py). A first call is taken to be followed by a generation turn.
        self.parked_cpu, self.parked_at = self.sched_state()[1], time.monotonic()
        with self.park_lock:
            self.park_ticket += 1
            ticket = self.park_ticket
        if self.long_parked:
            self.freeze_parked(ticket)
        else:
            freeze_later(self, ticket)
        if quiet is False:
            reply.update(ok=False, fatal="leftover processes")
            reply["error"] += "SystemError: processes the cell started could not be stopped\n"
        if _kept_files[0] > resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8:
            self.release_files()
        return reply

    # ------------------------------------------------------------------------------------------ output, deaths

    def read_output(self, skipped: int = 0, limit: int = 1 << 16) -> dict:
        """The bounded head and tail of what the cell wrote (decoded with replacement: always valid text)."""
        if self.closed:
            return {"head": "", "tail": "", "total": 0}
        size = os.fstat(self.output).st_size
        skipped = min(max(0, skipped), 1 << 40)
        if size <= 2 * limit:
            text = os.pread(self.output, size, 0).decode("utf-8", "replace")
            return {"head": text, "tail": text, "total": len(text) + skipped}
        head = os.pread(self.output, limit, 0).decode("utf-8", "replace")
        tail = os.pread(self.output, limit, size - limit).decode("utf-8", "replace")
        return {"head": head, "tail": tail, "total": len(head) + len(tail) + size - 2 * limit + skipped}

    def death_notice(self) -> dict | None:
        """The zygote's account of this process's death (`{"exit": n}` or `{"signal": n, ...}`), if it came."""
        try:
            while data := self.sock.recv(1 << 12):
                self.socket_buffer += data
            self.zygote_gone = True
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.zygote_gone = True
        try:
            frames = take_frames(self.socket_buffer, 1 << 16)
        except (ValueError, RecursionError):
            return None
        crash = next((f["crash"] for f in frames if isinstance(f, dict) and isinstance(f.get("crash"), dict)), None)
        return crash

    def hard_kill(self) -> None:
        """SIGKILL now, without a round trip through the zygote (which reaps it and sweeps what is left). A frozen
        jail is thawed after the kill: a frozen process dies only once thawed, and nothing of it runs in between."""
        self._cancel_freeze()
        self.signal(signal.SIGKILL)
        self._thaw()

    def close(self) -> None:
        """Ends the session: the zygote sees its socket close and retires the jail (and thaws it, frozen or not, to
        let it die). Never a kill from here: a forked copy of the trainer closes its copies too. Idempotent."""
        self._cancel_freeze()  # a freeze after the zygote's thaw would keep the jail alive
        try:
            self.sock.close()
        except OSError:
            pass
        with _FDS_LOCK:
            fds = [self.request_w, self.status_r, self.output, self.pidfd, *self.proc_fds.values()]
            _kept_files[0] -= len(self.proc_fds)
            self.request_w = self.status_r = self.output = self.pidfd = None
            self.proc_fds = {}
        for fd in fds:
            if fd is not None:
                os.close(fd)


def _count_frames(buffer: bytearray, limit: int) -> int:
    """How many complete frames the buffer starts with, counting no further than `limit`."""
    count, at = 0, 0
    while count < limit and len(buffer) - at >= 4:
        at += 4 + struct.unpack_from("!I", buffer, at)[0]
        if at > len(buffer):
            break
        count += 1
    return count
