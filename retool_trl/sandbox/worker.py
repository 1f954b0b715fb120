"""The zygote of the local sandbox: forks one jailed session process per session, relays and settles its calls.

Executed as a script (`python -I worker.py CONFIG_JSON CONTROL_FD`), never imported by the trainer, and stdlib-only.
It pre-imports the configured modules once, then forks jails ahead of demand (`session_process.py` is the jail's
side). It is the only channel between a session and the host, and reports results itself: a call is settled only
once the session process is parked again (one thread, blocked reading its request pipe), then that process is
stopped until the next request; a death is reported with the zygote's own wait status, reaped with WNOHANG only.
Frames on every socket and pipe: a 4-byte big-endian length, then UTF-8 JSON.
"""

import errno
import gc
import json
import os
import random
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
import traceback

# The sibling modules `session_process.py` and `reaping.py`: python -I puts no script directory on sys.path, and
# cells must not find this package's modules there either, so the directory is on it for these imports only.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reaping import death_cause, rmdir_quietly  # noqa: E402
from session_process import (  # noqa: E402
    CLONE_NEWPID,
    PR_SET_PDEATHSIG,
    REQUEST_FD,
    Jail,
    check,
    descendants,
    frame,
    libc,
    prctl,
    probe_jail,
    recv_control,
    session_main,
    take_frames,
    write_file,
)

del sys.path[0]

_MAX_REQUEST = 16 * 1024 * 1024
_REFILL_AFTER_S = 0.02  # idle this long before pre-starting a jail: a fork stalls the zygote for a few ms
_PARK_POLL_S = 0.0002
_RETIRE_BATCH = 32  # closed sessions kept stopped at most before they are killed even while busy
_SYS_READ = str({"x86_64": 0, "aarch64": 63}.get(os.uname().machine)).encode()
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------------- zygote


