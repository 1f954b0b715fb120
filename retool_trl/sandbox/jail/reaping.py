"""The zygote's side of its jails: its handle on each (`Jail`), their cgroups and limits, the control socket's reader,
how a jail died (and the SIGCHLD that says so), and the quiet cleanup after it. Standard library only (the zygote
imports it as a sibling script module, inside the sandbox's bubblewrap)."""

import ctypes
import json
import os
import platform
import signal
import socket
import struct
import sys
import time

from freezer import set_frozen  # sibling script modules, as in worker.py (stdlib only)
from jail_setup import libc, write_file
from wire import HEADER


def send_hello(host, jail, frame):
    """Hands a jail to the host: its channels, and its pid as the host sees it.

    SCM_CREDENTIALS are translated between pid namespaces (naming another process's pid needs CAP_SYS_ADMIN, which
    root has). Without it, the pids we see may not be the host's (bubblewrap's pid namespace, entered through a user
    namespace by a normal user): a pidfd then names the process itself, and the host reads the pid it knows the
    process by from the pidfd's fdinfo."""
    fds = [jail.request_w, jail.status_r, jail.output]
    hello = {"hello": True, "pid": jail.pid, "creds": True, "cgroups": jail.cgroup_kinds, "uid": jail.uid}
    try:
        creds = (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("3i", jail.pid, os.getuid(), os.getgid()))
        rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("3i", *fds))
        host.sendmsg([frame(hello)], [creds, rights])
        return
    except PermissionError:
        pass
    pidfd = os.pidfd_open(jail.pid)
    try:
        hello.update(creds=False, pidfd=True)
        host.sendmsg([frame(hello)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("4i", *fds, pidfd))])
    finally:
        os.close(pidfd)


def death_cause(status, cgroups, own_limit=None) -> dict:
    """What killed a session process, from its wait status: `{"exit": code}` or `{"signal": n, "oom": bool}`.

    `oom` says whether the session's own memory bound killed it; `own_limit` (from `own_limit_reached`, read before
    the process was reaped) names a hard limit the process had lowered itself ("CPU time"), which the kernel
    enforces by SIGKILL. Any other SIGKILL came from outside the jail (nothing inside can kill its pid 1): the
    machine's or the whole sandbox's OOM killer, or an operator, which the host reports as infrastructure.
    """
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        cause = {"signal": sig, "oom": sig == signal.SIGKILL and oom_killed(cgroups)}
        if sig == signal.SIGKILL and own_limit:
            cause["own_limit"] = own_limit
        return cause
    return {"exit": os.WEXITSTATUS(status)}


# The hard limits whose overrun the kernel punishes with SIGKILL, and which the sandbox leaves unlimited.
_KILLING_LIMITS = {"Max cpu time": "CPU time", "Max realtime timeout": "real-time CPU"}


def own_limit_reached(pid):
    """The name of a hard limit that a dead, not yet reaped process had set itself ("CPU time"), else None.

    The sandbox leaves these limits unlimited, so a finite one is the process's own doing (`setrlimit`, or `prlimit`
    from a process of its jail), and the kernel's SIGKILL at it is the cell's failure, not the sandbox's. Read from
    the zombie's /proc/PID/limits, which the kernel keeps until it is reaped. (Its CPU time is not: a zombie's
    /proc/PID/stat reads 0, and a hard limit of 0 kills at the first tick.)"""
    try:
        with open(f"/proc/{pid}/limits") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        for prefix, name in _KILLING_LIMITS.items():
            fields = line[len(prefix) :].split()
            if line.startswith(prefix) and len(fields) >= 2 and fields[1] != "unlimited":
                return name
    return None


