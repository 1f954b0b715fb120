"""The zygote's side of its jails: its handle on each (`Jail`), the control socket's reader, how a jail died, and the
quiet cleanup after it. Standard library only (the zygote imports it as a sibling script module, inside the
sandbox's bubblewrap)."""

import json
import os
import signal
import socket
import struct

HEADER = struct.Struct("!I")


def send_hello(host, jail, frame):
    """Hands a jail to the host: its channels, and its pid as the host sees it.

    SCM_CREDENTIALS are translated between pid namespaces (naming another process's pid needs CAP_SYS_ADMIN, which
    root has). Without it, the pids we see may not be the host's (bubblewrap's pid namespace, entered through a user
    namespace by a normal user): a pidfd then names the process itself, and the host reads the pid it knows the
    process by from the pidfd's fdinfo."""
    fds = [jail.request_w, jail.status_r, jail.output]
    hello = {"hello": True, "pid": jail.pid, "creds": True, "cgroups": jail.cgroup_kinds}
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


def death_cause(status, cgroups) -> dict:
    """What killed a session process, from its wait status: `{"exit": code}` or `{"signal": n, "oom": bool}`.

    `oom` says whether the session's own memory bound killed it. Any other SIGKILL came from outside the jail
    (nothing inside can kill its pid 1, and there is no hard CPU limit): the machine's or the whole sandbox's OOM
    killer, or an operator, which the host reports as infrastructure.
    """
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"signal": sig, "oom": sig == signal.SIGKILL and oom_killed(cgroups)}
    return {"exit": os.WEXITSTATUS(status)}


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