class _Zygote:
    """Forks jails, relays requests, settles calls and reaps; runs as root inside bubblewrap when it can."""

    def __init__(self, control, config):
        self.control, self.config = control, config
        self.jails = {}  # pid -> _Jail (spares and sessions)
        self.spares = []  # pids of jails waiting for a session, oldest first
        self.graveyard = []  # cgroup directories whose rmdir must wait for the kernel
        self.unsettled = set()  # jails whose status arrived, waiting for their process to park
        self.retired = []  # closed sessions, stopped, to be killed at the next idle moment
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
            limits = {
                "memory1": {"memory.limit_in_bytes": self.config["memory_mb"] << 20},
                "pids": {"pids.max": self.config["max_processes"]},
                "v2": {
                    "memory.max": self.config["memory_mb"] << 20,
                    "memory.swap.max": 0,
                    "pids.max": self.config["max_processes"],
                },
            }[kind]
            for key, value in limits.items():
                if os.path.exists(os.path.join(path, key)):
                    write_file(os.path.join(path, key), str(value))
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
            check(libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")  # our next child is pid 1 of a new one
        try:
            pid = os.fork()
        finally:
            if self.config["jail"] and os.getpid() == self.pid:
                check(libc.setns(self.own_pidns, CLONE_NEWPID), "setns(CLONE_NEWPID)")
        if pid == 0:
            try:
                devnull = os.open("/dev/null", os.O_RDONLY)
                mine = [os.dup(fd) for fd in (devnull, output, output, request_r, status_w)]
                for target, fd in enumerate(mine):
                    os.dup2(fd, target)
                os.closerange(5, 1 << 16)
                session_main(self.config, {"name": name, "uid": uid, "cgroups": cgroups, "warm": warm})
            except BaseException:  # noqa: B036 - a child must never return into the zygote's loop
                traceback.print_exc()
            os._exit(70)
        os.close(request_r)
        os.close(status_w)
        os.set_blocking(request_w, False)
        os.set_blocking(status_r, False)
        scratch = None if self.config["jail"] else os.path.join(self.config["scratch_root"], name)
        self.jails[pid] = jail = Jail(pid, request_w, status_r, output, cgroups, scratch)
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
            hello = frame({"hello": True, "pid": jail.pid, "creds": True})
            host.sendmsg([hello], [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
        except OSError:  # unprivileged, hence in the host's pid namespace: our pid numbers are the host's
            host.sendall(frame({"hello": True, "pid": jail.pid, "creds": False}))
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
            return self.retire(jail)  # the session was closed (or the host is gone)
        jail.host_buffer += data
        try:
            requests = take_frames(jail.host_buffer, _MAX_REQUEST)
        except ValueError:
            return self.kill(jail)
        for request in requests:
            if jail.call_id is not None:
                continue  # one call at a time; the host never sends another before a reply
            jail.call_id, jail.status = request.get("id"), None
            jail.status_buffer.clear()
            jail.pending += frame({"code": str(request.get("code", ""))})
            self.flush_request(jail)
            os.kill(jail.pid, signal.SIGCONT)  # after the write: it resumes with its request already there

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
            frames = take_frames(jail.status_buffer, 64 * self.config["max_output_chars"] + (1 << 16))
        except ValueError:  # garbage on the status pipe: the call still ends only when the process parks or dies
            jail.status_buffer.clear()
            frames = [
                {
                    "ok": False,
                    "error": "SystemError: the interpreter sent an invalid status\n",
                    "fatal": "invalid status",
                }
            ]
        if frames and jail.call_id is not None and (jail.status or {}).get("fatal") != "invalid status":
            jail.status = frames[-1]
            self.unsettled.add(jail)  # a forged frame followed by more work is superseded by the real one

    def parked(self, jail):
        """True when the session process is single-threaded and blocked reading its request pipe: the cell is over
        (whatever it wrote on its status pipe before) and nothing of it can still run."""
        try:
            with open(f"/proc/{jail.pid}/syscall", "rb") as f:
                fields = f.read().split()
            with open(f"/proc/{jail.pid}/stat", "rb") as f:
                stat = f.read().rsplit(b")", 1)[1].split()
            threads = int(stat[17])
            # Stopped from here until the next call: this is the CPU time the next call starts from.
            jail.cpu_before = (int(stat[11]) + int(stat[12])) / _CLOCK_TICKS
        except (OSError, IndexError, ValueError):
            return False
        return threads == 1 and len(fields) > 1 and fields[0] == _SYS_READ and int(fields[1], 16) == REQUEST_FD

    def settle(self, jail):
        os.kill(jail.pid, signal.SIGSTOP)  # between calls nothing of the session runs (timers, signal handlers)
        for pid in descendants(jail.pid, single_threaded=True):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        status = jail.status if isinstance(jail.status, dict) else {}
        reply = dict(
            self.read_output(jail, status.get("skipped", 0)),
            id=jail.call_id,
            ok=status.get("ok") is True,
            error=str(status.get("error") or ""),
            fatal=status.get("fatal") and str(status["fatal"]),
        )
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
        data = frame(reply)
        try:
            try:
                sent = jail.host.send(data)  # a reply almost always fits the socket buffer: no blocking toggles
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                jail.host.setblocking(True)
                jail.host.sendall(data[sent:])
                jail.host.setblocking(False)
        except OSError:
            pass  # the host gave up on this call (timeout): the session is being killed

    # ------------------------------------------------------------------------------------------ deaths, cleanup

    def kill(self, jail):
        # pid 1 of its namespace: the kernel takes the rest of the jail along (without one: its process group).
        # Once reaped its pid may belong to another process: only a jail not yet reaped is signalled.
        for kill in (os.kill, os.killpg) if jail.pid in self.jails else ():
            try:
                kill(jail.pid, signal.SIGKILL)
            except OSError:
                pass
        jail.call_id = None
        self.forget(jail)

    def retire(self, jail):
        """A closed session: stopped now (nothing of it runs any more), killed when the zygote is idle or enough
        are waiting, so that the kernel's teardown of its namespaces does not compete with the running cells."""
        try:
            os.kill(jail.pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        jail.call_id = None
        self.forget(jail)
        self.retired.append(jail)
        if len(self.retired) >= _RETIRE_BATCH:
            self.kill_retired()

    def kill_retired(self):
        retired, self.retired = self.retired, []
        for jail in retired:
            self.kill(jail)

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
            if jail in self.retired:
                self.retired.remove(jail)
            if jail.call_id is not None and not jail.closed:
                cause = death_cause(status, usage, jail.cpu_before, self.config["cpu_time_s"], jail.cgroups)
                self.settle_crash(jail, cause)
            self.forget(jail)
            self.graveyard.extend(jail.cgroups)
            if jail.scratch:
                self.remove_later(jail.scratch)
        self.graveyard = [path for path in self.graveyard if not rmdir_quietly(path)]

    def remove_later(self, path):
        """Removes a scratch directory in a child: a million files cost that child, not the other sessions."""
        try:
            if os.fork() == 0:
                shutil.rmtree(path, ignore_errors=True)
                os._exit(0)
        except OSError:
            shutil.rmtree(path, ignore_errors=True)

    def shutdown(self):
        self.retired = []
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
            waiting = [j for j in self.unsettled if j.status is not None and j.call_id is not None and not j.closed]
            refill = len(self.spares) < self.config["spares"] or self.retired
            timeout = _PARK_POLL_S if waiting else _REFILL_AFTER_S if refill else None
            events = self.selector.select(timeout)
            if not events and self.retired and not waiting:
                self.kill_retired()
            elif not events and refill and not waiting:
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
            request, fds = recv_control(self.control)
        except (OSError, ValueError):
            request, fds = None, []
        if request is None or request.get("op") == "shutdown":
            return False
        reply = self.spawn(fds) if request.get("op") == "spawn" else {"error": f"unknown op {request.get('op')!r}"}
        _send(self.control, reply)
        return True


def _send(sock, obj):
    sock.sendall(frame(obj))


def main():
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=int(sys.argv[2]))
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    problem = probe_jail() if config["jail"] else "not asked for"
    if config["jail"] and problem:
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
    gc.freeze()  # keep the collector off the preloaded objects, so forked children do not copy their pages
    _Zygote(control, config).serve()


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
