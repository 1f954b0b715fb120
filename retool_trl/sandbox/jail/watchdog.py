"""A session's memory and process bound as a whole where no memory cgroup is writable (the Landlock level in a
container, a normal user): the zygote samples each session's process tree every `INTERVAL_S` seconds and kills a
session whose processes together hold more than `memory_mb` of private resident memory, or number more than
`max_processes`.

What it bounds, and what it does not: each process keeps its own address-space limit (RLIMIT_AS, immediate); the
sum over a session's processes is checked only at each sample, so a session can exceed it for up to one interval;
pages shared after a fork count once per process that maps them (an overestimate, never an underestimate of
anonymous memory); files a session writes to its scratch directory are disk, not memory, and are bounded per file
(RLIMIT_FSIZE). Stdlib-only: the zygote imports it as a sibling script module.
"""

import os

INTERVAL_S = 0.1
_PAGE = os.sysconf("SC_PAGE_SIZE")


def process_tree(pid):
    """`pid` and its descendants, from /proc (children of every thread); a process gone meanwhile is skipped."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(_children(current))
    return found


def private_resident_bytes(pid):
    """Resident memory of a process that no file backs (its heap, stacks, anonymous maps), from /proc/PID/statm."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            fields = f.read().split()
        return max(0, int(fields[1]) - int(fields[2])) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def over_budget(pid, memory_bytes, max_processes):
    """`(pids, reason)`: the session's processes, and "memory" or "processes" when it is over its bound, else None."""
    pids = process_tree(pid)
    if len(pids) > max_processes:
        return pids, "processes"
    if sum(private_resident_bytes(p) for p in pids) > memory_bytes:
        return pids, "memory"
    return pids, None


def enforce(session_pids, memory_bytes, max_processes):
    """Kills every session over its bound, with all its processes (without a pid namespace they would outlive it);
    returns the pids of the sessions killed for their memory (their deaths are then reported as memory limits)."""
    for_memory = set()
    for pid in session_pids:
        pids, reason = over_budget(pid, memory_bytes, max_processes)
        if reason is None:
            continue
        if reason == "memory":
            for_memory.add(pid)
        for member in pids:
            try:
                os.kill(member, 9)  # SIGKILL
            except OSError:
                pass
    return for_memory


def kill_strays(parent, keep):
    """Kills the children of `parent` (the zygote, a subreaper) not in `keep`, with their descendants: processes of a
    session that died before them, which came back to the zygote instead of ending with their session."""
    for child in _children(parent):
        if child not in keep:
            for pid in process_tree(child):
                try:
                    os.kill(pid, 9)  # SIGKILL
                except OSError:
                    pass


def _children(pid):
    found = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(child) for child in f.read().split())
    except (OSError, ValueError):
        pass
    return found
