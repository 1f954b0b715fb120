"""A session's bounds as a whole where no cgroup keeps them (the Landlock level in a container, a normal user): the
zygote samples each session every `INTERVAL_S` seconds and kills one whose processes together hold more than
`memory_mb` of private resident memory, or have more than `max_processes` tasks (threads included), or whose scratch
directory tree holds more than `scratch_mb` of disk or `max_files` entries.

What it bounds, and what it does not: each process keeps its own address-space limit (RLIMIT_AS) and each file its
size limit (RLIMIT_FSIZE), both immediate; the sums are checked only at each sample, so a session can exceed them
for up to one interval (threads start in tens of microseconds, files fill at the disk's speed); pages shared after a
fork, and shared anonymous maps, count once per process that maps them (an overestimate, never an underestimate of
anonymous memory); a file deleted while held open (or made unnamed with O_TMPFILE) is no longer in the tree, so
the regular files the session's processes hold open that no directory names count with it, read through
/proc/PID/fd (as the session's uid where the zygote has no CAP_SYS_PTRACE: `watch_by_fsuid`); a deleted file that
is only mapped, its descriptor closed, is not seen. A tree the zygote cannot list (a directory made unreadable, a
path past PATH_MAX) counts as over its bound; a tree that takes long to walk is walked less often (the zygote spends
at most about a tenth of its time on one session's tree), so a session with many files is checked with more slack,
never not at all.

A session none of whose processes ran since a full sample found it within bounds (a parked session between calls:
most of them at 1,024 live sessions) is sampled in full again only once a second (`QUIET_RESAMPLE_S`) rather than
ten times: what it holds takes its processes' CPU to grow, read from each one's run time (/proc/PID/schedstat,
nanoseconds: a timer's wake-up of a few microseconds shows) at a fraction of a full sample's cost, for sessions whose
processes have one thread each (schedstat counts the main thread only). The resample bounds what can grow without
them running: a file another session writes through a descriptor passed to it (on kernels whose Landlock does not
scope abstract UNIX sockets), pages the kernel's khugepaged fills in under a sparse huge-page range. A session of one
process with one thread (every session between calls) is held to `memory_mb` by its address-space limit, which a
cell cannot raise, so its memory is not summed; where, besides, no other session can hand it a descriptor (`sealed`:
Landlock ABI 6+ with a uid per session, or ABI 9+), neither can grow without it running, and it is resampled every
`SEALED_RESAMPLE_S` instead (at 1,024 parked sessions the once-a-second resample was most of the zygote's watching).
Stdlib-only: the zygote imports it as a sibling script module.
"""

import contextlib
import ctypes
import errno
import os
import resource
import shutil
import stat
import time

INTERVAL_S = 0.1
QUIET_RESAMPLE_S = 1.0  # how often a session that has not run is sampled in full all the same
# ... a session of one process with one thread whose files no other session can reach (`sealed` bounds): see below
SEALED_RESAMPLE_S = 5.0
WALK_SHARE = 0.1  # the most of the zygote's time one session's scratch walk may take, on average
_next_walk = {}  # scratch directory -> when its tree is walked next (monotonic seconds)
# session pid -> ({pid: run time (ns)} before a full sample found it within bounds, that sample's monotonic time)
_quiet = {}
_schedstat_fds = {}  # pid -> its /proc/PID/schedstat, open (`_schedstat`)


