"""Where a finished call's leftovers are killed: the host's sweep that makes a parked session process the only
process of its jail before the call is settled (`SessionProcess.settle` calls it; `LocalSandbox._kill` and the
zygote's `kill` end a whole jail instead).

With the jail's own cgroups (root, cgroup v1 freezer or v2): the kernel's list of the jail's processes decides, and
while it holds anything but the parked interpreter the whole cgroup is frozen, everything else killed, and the list
read again. Without them: the process tree under the session process, from /proc, pass after pass.
"""

from __future__ import annotations

import errno
import os
import signal
import time

from .cgroup_control import freezer_control

_KILL_PASSES = 50
# How long a sweep waits for its jail to read FROZEN before killing anyway: a process inside a long system call (a
# big write, freeing a big file) freezes only once that call returns, and a batch loop waiting for it (1 s, it was)
# holds up every other session's result. A kill needs no completed freeze; what a half-frozen jail forks meanwhile
# is found when the jail's list is read again.
FREEZE_WAIT_S = 0.02


class JailSweep:
    """Mixed into `SessionProcess` (which provides `host_pid`, `cgroups` and `_proc_fd`)."""

    __slots__ = ()

    def _cgroup_fd(self, name: str) -> int:
        directory = self.cgroups.get("freezer") or self.cgroups.get("v2")
        if name.startswith("cpu"):
            directory = self.cgroups.get("cpuacct") or self.cgroups.get("v2")
        if directory is None:
            raise OSError(errno.ENOENT, f"no cgroup for {name}")
        return self._proc_fd(os.path.join(directory, name))

    def members(self) -> set[int] | None:
        """The processes of the jail (its own cgroup's `cgroup.procs`), or None where it has no such cgroup.

        Opened afresh each time: cgroup v1 keeps the list it built for an open file, however the cgroup changes."""
        directory = self.cgroups.get("freezer") or self.cgroups.get("v2")
        if directory is None:
            return None
        if "pids" in self.cgroups:  # its live task count (zombies included): 1 is the parked interpreter alone
            try:
                if int(os.pread(self._proc_fd(os.path.join(self.cgroups["pids"], "pids.current")), 64, 0)) == 1:
                    return {self.host_pid}
            except (OSError, ValueError):
                pass
        try:
            with open(os.path.join(directory, "cgroup.procs"), "rb") as f:
                return {int(p) for p in f.read().split()}
        except (OSError, ValueError):
            return None

    def others_runnable(self) -> bool:
        """Whether a process of the jail other than the session process is running or waiting for a CPU (state R),
        from the jail's own cgroup: a cell's children that compute while the cell waits for them want CPUs too."""
        for pid in (self.members() or set()) - {self.host_pid}:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    if stat_fields(f.read())[0] == b"R":
                        return True
            except (OSError, IndexError):
                continue
        return False

    def _freeze(self, frozen: bool, timeout_s: float = 1.0) -> bool:
        """Freezes (or thaws) every process of the jail at once; True once the kernel says it is done."""
        v1 = "freezer" in self.cgroups
        name, want = ("freezer.state", b"FROZEN" if frozen else b"THAWED") if v1 else ("cgroup.freeze", None)
        try:
            os.pwrite(self._cgroup_fd(name), want or (b"1" if frozen else b"0"), 0)
            if not frozen:
                return True
            deadline = time.monotonic() + timeout_s
            while True:
                if v1:
                    done = os.pread(self._cgroup_fd(name), 64, 0).strip() == want
                else:
                    done = b"frozen 1" in os.pread(self._cgroup_fd("cgroup.events"), 256, 0)
                if done or time.monotonic() > deadline:
                    return done
                time.sleep(0.0002)
        except OSError:
            return False

    def park_frozen(self, frozen: bool, keep: bool = True) -> bool:
        """Freezes a parked session's whole jail until its next call (or thaws it for that call), without waiting:
        a stopped process can be resumed by a signal (a cell's POSIX timer sending SIGCONT), a frozen one cannot.
        False where the jail has no freezer (SIGSTOP alone parks it there). `keep=False`: the control file is
        opened for this write only."""
        control = freezer_control(self.cgroups)
        if control is None:
            return False
        try:
            if keep or control[0] in self.proc_fds:
                os.pwrite(self._proc_fd(control[0]), control[1] if frozen else control[2], 0)
            else:
                fd = os.open(control[0], os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(fd, control[1] if frozen else control[2])
                finally:
                    os.close(fd)
        except OSError:
            return False
        return True

    def quiet(self, timeout_s: float = 2.0) -> bool | None:
        """Makes the parked process the only one left in its jail: while anything else is in the jail's cgroup,
        freezes the whole cgroup (nothing in it can fork, exit or hop any more), kills every other process, thaws,
        and looks again, until it holds just the parked interpreter. No sweep that "found nothing this time" ends
        it: only the kernel's list of the jail's processes does. Returns True when quiet, False if that did not
        happen within `timeout_s`, None where the jail has no cgroup to list (the caller sweeps /proc instead)."""
        members = self.members()
        if members is None:
            return None
        deadline = time.monotonic() + timeout_s
        while members - {self.host_pid}:
            if time.monotonic() > deadline:
                return False
            self._freeze(True, FREEZE_WAIT_S)
            try:
                self._kill_members()
            finally:
                self._freeze(False)
            for _ in range(100):  # killed processes leave the cgroup once they have run their exit
                members = self.members() or set()
                if not members - {self.host_pid}:
                    break
                time.sleep(0.0002)
        return True

    def _kill_members(self) -> None:
        """SIGKILLs every process of the (frozen) jail but its pid 1, each through a pidfd taken while the pid was
        listed in the jail's cgroup and checked to still be there after: a recycled pid is never hit."""
        pidfds = {}
        for pid in (self.members() or set()) - {self.host_pid}:
            try:
                pidfds[pid] = os.pidfd_open(pid)
            except OSError:
                continue
        try:
            still = self.members() or set()
            for pid, pidfd in pidfds.items():
                if pid in still:
                    try:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    except OSError:
                        pass
        finally:
            for pidfd in pidfds.values():
                os.close(pidfd)

    def _kill_descendants(self) -> None:
        """SIGKILLs whatever the stopped process still has below it: the processes its cell left, found through the
        children of *every* thread of each (a child forked by a second thread is listed there only).

        Each one is signalled through a pidfd opened *before* checking that its parent belongs to the jail, so a pid
        that a running descendant reaped and the system gave to another process is never hit. Passes repeat until
        one finds nothing: a process forked just before its parent was killed is handed to the session process."""
        for _ in range(_KILL_PASSES):
            try:  # the process itself is parked single-threaded: its main thread's list is all of them
                todo = [int(p) for p in os.pread(self._proc_fd("children"), 1 << 16, 0).split()]
            except (OSError, ValueError):
                return
            members, killed = {self.host_pid}, 0
            while todo:
                pid = todo.pop()
                if pid in members:
                    continue
                try:
                    pidfd = os.pidfd_open(pid)
                except OSError:
                    continue  # already gone
                try:
                    with open(f"/proc/{pid}/stat", "rb") as f:
                        parent = int(stat_fields(f.read())[1])
                    if parent in members:
                        members.add(pid)
                        todo += _children_of(pid)
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                        killed += 1
                except (OSError, ValueError, IndexError):
                    pass
                finally:
                    os.close(pidfd)
            if not killed:
                return


def stat_fields(stat: bytes) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (which may itself hold spaces and parentheses)."""
    return stat.rsplit(b")", 1)[1].split()


def _children_of(pid: int) -> list[int]:
    """The children of every thread of a process, from /proc."""
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        pass
    return found
