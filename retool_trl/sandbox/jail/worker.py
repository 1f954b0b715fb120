"""The zygote of the local sandbox: forks one jailed session process per session, hands it to the host, reaps it.

Executed as a script (`python -I worker.py CONFIG_JSON CONTROL_FD`), never imported by the trainer, and stdlib-only.
It pre-imports the configured modules once, then forks jails ahead of demand (`session_process.py` is the jail's
side). A jail handed to a session goes to the host with its three channels (request pipe, status pipe, output
memfd) and its pid as the host sees it: from then on the host runs calls on it directly and decides when a call is
over (`channel.py`), without a hop through this process. The zygote keeps what a cell must not reach: it
reaps deaths (with WNOHANG only) and tells the host how each jail died, from its own wait status.
Frames on every socket: a 4-byte big-endian length, then UTF-8 JSON.
"""

import errno
import gc
import json
import os
import random
import secrets
import selectors
import signal
import socket
import sys
import time
import traceback

# The sibling modules of this folder (the jail side, stdlib-only): python -I puts no script directory on sys.path,
# and cells must not find these modules there either, so the directory is on it for these imports only.
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
from ending import RETIRE_WAIT_S, JailEnding  # noqa: E402
from jail_setup import CLONE_NEWPID, check, libc, probe_jail  # noqa: E402
from reach import SHARED_DESCRIPTORS, close_all_but, share_reach  # noqa: E402
from reaping import (  # noqa: E402
    FULL_WEIGHT,
    Jail,
    MemoryWatch,
    new_jail_cgroups,
    no_sigchld_on_stop,
    recv_control,
    rmdir_quietly,
    send_hello,
    weigh,
)
from session_process import session_main  # noqa: E402
from watchdog import INTERVAL_S, scratch_unbounded, session_bounds  # noqa: E402
from wire import frame  # noqa: E402

del sys.path[:1]

_REFILL_AFTER_S = 0.02  # no request for this long before pre-starting a jail: a fork stalls the zygote for a few ms
_RESERVE_IDLE_S = 60.0  # jails reserved beyond the usual spares are killed once none was asked for this long


# ---------------------------------------------------------------------------------------------------------- zygote


