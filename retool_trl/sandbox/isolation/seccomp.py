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
def seccomp_program(families: tuple[int, ...] = FAMILIES_IN_A_NETWORK_NAMESPACE) -> tuple[bytes | None, str | None]:
    """The sessions' seccomp filter as classic BPF (built here with libseccomp through `pyseccomp`), or why not.

    Denies new namespaces (user namespaces above all), mounts, ptrace, kexec, keyrings, bpf, perf, module loading,
    io_uring (whose operations seccomp cannot see), Linux AIO (a host-wide quota), flock, and sockets of every family
    but `families` (EAFNOSUPPORT, as a kernel without that family would answer); everything else is allowed."""
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
