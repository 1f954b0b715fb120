"""The session side of the local sandbox: one jailed interpreter process that runs a session's cells.

Imported by `worker.py` inside the sandbox (stdlib-only, never by the trainer). The zygote forks this process as pid 1
of a fresh pid namespace; `session_main` enters its own mount, network, IPC and UTS namespaces (`jail_setup.py`), its
cgroups, uid, rlimits and seccomp filter, then runs cells read from fd 3 and reports each cell's ok and traceback on
fd 4: this module owns that request loop and how one cell runs. What a cell prints reaches fd 1, a memfd that only
the host reads; the host decides when a call is over (`channel.py`).
"""

import _signal
import ast
import base64
import ctypes
import json
import linecache
import os
import resource
import signal
import struct
import sys
import threading
import time

import reach  # root-only paths reached through descriptors, a sibling script module
from cell_io import Capture, format_exception  # a sibling script module, shared with the remote backend
from jail_setup import (  # a sibling script module (worker.py puts this directory on sys.path for its imports)
    PR_SET_NO_NEW_PRIVS,
    PR_SET_PDEATHSIG,
    enter_jail,
    install_seccomp,
    prctl,
    write_file,
)
from landlock import open_rule_paths, restrict_self  # the Landlock syscalls, a sibling script module
from watchdog import own_unnamed_file_bytes, scratch_unbounded  # the zygote's bounds, a sibling script module
from wire import HEADER, frame  # the host's wire format

# In a session process: 0 /dev/null, 1 and 2 the output memfd, 3 requests, 4 statuses, 5 "set up" (closed early).
REQUEST_FD, STATUS_FD, READY_FD = 3, 4, 5
_BACKGROUND_NICE = 10
_THIS_FILE = os.path.abspath(__file__)
_CELL_IO_FILE = os.path.abspath(sys.modules[Capture.__module__].__file__)


def read_exact(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------------------------------------- session process


def _format_exception(exc, last_line=None):
    text = format_exception(exc, (_THIS_FILE, _CELL_IO_FILE), last_line)
    for reached, path in reach.SHOWN_PATHS.items():  # a module imported through a descriptor is named as anywhere else
        text = text.replace(f'File "{reached}/', f'File "{path.rstrip("/")}/')
    return text


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
        self.count_unnamed = scratch_unbounded(config)  # no tmpfs of its own bounds the scratch
        self.signal_mask = signal_mask  # the cells' own signal mask; outside a cell every catchable one is blocked
        self.namespace = {"__name__": "__main__", "__builtins__": builtins}
        self.sink = open(os.devnull, "w")

    def run(self, code):
        self.count += 1
        filename = f"<cell-{self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        capture = Capture(self.config["max_output_chars"])
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
        if self.count_unnamed and own_unnamed_file_bytes() > self.config["scratch_mb"] << 20:
            # Files deleted while held open (or O_TMPFILE ones) are out of the scratch tree: counted at the call's
            # end too, not only at the zygote's next sample (which also adds the tree, and catches a cell that
            # rewrote this loop).
            ok, fatal = False, "scratch"
            error = (error or "") + (
                f"OSError: the session's files passed {self.config['scratch_mb']} MB or {self.config['max_files']} "
                "files (the session was killed)\n"
            )
        text = capture.text()
        try:
            os.write(1, text.encode("utf-8", "replace"))
        except OSError:
            pass  # the native output already reached the file size limit
        return {"ok": ok, "error": error, "fatal": fatal, "skipped": max(0, capture.total - len(text))}


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


_PR_SET_CHILD_SUBREAPER, _PR_CAPBSET_DROP, _CAP_LAST = 36, 24, 63
_PR_SET_DUMPABLE = 4


def _set_capabilities(mask):
    """Sets this thread's effective, permitted and inheritable capabilities to `mask` (capset, version 3)."""
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    low, high = mask & 0xFFFFFFFF, mask >> 32
    data = struct.pack("6I", low, low, low, high, high, high)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.capset(ctypes.create_string_buffer(header, len(header)), ctypes.create_string_buffer(data, len(data))):
        raise OSError(ctypes.get_errno(), "capset: could not set the session's capabilities")


def _drop_capabilities(sets=True):
    """Empties the bounding set (so that no program a cell runs gets capabilities back) and, with `sets`, every
    capability set of this process: a uid-0 session keeps root's files as its own, but can no longer override
    permissions, kill, trace or change uid. (Without `sets`: before a uid change, which itself needs CAP_SETUID.)"""
    for cap in range(_CAP_LAST + 1):
        ctypes.CDLL(None).prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the kernel's last: ignored
    if sets:
        _set_capabilities(0)


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
        enter_jail(config)
    scratch = os.path.join(config["scratch_root"], jail["name"])
    os.makedirs(config["scratch_root"], mode=0o711, exist_ok=True)
    os.mkdir(scratch, 0o700)
    uid = jail["uid"]
    if uid:
        os.chown(scratch, uid, uid)
    os.chdir(scratch)
    # Opened while still root (and before the open-file limit): what only root can reach stays readable through
    # these, with no capability kept; those the session's uid can reach are closed once Landlock is in force.
    held = open_rule_paths(config["landlock"]) if config.get("landlock") else {}
    mb = 1024 * 1024
    # Room for the descriptors held for the Landlock rules until they are closed; `max_open_files` itself is set
    # once they are (a value past what may be set still fails here, while root, as the jail's own set-up error).
    nofile, hard = config["max_open_files"], resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    roomy = nofile if 0 <= hard < nofile else max(nofile, 256) if hard < 0 else min(max(nofile, 256), hard)
    limits = [
        (resource.RLIMIT_NOFILE, roomy),
        (resource.RLIMIT_AS, config["memory_mb"] * mb),
        (resource.RLIMIT_FSIZE, config["max_file_size_mb"] * mb),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, resource.RLIM_INFINITY),  # while still root; each call then sets its soft limit
    ]
    if uid:  # RLIMIT_NPROC counts the uid's processes: only a per-session uid makes it a per-session cap
        limits.append((resource.RLIMIT_NPROC, config["max_processes"]))
    for kind, value in limits:
        resource.setrlimit(kind, (value, value))
    if not config["jail"]:  # not pid 1 of a namespace: orphans of the cell still come back to us, to be ended
        prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if uid:
        _drop_capabilities(sets=False)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # every capability goes with root (none is kept across the change)
        if config.get("watch_by_fsuid"):  # the trainer reads /proc/PID/syscall as this uid (isolation/fsuid.py)
            prctl(_PR_SET_DUMPABLE, 1)
        _drop_capabilities()
    elif config.get("landlock") and os.geteuid() == 0:
        _drop_capabilities()  # uid 0 kept (the interpreter is readable by root only): without root's powers
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if config.get("landlock"):
        restrict_self(config["landlock"], scratch, held)
        if reach.shared_by_zygote():  # done once by the zygote: the descriptors held here served the rules only
            for fd in held.values():
                os.close(fd)
        else:
            reach.reach_through_descriptors(reach.keep_unreachable(held, reach.cannot_stat))
    # Set once the descriptors opened for the Landlock rules are closed (the limit refuses descriptor numbers at or
    # above it, and a rule whose path cannot be opened would be left out).
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    if config.get("seccomp"):
        install_seccomp(base64.b64decode(config["seccomp"]))
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