class _Zygote(JailEnding):
    """Forks jails, hands them out, reaps them and reports their deaths; runs as root inside bubblewrap when it can."""

    def __init__(self, control, config):
        self.control, self.config = control, config
        self.jails = {}  # pid -> Jail (spares and sessions)
        self.spares = []  # pids of jails waiting for a session, oldest first
        self.target = config["spares"]  # spares wanted now: the usual count, or more after a `reserve`
        self.reserve_until = 0.0  # reserved spares beyond the usual count are released after this
        self.stirred = 0.0  # when the last event that pauses the refill came: spares are forked once it is quiet
        self.graveyard = []  # cgroup directories whose rmdir must wait for the kernel
        self.serial = 0
        self.uid_base = random.randrange(1 << 24, (1 << 31) - (1 << 21))
        self.selector = selectors.DefaultSelector()
        self.pid = os.getpid()
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY) if config["jail"] else None
        self.watched_at, self.killed_for = 0.0, {}  # last sample (`watchdog.py`); pid -> bound it was killed for
        self.watch_scratch, self.bounds = scratch_unbounded(config), session_bounds(config)
        self.watching = bool(config.get("session_watchdog")) or self.watch_scratch
        self.dying = []  # closed sessions waiting frozen to be killed, oldest first: (closed at, jail)
        self.removers = set()  # pids of the children removing dead sessions' scratch directories

    # -------------------------------------------------------------------------------------------- forking jails

    def _remove_cgroups(self, cgroups):
        """Removes the directories of a jail that never ran (empty, so at once; the graveyard retries otherwise)."""
        for path in dict.fromkeys(cgroups.values()):
            if not rmdir_quietly(path):
                self.graveyard.append(path)

    def fork_jail(self, warm):
        self.serial += 1
        name = f"j{secrets.token_hex(12)}"  # unique across zygotes; not derivable from a neighbour's (cells see it)
        uid = self.uid_base + self.serial % (1 << 20) if self.config["drop_uid"] else 0
        fds, cgroups = [], {}
        try:
            # A fork refused (out of tasks or memory) must leave nothing behind: each failed attempt used to keep
            # these seven descriptors and the cgroup directories, until the zygote could open no more.
            for _ in range(3):  # request, status, and ready (closed by the jail once set up, before any cell runs)
                fds.extend(os.pipe2(os.O_CLOEXEC))
            fds.append(os.memfd_create("output", os.MFD_CLOEXEC))
            try:
                new_jail_cgroups(self.config, name, warm, cgroups)
            except OSError:
                self._remove_cgroups(cgroups)
                cgroups.clear()
            if self.config["jail"]:
                check(libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # our next child is pid 1 of a new one
            try:
                pid = os.fork()
            finally:
                if self.config["jail"] and os.getpid() == self.pid:
                    check(libc.setns(self.own_pidns, CLONE_NEWPID), "setns(CLONE_NEWPID)")
        except BaseException:
            if os.getpid() == self.pid:
                for fd in fds:
                    os.close(fd)
                self._remove_cgroups(cgroups)
            raise
        request_r, request_w, status_r, status_w, ready_r, ready_w, output = fds
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)  # the zygote's: cells' signal handlers must not write to a closed fd
                devnull = os.open("/dev/null", os.O_RDONLY)
                mine = [os.dup(fd) for fd in (devnull, output, output, request_r, status_w, ready_w)]
                for target, fd in enumerate(mine):
                    os.dup2(fd, target)
                close_all_but(len(mine), SHARED_DESCRIPTORS)  # those every session reaches paths through
                session_main(self.config, {"name": name, "uid": uid, "cgroups": cgroups, "warm": warm})
            except BaseException:  # noqa: B036 - a child must never return into the zygote's loop
                traceback.print_exc()
            os._exit(70)
        for fd in (request_r, status_w, ready_w):
            os.close(fd)
        path = os.path.join(self.config["scratch_root"], name)
        scratch = None if self.config["jail"] else path  # else in the jail's own tmpfs, gone with it
        self.jails[pid] = jail = Jail(pid, request_w, status_r, output, ready_r, cgroups, scratch)
        jail.watched_scratch, jail.uid = path if self.watch_scratch else None, uid
        os.set_blocking(ready_r, False)
        self.selector.register(ready_r, selectors.EVENT_READ, ("ready", jail))
        return pid

    def spawn(self, fds, ready_only=False):
        if len(fds) != 1 or (ready_only and not self.spares):  # no fork for a jail the host only keeps at hand
            for fd in fds:
                os.close(fd)
            return {"error": "spawn needs exactly one socket" if len(fds) != 1 else "no jail ready"}
        host = socket.socket(fileno=fds[0])
        if not self.spares:
            try:
                self.spares.append(self.fork_jail(warm=False))
            except OSError as exc:
                host.close()
                return {"error": f"could not start a jail: {exc}"}
        jail = self.jails[self.spares.pop(0)]
        if self.target > self.config["spares"]:  # a reserved jail taken: one fewer to keep ready
            self.target -= 1
            self.reserve_until = time.monotonic() + self.config.get("reserve_idle_s", _RESERVE_IDLE_S)
        weigh(jail, nice=0, shares=FULL_WEIGHT, weight=100)  # only root may lower niceness again: we are root
        try:
            send_hello(host, jail, frame)
        except OSError as exc:
            host.close()
            self.kill(jail)
            return {"error": f"could not hand the jail over: {exc}"}
        jail.hand_over(host)  # the host alone writes requests and reads statuses from now on
        self.selector.register(host, selectors.EVENT_READ, ("host", jail))
        return {"pid": jail.pid}

    def reserve(self, count):
        """Keeps `count` jails ready (the host bounds it): forked one after another while nothing else is asked,
        each at low priority, and released if unused for `_RESERVE_IDLE_S`."""
        self.target = max(self.config["spares"], int(count))
        self.reserve_until = time.monotonic() + self.config.get("reserve_idle_s", _RESERVE_IDLE_S)
        return {"ok": True, "target": self.target}

    def release_reserve(self):
        """Kills the spares beyond the usual count: nobody came for them."""
        self.target = self.config["spares"]
        while len(self.spares) > self.target:
            self.kill(self.jails[self.spares.pop()])

    # ------------------------------------------------------------------------------------------------ events

    def on_host(self, jail):
        """The host's socket of a session is only ever closed (the session ended): nothing else comes on it."""
        try:
            data = jail.host.recv(1 << 12)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.retire(jail)

    def on_ready(self, jail):
        try:
            data = os.read(jail.ready_r, 16)
        except BlockingIOError:
            return
        jail.set_up = jail.set_up or bool(data)
        self.selector.unregister(jail.ready_r)
        os.close(jail.ready_r)
        jail.ready_r = None

    # --------------------------------------------------------------------------------------------- main loop

    def serve(self):
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)  # full: a wake-up is already due
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler is needed for the wakeup fd to fire
        no_sigchld_on_stop()  # only deaths wake the zygote, not the per-call stop and resume of a session
        self.selector.register(self.control, selectors.EVENT_READ, ("control", None))
        self.selector.register(wake_r, selectors.EVENT_READ, ("wake", None))
        memory = MemoryWatch(self.config["cgroups"])
        if memory.fd is not None:
            self.selector.register(memory.fd, selectors.EVENT_READ, ("memory", None))
        interfaces = [name for _, name in socket.if_nameindex()]
        _send(
            self.control,
            {
                "ready": True,
                "pid": self.pid,
                "network_isolated": interfaces in ([], ["lo"]),
                "jail": self.config["jail"],
                "own_uid_per_session": self.config["drop_uid"],
            },
        )
        while True:
            refill = len(self.spares) < self.target
            if refill:  # spares are forked back to back, but only while nothing is asked
                timeout = max(0.0, self.stirred + _REFILL_AFTER_S - time.monotonic())
            elif len(self.spares) > self.config["spares"]:
                timeout = max(0.0, self.reserve_until - time.monotonic())
            else:
                timeout = None
            for due_at in (memory.recheck_at, self.dying and self.dying[0][0] + RETIRE_WAIT_S):
                if due_at:
                    due = max(0.0, due_at - time.monotonic())
                    timeout = due if timeout is None else min(timeout, due)
            if self.dying:  # woken when the quiet moment comes
                quiet_in = max(0.0, max(self.stirred, self.dying[-1][0]) + _REFILL_AFTER_S - time.monotonic())
                timeout = quiet_in if timeout is None else min(timeout, quiet_in)
            if self.watching:
                timeout = INTERVAL_S if timeout is None else min(timeout, INTERVAL_S)
            events = self.selector.select(timeout)
            if memory.recheck_at is not None and time.monotonic() >= memory.recheck_at:
                self.relieve(memory)
            if self.watching and time.monotonic() - self.watched_at >= INTERVAL_S:
                self.watch()
            # The usual spares are refilled only when the sandbox is quiet: a fork stalls the zygote and a jail's
            # set-up takes CPU from the calls. A reserve (more jails than the usual spares, asked for ahead of a
            # burst) is filled while no request comes, through the events of the jails it is starting: pausing for
            # each one that reported ready forked about one jail per 20 ms (4.1 s for 256 on 2 CPUs, 1.8 s now).
            eager = self.target > self.config["spares"]
            if events and (not eager or any(key.data[0] == "control" for key, _ in events)):
                self.stirred = time.monotonic()
            if self.dying:  # sessions closing one after another are a burst going on, as requests are
                self.end_dying(time.monotonic() - max(self.stirred, self.dying[-1][0]) >= _REFILL_AFTER_S)
            if refill and time.monotonic() - self.stirred >= _REFILL_AFTER_S:
                try:
                    self.spares.append(self.fork_jail(warm=True))
                except OSError:
                    time.sleep(0.1)  # out of processes or memory: do not spin
            elif not events and len(self.spares) > self.config["spares"] and time.monotonic() >= self.reserve_until:
                self.release_reserve()
            for key, _ in events:
                kind, jail = key.data
                if kind == "wake":
                    wake_r.recv(4096)
                    self.reap()
                elif kind == "memory":
                    self.relieve(memory)
                elif kind == "control":
                    if not self.on_control():
                        signal.set_wakeup_fd(-1)
                        self.shutdown()
                        return
                elif jail.closed:
                    continue
                elif kind == "ready" and jail.ready_r is not None:
                    self.on_ready(jail)
                elif kind == "host" and jail.host is not None:
                    self.on_host(jail)

    def on_control(self):
        try:
            request, fds = recv_control(self.control)
        except (OSError, ValueError):
            request, fds = None, []
        if request is None or request.get("op") == "shutdown":
            return False
        op = request.get("op")
        if op == "spawn":
            reply = self.spawn(fds, bool(request.get("ready_only")))
        elif op == "reserve":
            reply = self.reserve(request.get("count", 0))
        else:
            reply = {"error": f"unknown op {op!r}"}
        _send(self.control, reply)
        return True