def process_tree(pid):
    """`(pids, tasks)`: `pid` and its descendants, from /proc (children of every thread), and how many tasks (threads
    included) they have; a process gone meanwhile is skipped."""
    found, tasks, todo = [], 0, [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        children, threads = _children(current)
        tasks += threads
        todo.extend(children)
    return found, tasks


def private_resident_bytes(pid):
    """Resident memory of a process that no file on disk backs: its heap, stacks and private anonymous maps
    (`RssAnon`), and shared anonymous maps and tmpfs pages it maps (`RssShmem`: `mmap.mmap(-1, n)` is one, and
    `statm`'s "shared" column would have hidden it), from /proc/PID/status."""
    total = 0
    try:
        for line in read_proc(f"/proc/{pid}/status").splitlines():
            if line.startswith((b"RssAnon:", b"RssShmem:")):
                total += int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        return 0
    return total


def read_proc(path, size=8192):
    """The bytes of a /proc file, read from a raw descriptor (cheaper than `open()`'s buffered file object, read for
    every live session ten times a second). Read to the end: a file of many records (a long list of children) comes
    back one kernel page per read, whatever `size` asks."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = []
        while chunk := os.read(fd, size):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def unnamed_file_bytes(pids):
    """Disk blocks of the regular files that `pids` hold open and that no directory names any more (deleted while
    open, or made with O_TMPFILE): out of the scratch tree's walk, still on the disk. Each file counts once."""

    def held():
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    yield os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue

    return _unnamed_bytes(held())


def own_unnamed_file_bytes():
    """`unnamed_file_bytes` of the calling process, by `fstat` of each descriptor rather than `stat` of its
    /proc/self/fd path (a path walk through /proc, under Landlock and seccomp, for each: at every call's end it cost
    a third of a short call)."""

    def held():
        for name in os.listdir("/proc/self/fd"):
            try:
                yield os.fstat(int(name))
            except (OSError, ValueError):
                continue  # the listing's own descriptor, closed by now

    return _unnamed_bytes(held())


def _unnamed_bytes(infos):
    """Disk blocks of the regular files among `infos` (stat results) that no directory names, each file once."""
    seen, total = set(), 0
    for info in infos:
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 0 and (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            total += info.st_blocks * 512
    return total


_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def as_file_system_ids(uid):
    """This thread's fsuid and fsgid set to `uid` (the zygote, root without CAP_SYS_PTRACE, may then read the
    /proc/PID/fd of a dumpable session of that uid); restored after. `uid` 0 or None: nothing changes."""
    if not uid:
        yield
        return
    _libc.setfsgid(uid)
    _libc.setfsuid(uid)
    try:
        yield
    finally:
        _libc.setfsuid(0)
        _libc.setfsgid(0)


def session_bounds(config):
    """What the watchdog bounds (see `over_budget`): memory and tasks only where no cgroup does (`session_watchdog`),
    the scratch tree always where it samples one (`scratch_unbounded`)."""
    sampled = config.get("session_watchdog")
    return {
        "memory": config["memory_mb"] << 20 if sampled else None,
        "tasks": config["max_processes"] if sampled else None,
        "scratch": config["scratch_mb"] << 20,
        "files": config["max_files"],
        "by_fsuid": bool(config.get("watch_by_fsuid")),
        # Sessions cannot hand each other descriptors: Landlock scopes abstract UNIX sockets to the session (ABI 6+),
        # and a pathname socket can only be bound in a session's own scratch, which no other session's uid reaches
        # (a uid per session); pathname connects outside the scratch are refused from ABI 9 (before, a third party's
        # socket that relays descriptors, a D-Bus bus say, is left).
        "sealed": _sealed(config),
    }


def _sealed(config):
    abi = int((config.get("landlock") or {}).get("abi", 0))
    return abi >= 9 or (abi >= 6 and bool(config.get("drop_uid")))


def scratch_unbounded(config):
    """Whether sessions' scratch directories lie outside a private tmpfs (no jail, or a scratch root outside the temp
    directories a jail replaces with its own): then the watchdog bounds each as a tree (`scratch_over`)."""
    root = config["scratch_root"]
    return not config["jail"] or not any(os.path.commonpath([root, t]) == t for t in ("/tmp", "/var/tmp", "/dev/shm"))


def scratch_over(path, max_bytes, max_files):
    """Whether the tree under `path` holds more than `max_bytes` of disk blocks or more than `max_files` entries.
    Stops at the first bound passed, so a tree of a million files costs no more to look at than its bound."""
    used, entries, todo = 0, 0, [path]
    while todo:
        try:
            with os.scandir(todo.pop()) as listing:
                for entry in listing:
                    entries += 1
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError as exc:
                        if exc.errno == errno.ENOENT:  # removed meanwhile
                            continue
                        return True  # past PATH_MAX, or otherwise out of the zygote's reach: over its bound
                    used += info.st_blocks * 512
                    if used > max_bytes or entries > max_files:
                        return True
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # removed meanwhile: fine; unreadable or too deep to reach: over its bound
                return True
    return False


def scratch_due(scratch, now):
    """Whether a session's scratch tree is due for a walk (see `WALK_SHARE`)."""
    return now >= _next_walk.get(scratch, 0.0)


def run_times(pids):
    """`{pid: nanoseconds it has run}` (/proc/PID/schedstat, its main thread), or None where one is gone or reads 0
    (a kernel that keeps no run times: a process that ran at all has run more than 0 ns)."""
    times = {}
    for pid in pids:
        try:
            times[pid] = int(_schedstat(pid).split()[0])
        except (OSError, ValueError, IndexError):
            _forget_schedstat(pid)
            return None
        if times[pid] <= 0:
            return None
    return times


def _schedstat(pid):
    """/proc/PID/schedstat, through a descriptor kept open and re-read with `pread` (cheaper than opening it each
    time, read for every parked session ten times a second). The descriptor names that process, not the number:
    once it is gone a read fails (ESRCH), even if another process has taken its pid. Descriptors are kept while the
    table is under three quarters full, the rest left to the sessions' own."""
    fd = _schedstat_fds.get(pid)
    if fd is None:
        fd = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        # Under 1 << 16 too: a jail closes what it inherits up to there (`reach.close_all_but`).
        if fd >= min(resource.getrlimit(resource.RLIMIT_NOFILE)[0] * 3 // 4, 1 << 16):
            try:
                return os.read(fd, 128)
            finally:
                os.close(fd)
        _schedstat_fds[pid] = fd
    return os.pread(fd, 128, 0)


def _forget_schedstat(pid):
    fd = _schedstat_fds.pop(pid, None)
    if fd is not None:
        os.close(fd)


def over_budget(pid, bounds, scratch=None, uid=0):
    """`(pids, reason)`: the session's processes, and "processes", "memory" or "scratch" when it is over that bound
    (`bounds`: `memory` bytes and `tasks`, None where a cgroup keeps them; `scratch` bytes and `files`), else None.
    The scratch counts the tree and the unnamed files the processes hold open (`unnamed_file_bytes`). A session that
    has not run since a full sample found it within bounds is not sampled again (see the module's docstring)."""
    last, sampled_at = _quiet.get(pid, (None, 0.0))
    if last is not None:
        resample_s = SEALED_RESAMPLE_S if bounds.get("sealed") and len(last) == 1 else QUIET_RESAMPLE_S
        if time.monotonic() - sampled_at < resample_s and run_times(last) == last:
            return list(last), None
    _quiet.pop(pid, None)
    pids, tasks = process_tree(pid)
    # Read before the sample: a process that runs after this shows in its run time. Where each process has one
    # thread, and no process came or went meanwhile (a fork between the walk and this read), a sample that found the
    # session within bounds, its tree walked too, holds until one of them runs.
    # (Not for a session over its task bound, about to be killed: a descriptor kept for each of its processes.)
    within = bounds.get("tasks") is None or tasks <= bounds["tasks"]
    before, sampled_at = (run_times(pids) if tasks == len(pids) and within else None), time.monotonic()
    reason, walked = _over(pids, tasks, bounds, scratch, uid)
    if reason is None and before is not None and (walked or not scratch) and process_tree(pid) == (pids, tasks):
        _quiet[pid] = (before, sampled_at)
    return pids, reason


def _over(pids, tasks, bounds, scratch, uid):
    """`(reason, walked)`: the bound the session's processes `pids` are over (None: within all), and whether its
    scratch was looked at now (its walk is due at most `WALK_SHARE` of the time)."""
    if bounds.get("tasks") is not None and tasks > bounds["tasks"]:
        return "processes", False
    # One process of one thread: its own address-space limit (RLIMIT_AS, `memory_mb`, which a cell cannot raise)
    # already bounds its resident memory, as after every call (the call's processes and threads end with it).
    alone = len(pids) == 1 and tasks == 1
    if bounds.get("memory") is not None and not alone and sum(map(private_resident_bytes, pids)) > bounds["memory"]:
        return "memory", False
    if not scratch or not scratch_due(scratch, start := time.monotonic()):
        return None, False
    with as_file_system_ids(uid if bounds.get("by_fsuid") else 0):
        held = unnamed_file_bytes(pids)
    over = held > bounds["scratch"] or scratch_over(scratch, bounds["scratch"] - held, bounds["files"])
    took = time.monotonic() - start
    _next_walk[scratch] = start + max(INTERVAL_S, took / WALK_SHARE) - INTERVAL_S
    return ("scratch" if over else None), True


def enforce(sessions, bounds):
    """Kills every session over its bound (`sessions`: `(pid, scratch directory or None, uid)`), with all its processes
    (without a pid namespace they would outlive it); returns `{pid: reason}` for the sessions killed."""
    killed = {}
    live = {scratch for _, scratch, _ in sessions}
    for gone in [path for path in _next_walk if path not in live]:
        del _next_walk[gone]
    live = {pid for pid, _, _ in sessions}
    for gone in [pid for pid in _quiet if pid not in live]:
        del _quiet[gone]
    held = {member for last, _ in _quiet.values() for member in last}
    for gone in [member for member in _schedstat_fds if member not in held]:  # no quiet session holds it any more
        _forget_schedstat(gone)
    for pid, scratch, uid in sessions:
        pids, reason = over_budget(pid, bounds, scratch, uid)
        if reason is None:
            continue
        killed[pid] = reason
        for member in pids:
            try:
                os.kill(member, 9)  # SIGKILL
            except OSError:
                pass
    return killed


def remove_scratch(path):
    """Removes a dead session's scratch tree, with the directories its cell made unlistable (mode 0o300: the cell may
    not chmod them back, the zygote may) opened up first where a plain removal left something."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.lexists(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        _open_up(fd)
    except (OSError, RecursionError):
        pass
    finally:
        os.close(fd)
    shutil.rmtree(path, ignore_errors=True)


def _open_up(dir_fd):
    """Gives the owner every right on each directory below `dir_fd` (relative names: no path grows past PATH_MAX)."""
    with os.scandir(dir_fd) as listing:
        names = [entry.name for entry in listing if entry.is_dir(follow_symlinks=False)]
    for name in names:
        os.chmod(name, 0o700, dir_fd=dir_fd)  # a directory of a dead session: nothing swaps it for a link now
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            _open_up(fd)
        finally:
            os.close(fd)


def kill_strays(parent, keep):
    """Kills the children of `parent` (the zygote, a subreaper) not in `keep`, with their descendants: processes of a
    session that died before them, which came back to the zygote instead of ending with their session."""
    for child in _children(parent)[0]:
        if child not in keep:
            for pid in process_tree(child)[0]:
                try:
                    os.kill(pid, 9)  # SIGKILL
                except OSError:
                    pass


def _children(pid):
    """`(children, threads)` of a process: the children of each of its threads, and how many threads it has."""
    found, threads = [], 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            threads += 1
            found.extend(int(child) for child in read_proc(f"/proc/{pid}/task/{tid}/children").split())
    except (OSError, ValueError):
        pass
    return found, threads
