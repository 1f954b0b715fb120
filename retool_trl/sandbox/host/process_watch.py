"""How the host watches one session process from outside, through files a cell cannot write: whether it is parked at
the interpreter's own wait for requests (`/proc/PID/syscall`, read with the session's uid where only that uid may:
`fsuid.py`), its scheduler state and CPU seconds (`/proc/PID/stat`, the jail's cgroup), whether it exited (its pidfd),
and signals sent through the pidfd. Runs in the trainer; `channel.py` carries the calls themselves.
"""

from __future__ import annotations

import errno
import fcntl
import os
import platform
import select
import signal
import struct
import termios
import threading
import time

from ..isolation import fsuid
from .sweep import stat_fields

REQUEST_FD = 3  # the session process's request pipe (see session_process.py, which the trainer never imports)
_SYS_READ = {"x86_64": b"0", "aarch64": b"63"}.get(platform.machine())
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_IDLE_SP_SLACK = _IDLE_PC_SLACK = 256  # bytes: see `_at_idle_point`
_FDS_LOCK = threading.Lock()  # opening a session's /proc and cgroup files, against closing them (see _proc_fd)
_kept_files = [0]  # /proc and cgroup files kept open by all sessions (see `release_files`); a close estimate


class ProcessWatch:
    """The watching half of a `SessionProcess` (its `host_pid`, `pidfd`, `request_w`, `idle_point`, `proc_fds`,
    `cgroups` and `watch_uid`): what the process is doing, told by the kernel rather than by the process."""

    __slots__ = ()

    def parked(self) -> bool:
        """True when the process is single-threaded, blocked reading its request pipe, and that pipe is empty, at
        the very place where the interpreter's own loop reads it (the stack and instruction pointers recorded before
        any cell ran): the cell is over, whatever it wrote before, and nothing of it can still run. A cell (or a
        signal handler) that reads fd 3 itself does so deeper on the stack, and is not parked."""
        if self.idle_point is None:
            return False
        try:
            threads = int(stat_fields(os.pread(self._proc_fd("stat"), 1024, 0))[17])
            unread = struct.unpack("i", fcntl.ioctl(self.request_w, termios.FIONREAD, b"\0\0\0\0"))[0]
        except (OSError, IndexError, ValueError, TypeError):
            return False
        point = self._waiting_point()
        return threads == 1 and unread == 0 and not self.pending and point is not None and self._at_idle_point(point)

    def _at_idle_point(self, point: tuple[int, int]) -> bool:
        """The interpreter's own wait: its stack pointer moves by a few dozen bytes as CPython specialises the loop's
        calls, and libc's `read` enters the kernel from a second place once the process has had a thread; a read
        made by a cell (inside `exec`, 500+ bytes deeper) or by a signal handler (1,000+) is deeper."""
        idle_sp, idle_pc = self.idle_point
        sp, pc = point
        return abs(pc - idle_pc) < _IDLE_PC_SLACK and sp > idle_sp - _IDLE_SP_SLACK

    def _waiting_point(self) -> tuple[int, int] | None:
        """(stack pointer, instruction pointer) of a `read` of fd 3 the process is blocked in, else None."""
        try:
            fields = fsuid.pread_as(self.watch_uid, self._proc_fd("syscall"), 256).split()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # not a jail still setting up: waiting would not help
                self.setup_problem = f"the trainer is out of descriptors ({exc.strerror}): raise its open-file limit"
            return None
        # "nr arg0 ... arg5 sp pc" while in a system call ("running" or "-1 sp pc" otherwise)
        if len(fields) == 9 and fields[0] == _SYS_READ and int(fields[1], 16) == REQUEST_FD:
            return int(fields[7], 16), int(fields[8], 16)
        return None

    def learn_idle_point(self, timeout_s: float) -> bool:
        """Records where the interpreter's loop waits for requests, before the first cell (nothing untrusted has run
        in the process yet). Waits for a jail still setting up; False if it does not get there (it died)."""
        deadline = time.monotonic() + timeout_s
        while self.idle_point is None:
            self.idle_point = self._waiting_point()
            if self.idle_point is None:
                if time.monotonic() > deadline or self.exited(grace_s=0.0):
                    return False
                time.sleep(0.0005)
        return True

    def ran_while_parked(self, slack_s: float = 0.05) -> bool:
        """Whether the process used CPU since it was parked (past a few clock ticks of slack). Where no freezer
        holds it (SIGSTOP alone), a cell that arranged a signal to resume it (a POSIX timer's SIGCONT, after
        rewriting its own interpreter's loop) computes between calls: its session then ends at its next call, as
        the cell's failure."""
        if self.parked_cpu is None:
            return False
        now = self.sched_state()[1]
        return now is not None and now - self.parked_cpu > slack_s

    def release_files(self) -> None:
        """Closes the /proc and cgroup files kept open between calls (a pread is 5x cheaper than an open). Sessions
        keep them while all sessions' kept files stay under an eighth of the open-file limit; past that a parked
        session keeps only its channels and pidfd (5 descriptors instead of 9), so that hundreds of live sessions
        fit a limit of 1,024, and its next call opens them again (about 30 microseconds)."""
        with self.park_lock, _FDS_LOCK:  # against a freeze writing to one, and a batch opening one (`_proc_fd`)
            fds, self.proc_fds = list(self.proc_fds.values()), {}
            _kept_files[0] -= len(fds)
        for fd in fds:
            os.close(fd)

    def cpu_seconds(self) -> float | None:
        """CPU seconds used so far by every process the jail ever had (cpuacct, or v2 `cpu.stat`), or None."""
        try:
            if "cpuacct" in self.cgroups:
                return int(os.pread(self._cgroup_fd("cpuacct.usage"), 64, 0)) / 1e9
            for line in os.pread(self._cgroup_fd("cpu.stat"), 1024, 0).splitlines():
                if line.startswith(b"usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
        return None

    def cpu_used(self) -> float | None:
        """CPU seconds the jail's processes used since the call began, all of them together, or None."""
        now = self.cpu_seconds()
        return None if now is None or self.cpu_start is None else now - self.cpu_start

    def sched_state(self) -> tuple[str | None, float | None]:
        """Scheduler state ("R" = running or runnable) and CPU seconds so far, from /proc/PID/stat."""
        try:
            fields = stat_fields(os.pread(self._proc_fd("stat"), 1024, 0))
            return fields[0].decode(), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        except (OSError, IndexError, ValueError):
            return None, None

    def load(self) -> tuple[str | None, float | None]:
        """The scheduler state of the session process and the CPU seconds of its whole jail (every process a cell
        started, from its cgroup; the process's own where it has none): a cell whose children compute is busy."""
        state, cpu = self.sched_state()
        jail = self.cpu_seconds()
        return state, cpu if jail is None else jail

    def _proc_fd(self, name: str) -> int:
        fd = self.proc_fds.get(name)
        if fd is not None:
            return fd
        # Opened under the lock `close` takes: another thread's batch measures this session's CPU while its own
        # thread may be closing it, and a file opened between `close` listing the descriptors and dropping them
        # would never be closed.
        with _FDS_LOCK:
            if self.closed:
                raise OSError(errno.EBADF, "the session process handle is closed")
            fd = self.proc_fds.get(name)
            if fd is None:
                path = f"task/{self.host_pid}/children" if name == "children" else name
                path = name if name.startswith("/") else f"/proc/{self.host_pid}/{path}"  # a cgroup file
                flags = os.O_RDWR if name.endswith(("freezer.state", "cgroup.freeze")) else os.O_RDONLY
                fd = self.proc_fds[name] = os.open(path, flags | os.O_CLOEXEC)
                _kept_files[0] += 1
        return fd

    def exited(self, grace_s: float = 0.05) -> bool:
        """Whether the process has exited, waiting up to `grace_s` for one that is on its way out (its descriptors
        close a moment before it becomes a zombie)."""
        if self.pidfd is None:
            return self.sched_state()[0] in (None, "Z", "X")
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)  # a pidfd is readable once its process has exited
        return bool(poller.poll(grace_s * 1000))

    def signal(self, sig: int) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except OSError:
                pass
