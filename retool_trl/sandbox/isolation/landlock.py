"""The Landlock level (host side: runs in the trainer), for hosts where namespaces are refused (root in a default
Docker/podman container, a normal user without user namespaces): no privilege is needed. Each session restricts
itself with Landlock (read only what the interpreter needs, write only its own scratch directory, no TCP
bind/connect, signals and abstract UNIX sockets scoped to the session), on top of the seccomp filter (no socket
family but AF_UNIX), a subreaper, rlimits and, where the process may change uid, a uid of its own.

The syscalls and the rules live on the jail side (`jail/landlock.py`, which each session runs); this file picks the
paths and says what the level does not give.
"""

import os

from ..jail.landlock import (  # noqa: F401 - re-exported: the level's ABI checks and rules, as the jail sees them
    DEVICES_RW,
    ETC_READ,
    READ,
    SYSTEM_READ,
    abi_version,
    handled_fs,
    landlock_problem,
    landlock_rules,
    not_enforced,
    restrict_self,
)
from .common import Launch
from .level import IsolationLevel


def launch(worker, network):
    """The trainer side: the zygote runs directly, each session restricts itself (see `restrict_self`)."""
    from .common import _needed_paths, can_drop_privileges, may_watch_other_uids
    from .seccomp import FAMILIES_IN_A_NETWORK_NAMESPACE, FAMILIES_WITHOUT_NAMESPACES

    abi = abi_version()
    read = [str(p) for p in _needed_paths(worker)] + [*SYSTEM_READ, *(p for p in ETC_READ if os.path.exists(p))]
    rules = landlock_rules(read, DEVICES_RW, abi)
    missing = not_enforced(abi)
    if network:
        rules["network"] = True
        missing.append("network isolation (network=True was asked for)")
    missing += [
        "private /tmp and /dev/shm: a session writes only its own scratch directory (its HOME and TMPDIR), so "
        "POSIX semaphores (multiprocessing locks) are unavailable; the zygote samples the scratch tree every 0.1 s "
        "and kills a session over scratch_mb or max_files, so a session can pass them between samples (files "
        "fill at the disk's speed); files deleted while held open count through the session's descriptors, but a "
        "deleted file only mapped, its descriptor closed, is not seen",
        "private process list: other processes' command lines and status are visible in /proc (not their "
        "memory, environment or descriptors), and stat() and access() answer for any path (Landlock governs "
        "reads and writes, not metadata)",
        "metadata changes in the scratch: chmod, chown, utime, extended attributes and inode flags are refused "
        "everywhere (a seccomp filter cannot tell the scratch from the trainer's files), so shutil.copy (which "
        "copies the mode) fails where shutil.copyfile works; memfd_create, SysV shared memory, semaphores and "
        "message queues and POSIX message queues are refused (no memory cgroup would count them)",
        "memory bound of a session as a whole, and its task bound, enforced at once (where no memory or pids "
        "cgroup is writable): the zygote samples each session's processes every 0.1 s and kills one over memory_mb of "
        "private resident memory or max_processes tasks (threads included), so a session can exceed them between "
        "samples; each process is also bounded by memory_mb of address space; pipe and socket buffers are kernel "
        "memory bounded only by the open-file limits (max_open_files per process)",
    ]
    if may_watch_other_uids() and not can_drop_privileges(worker):
        # Root, but the interpreter is readable by root only: each session still gets a uid of its own, and reaches
        # the interpreter through descriptors it opened while still root (no capability kept); Landlock's rules
        # bound what it reads and writes. A container's root, without CAP_SYS_PTRACE, watches it through its fsuid
        # (`fsuid.py`).
        rules["read_override"] = True
    elif not can_drop_privileges(worker):
        why = (
            "the trainer is root that may not change uids, or the kernel refuses it the /proc files of a process "
            "of another uid: sessions run as uid 0 without any capability"
            if os.geteuid() == 0
            else "the trainer is a normal user: sessions run as that user"
        )
        nproc_root = ", and not uid 0's" if os.geteuid() == 0 else ""
        missing.append(
            f"own uid per session ({why}); sessions share a uid and Landlock and the seccomp filter keep them apart, "
            f"but no immediate per-session task cap (RLIMIT_NPROC counts a uid's tasks{nproc_root}) bounds a fork "
            "or thread bomb between the zygote's samples"
        )
    families = FAMILIES_IN_A_NETWORK_NAMESPACE if network else FAMILIES_WITHOUT_NAMESPACES
    return Launch("landlock", [], None, rules, families, missing, confined_owner=True)


def seccomp_problem() -> str | None:
    """The Landlock level leans on seccomp for the network (no IP sockets): without a filter it is no level."""
    from .seccomp import FAMILIES_WITHOUT_NAMESPACES, seccomp_program

    why = seccomp_program(FAMILIES_WITHOUT_NAMESPACES, confined_owner=True)[1]
    return None if why is None else f"no seccomp filter ({why}; pip install pyseccomp and libseccomp2)"


class LandlockLevel(IsolationLevel):
    """What `isolation="auto"` takes where bubblewrap cannot make namespaces: no privilege needed, reads and writes
    confined by each session's own Landlock rules; namespaces per session only where the trainer is root."""

    name = "landlock"
    title = "Landlock"
    filesystem_confined = True

    def problem(self, network: bool) -> str | None:
        return landlock_problem() or seccomp_problem()

    def launch(self, worker: str, network: bool, writable: tuple[str, ...], why: str) -> Launch:
        return launch(worker, network)


LEVEL = LandlockLevel()