def _send(sock, obj):
    sock.sendall(frame(obj))


def main():
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=int(sys.argv[2]))
    # No parent-death signal here: it would follow the trainer's thread that started us (see isolation.py). The
    # control socket closing (the trainer ended, however it ended) ends the zygote, and every jail with it.
    problem = probe_jail() if config["jail"] else "not asked for"
    if config["jail"] and problem:
        if not config.get("landlock"):  # the Landlock level's report already lists what namespaces would add
            _send(
                control,
                {
                    "warning": f"per-session jails are unavailable ({problem}): sessions share /tmp, network "
                    "and IPC namespaces"
                },
            )
        config["jail"] = False
    for name in config.get("preload", ()):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - an optional accelerator; cells report their own ImportError
            pass
    with open("/proc/self/status") as f:
        vm_mb = next((int(line.split()[1]) // 1024 for line in f if line.startswith("VmSize:")), 0)
    if vm_mb + 64 > config["memory_mb"]:
        _send(
            control,
            {
                "warning": f"memory_mb={config['memory_mb']} leaves cells almost nothing: the interpreter "
                f"with its preloaded modules already maps {vm_mb} MB of address space"
            },
        )
    os.chdir("/")
    # Processes of a session that dies before them (killed with it, without a pid namespace) come back to us and are
    # reaped, not to whoever is pid 1 (the trainer itself, in many containers), where they would stay zombies.
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    share_reach(config, random.randrange(1 << 24, 1 << 31))  # before the freeze: the rewritten paths are shared
    gc.freeze()  # keep the collector off the preloaded objects, so forked children do not copy their pages
    _Zygote(control, config).serve()


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