def oom_killed(cgroups) -> bool:
    """Whether the OOM killer acted in one of these memory cgroups *because of that cgroup's own limit*.

    The kernel bumps the victim's `oom_kill` counter for any OOM kill, the machine's and a parent cgroup's too; only
    a session that also hit its own limit (v1 `memory.failcnt`, v2 the `oom` count of `memory.events`) was killed by
    it. A charge refused by a parent's limit counts against the parent's `failcnt`, not the session's."""
    for path in cgroups:
        try:
            with open(os.path.join(path, "memory.events")) as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
            if int(counts.get("oom_kill", 0)) and int(counts.get("oom", 0)):
                return True
            continue
        except OSError:
            pass
        try:
            with open(os.path.join(path, "memory.oom_control")) as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
            with open(os.path.join(path, "memory.failcnt")) as f:
                failed = int(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if int(counts.get("oom_kill", 0)) and failed:
            return True
    return False


_SA_NOCLDSTOP = 1


class _Sigaction(ctypes.Structure):
    """glibc's `struct sigaction` where `sa_flags` follows the handler and the 1024-bit mask (x86-64, aarch64)."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong)))),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


def no_sigchld_on_stop() -> bool:
    """Adds SA_NOCLDSTOP to the SIGCHLD handler Python installed (the signal module has no way to ask for it).

    The host stops and resumes a session around every call; without the flag each of the two wakes the zygote for
    nothing (a SIGCHLD, its wakeup byte, a `waitpid` that finds no death), on a CPU the call itself needs. Deaths
    are still reported. Returns False, changing nothing, where the struct's layout is not the one above."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return False
    action = _Sigaction()
    if libc.sigaction(signal.SIGCHLD, None, ctypes.byref(action)) != 0 or not action.handler:
        return False
    action.flags |= _SA_NOCLDSTOP
    return libc.sigaction(signal.SIGCHLD, ctypes.byref(action), None) == 0


SPARE_WEIGHT, FULL_WEIGHT = 102, 1024  # cgroup v1 cpu.shares of a spare setting up, and of a session


def new_jail_cgroups(config, name, warm, made):
    """The jail's own cgroups, by kind (co-mounted controllers share a directory), with its limits written, into
    `made` (the caller's, so that it can remove what was made when a later step fails). A spare started ahead
    of demand sets up at a tenth of a session's CPU weight (in a cgroup of its own, `nice` would weigh nothing
    against the running cells); the zygote's `spawn` gives it the full weight."""
    period_us = 100_000
    for kind, root in config["cgroups"]:
        path = os.path.join(root, name)
        if path not in made.values():
            os.mkdir(path)
        made[kind] = path
        limits = {
            # The session's own OOM killer on: a v1 cgroup inherits `oom_kill_disable` from its parent, which
            # the sandbox's (see reaping.MemoryWatch) has set.
            "memory1": {"memory.limit_in_bytes": config["memory_mb"] << 20, "memory.oom_control": 0},
            "pids": {"pids.max": config["max_processes"]},
            # One CPU at most, however many processes: a cell's children cannot take its neighbours' CPUs.
            "cpu": {
                "cpu.cfs_period_us": period_us,
                "cpu.cfs_quota_us": period_us,
                "cpu.shares": SPARE_WEIGHT if warm else FULL_WEIGHT,
            },
            "v2": {
                "memory.max": config["memory_mb"] << 20,
                "memory.swap.max": 0,
                "pids.max": config["max_processes"],
                "cpu.max": f"{period_us} {period_us}",
                "cpu.weight": 10 if warm else 100,
            },
        }.get(kind, {})
        for key, value in limits.items():
            if os.path.exists(os.path.join(path, key)):
                try:
                    write_file(os.path.join(path, key), str(value))
                except OSError:
                    if not key.startswith("cpu"):
                        raise
                    # A parent quota under one CPU (a container's) refuses a larger one: the share still holds.
    return made


def weigh(jail, nice, shares, weight):
    """Sets a jail's CPU weight: its niceness, and its cgroup's share (in a cgroup of its own, `nice` alone would
    weigh nothing against the running cells)."""
    try:
        os.setpriority(os.PRIO_PROCESS, jail.pid, nice)
    except OSError:
        pass
    for kind, name, value in (("cpu", "cpu.shares", shares), ("v2", "cpu.weight", weight)):
        path = jail.cgroup_kinds.get(kind)
        if path and os.path.exists(os.path.join(path, name)):
            try:
                write_file(os.path.join(path, name), str(value))
            except OSError:
                pass


def rmdir_quietly(path) -> bool:
    """Removes an empty directory (a cgroup); False while it is still busy."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


class Jail:
    """The zygote's handle on one session process: its channels (until handed to the host) and its cgroups."""

    def __init__(self, pid, request_w, status_r, output, ready_r, cgroups, scratch):
        self.pid, self.request_w, self.status_r, self.output = pid, request_w, status_r, output
        self.ready_r = ready_r  # EOF (after a byte) once the jail is set up, before any cell
        self.cgroup_kinds, self.scratch = cgroups, scratch  # {kind: directory}; scratch: removed once it died
        self.watched_scratch = None  # its scratch as the zygote sees it, where the watchdog bounds the tree
        self.uid = 0  # the session's own uid (0: none of its own)
        self.cgroups = list(dict.fromkeys(cgroups.values()))
        self.host = None  # the session's socket to the host, once handed out
        self.set_up = False
        self.closed = False
        self.evicted = False  # killed by `MemoryWatch`: it held the most of the sandbox's full memory

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


class MemoryWatch:
    """Keeps the sandbox-wide memory bound (cgroup v1) instead of the kernel's OOM killer, which would pick a victim by
    its processes' resident memory: files a session parks in its private `/tmp` or `/dev/shm` (a tmpfs) are charged
    to its cgroup but to no process, so the kernel would kill an innocent neighbour while the session holding the
    memory lives. The zygote kills the jail whose cgroup holds the most (files included), and that session's call
    (or next call) reports it as its own memory failure, in two cases, each signalled by the kernel on an eventfd:
    the sessions' memory that cannot be reclaimed (resident and tmpfs pages, not the page cache) passes a threshold
    a little below the bound (so that a neighbour's own file writes and forks still find memory), or a task waits for
    memory at the bound itself, where the OOM killer of the sandbox's own cgroup is off (`oom_kill_disable`).

    A session's own bound is its own cgroup's, whose OOM killer stays on (see `_new_cgroups`)."""

    RECHECK_S = 0.05  # still full after a victim was reaped: the next one (the kernel signals once per wait)
    WATCH_S = 0.1  # how often the sandbox's memory is looked at while its usage is past the threshold

    def __init__(self, cgroups):
        self.fd = self.oom_fd = self.usage_fd = None
        self.doomed = set()  # pids killed for memory, not yet reaped
        self.recheck_at = None
        self.threshold = 1 << 62
        self.root = next((path for kind, path in cgroups if kind == "memory1"), None)
        if self.root is None:
            return
        oom_control = os.path.join(self.root, "memory.oom_control")
        try:
            self.oom_fd = os.open(oom_control, os.O_RDONLY | os.O_CLOEXEC)
            self.usage_fd = os.open(os.path.join(self.root, "memory.usage_in_bytes"), os.O_RDONLY | os.O_CLOEXEC)
            self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
            with open(os.path.join(self.root, "memory.limit_in_bytes")) as f:
                limit = int(f.read())
            events = [f"{self.fd} {self.oom_fd}"]
            if limit < 1 << 50:
                self.threshold = limit - max(64 << 20, limit // 10)
                events.append(f"{self.fd} {self.usage_fd} {self.threshold}")
            for event in events:
                with open(os.path.join(self.root, "cgroup.event_control"), "w") as f:
                    f.write(event)
            with open(oom_control, "w") as f:
                f.write("1")
        except (OSError, ValueError):  # the kernel's OOM killer stays in charge
            self.close()

    def close(self):
        for fd in (self.fd, self.oom_fd, self.usage_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.oom_fd = self.usage_fd = None

    def held(self):
        """Bytes of the sandbox's memory that reclaim cannot free: resident pages and tmpfs files (`memory.stat`)."""
        try:
            with open(os.path.join(self.root, "memory.stat")) as f:
                stat = dict(line.split() for line in f if len(line.split()) == 2)
            return int(stat.get("total_rss", 0)) + int(stat.get("total_shmem", 0))
        except (OSError, ValueError):
            return 0

    def full(self):
        """Whether a task of the sandbox is waiting for memory."""
        try:
            text = os.pread(self.oom_fd, 256, 0).decode()
        except OSError:
            return False
        return "under_oom 1" in text

    def relieve(self, jails):
        """Kills the jail holding the most memory while the sandbox is full or past its threshold (one at a time:
        its memory is freed when it dies, and another kill may then not be needed)."""
        try:
            os.read(self.fd, 8)
        except OSError:
            pass
        self.doomed &= set(jails)
        self.recheck_at = None
        if not self.full() and self.held() <= self.threshold:
            try:  # past the threshold in all but page cache: watched until it is below (no crossing would tell)
                if int(os.pread(self.usage_fd, 64, 0)) > self.threshold:
                    self.recheck_at = time.monotonic() + self.WATCH_S
            except (OSError, ValueError):
                pass
            return
        self.recheck_at = time.monotonic() + self.RECHECK_S
        if self.doomed:  # thawed again: a freeze landing after the kill (the host parks sessions) would keep it
            for pid in self.doomed:
                set_frozen(jails[pid].cgroup_kinds, False)
            return
        held = []
        for pid, jail in jails.items():
            path = jail.cgroup_kinds.get("memory1")
            try:
                with open(os.path.join(path, "memory.usage_in_bytes")) as f:
                    held.append((int(f.read()), pid))
            except (OSError, TypeError, ValueError):
                continue
        if not held:
            return
        pid = max(held)[1]
        jails[pid].evicted = True
        self.doomed.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)  # pid 1 of its namespace: the jail goes, and its tmpfs with it
        except OSError:
            pass
        # The host parks sessions frozen between calls, and the session holding the most is often a parked one: a
        # frozen process dies only once thawed, and until then the task waiting for memory waits on.
        set_frozen(jails[pid].cgroup_kinds, False)


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
