"""The seccomp filter every session installs, whatever the level: built on the trainer's side with libseccomp."""

from __future__ import annotations

from functools import lru_cache

# Denied inside a session (EPERM; clone3 ENOSYS so that libc falls back to clone, whose flags a filter can see).
_DENIED_SYSCALLS = (
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kexec_load",
    "kexec_file_load",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "open_by_handle_at",
    "name_to_handle_at",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # Host-wide kernel quotas a parked session could drain (fs.aio-max-nr), and locks on host files that the trainer
    # or other sessions may want (a read-only descriptor is enough for flock).
    "io_setup",
    "io_destroy",
    "io_submit",
    "io_cancel",
    "io_getevents",
    "io_pgetevents",
    "flock",
    "quotactl",
    "lookup_dcookie",
)
# The Landlock level only (`confined_owner`): there a session may own files and processes outside its scratch (uid 0
# in a container owns root's files and the trainer; a normal user's sessions share the trainer's uid), and neither
# Landlock nor the file modes stop an owner. Refused with EPERM:
# - every call that changes a file's metadata (modes, owners, times, extended attributes and inode flags), which
#   Landlock does not govern: inside the scratch too, since a filter cannot see paths;
_METADATA_SYSCALLS = (
    "chmod",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "chown",
    "fchown",
    "lchown",
    "fchownat",
    "utime",
    "utimes",
    "utimensat",
    "futimesat",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
)
# (by number where libseccomp does not know them: the distributions' libseccomp 2.5 predates memfd_secret and
# fchmodat2, and none knows setxattrat, removexattrat or file_setattr yet; the same numbers on every architecture since
# the tables were unified at 424)
_METADATA_SYSCALL_NUMBERS = {
    "memfd_secret": 447,
    "fchmodat2": 452,
    "setxattrat": 463,
    "removexattrat": 466,
    "file_setattr": 469,
}
_SET_INODE_FLAGS_IOCTLS = (0x40086602, 0x40046602, 0x401C5820)  # FS_IOC_SETFLAGS, FS_IOC32_SETFLAGS, FS_IOC_FSSETXATTR
# - memory that no process's resident set shows and no rlimit bounds, which outlives the processes that made it
#   (memfd files passed around, SysV segments and queues, POSIX message queues): without a memory cgroup nothing
#   would count it against memory_mb;
_UNCOUNTED_MEMORY_SYSCALLS = ("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "mq_open")
# - watches on the file system (inotify and fanotify marks): a watch on the shared scratch root would name every
#   neighbour's scratch directory as it is made, and then report its file activity;
_WATCH_SYSCALLS = ("inotify_add_watch", "fanotify_mark")
# - calls that change another process of the same uid (its limits, CPUs, priority, scheduling) that Landlock's
#   scoping does not cover: allowed on the caller itself (pid 0) only.
_SELF_ONLY_SYSCALLS = ("prlimit64", "sched_setaffinity", "sched_setparam", "sched_setscheduler", "sched_setattr")
_PRIO_PROCESS, _IOPRIO_WHO_PROCESS = 0, 1
_CLONE_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
# Socket families a session may open. Only these three are confined by a network namespace: AF_VSOCK (the VM's
# host channel), AF_NETLINK's audit and uevent groups, AF_PACKET on a shared network, AF_ALG, AF_BLUETOOTH and the
# rest reach past it. Where no namespace is made (the Landlock level) only AF_UNIX remains, and Landlock scopes its
# abstract names to the session.
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
FAMILIES_IN_A_NETWORK_NAMESPACE = (AF_UNIX, AF_INET, AF_INET6)
FAMILIES_WITHOUT_NAMESPACES = (AF_UNIX,)
_AF_MAX = 64  # above AF_MAX (46 in Linux 6.x): the kernel refuses them anyway; denied here all the same


@lru_cache(maxsize=4)
def seccomp_program(
    families: tuple[int, ...] = FAMILIES_IN_A_NETWORK_NAMESPACE, confined_owner: bool = False
) -> tuple[bytes | None, str | None]:
    """The sessions' seccomp filter as classic BPF (built here with libseccomp through `pyseccomp`), or why not.

    Denies new namespaces (user namespaces above all), mounts, ptrace, kexec, keyrings, bpf, perf, module loading,
    io_uring (whose operations seccomp cannot see), Linux AIO (a host-wide quota), flock, and sockets of every family
    but `families` (EAFNOSUPPORT, as a kernel without that family would answer); everything else is allowed. With
    `confined_owner` (the Landlock level) also metadata changes, uncounted shared memory, file-system watches and
    calls on other processes (see `_METADATA_SYSCALLS`)."""
    try:
        import pyseccomp as seccomp
    except Exception as exc:  # noqa: BLE001 - not installed, or libseccomp missing
        return None, f"pyseccomp/libseccomp unavailable ({exc})"
    import errno
    import tempfile

    try:
        rules = seccomp.SyscallFilter(seccomp.ALLOW)
        for name in _DENIED_SYSCALLS:
            try:
                rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
            except Exception:  # noqa: BLE001, S112 - a syscall this architecture or libseccomp does not know
                continue
        for bit in range(32):  # one rule per namespace flag: any of them set is refused
            if _CLONE_NAMESPACE_FLAGS >> bit & 1:
                flag = seccomp.Arg(0, seccomp.MASKED_EQ, 1 << bit, 1 << bit)
                rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", flag)
        rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        if confined_owner:
            _add_owner_rules(seccomp, rules, errno.EPERM)
        for family in range(_AF_MAX):
            if family not in families:
                for call in ("socket", "socketpair"):
                    rules.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), call, seccomp.Arg(0, seccomp.EQ, family))
        with tempfile.TemporaryFile() as f:
            rules.export_bpf(f)
            f.seek(0)
            return f.read(), None
    except Exception as exc:  # noqa: BLE001
        return None, f"could not build the seccomp filter: {exc}"


def _add_owner_rules(seccomp, rules, eperm: int) -> None:
    """The `confined_owner` part of the filter (see `_METADATA_SYSCALLS`)."""
    deny = seccomp.ERRNO(eperm)
    names = (*_METADATA_SYSCALLS, *_UNCOUNTED_MEMORY_SYSCALLS, *_WATCH_SYSCALLS, *_METADATA_SYSCALL_NUMBERS)
    for name in dict.fromkeys(names):
        number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
        if number < 0:
            number = _METADATA_SYSCALL_NUMBERS.get(name, -1)
        if number >= 0:
            rules.add_rule(deny, number)
    for request in _SET_INODE_FLAGS_IOCTLS:
        rules.add_rule(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
    for name in _SELF_ONLY_SYSCALLS:
        rules.add_rule(deny, name, seccomp.Arg(0, seccomp.NE, 0))
    rules.add_rule(deny, "setpriority", seccomp.Arg(0, seccomp.NE, _PRIO_PROCESS))
    rules.add_rule(deny, "setpriority", seccomp.Arg(1, seccomp.NE, 0))
    rules.add_rule(deny, "ioprio_set", seccomp.Arg(0, seccomp.NE, _IOPRIO_WHO_PROCESS))
    rules.add_rule(deny, "ioprio_set", seccomp.Arg(1, seccomp.NE, 0))
