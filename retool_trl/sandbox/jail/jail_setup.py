"""How a jail is built, from the inside: the namespaces, mounts, seccomp filter and the probe for whether this machine
can build jails at all. Stdlib-only; imported (as a sibling script module) by `session_process.py` and `worker.py`
inside the sandbox, never by the trainer.
"""

import ctypes
import fcntl
import os
import socket
import struct

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = (
    0x20000,
    0x4000000,
    0x8000000,
    0x20000000,
    0x40000000,
)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1,
    2,
    4,
    8,
    32,
    4096,
    0x4000,
    1 << 18,
)
_PRIVATE_TEMP = ("/tmp", "/dev/shm", "/var/tmp")
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
libc = ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def prctl(option, value):
    libc.prctl(option, value, 0, 0, 0)


def mount(source, target, fstype, flags=0, data=None):
    def enc(text):
        return None if text is None else text.encode()

    check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def enter_jail(config):
    """Own mount/network/IPC/UTS namespaces (the pid namespace came with the fork): private size-bounded temp
    directories, a fresh /proc that shows only this jail, and a loopback interface that is up and reaches nothing."""
    network = 0 if config.get("network") else CLONE_NEWNET  # LocalSandbox(network=True) keeps the host's network
    check(libc.unshare(CLONE_NEWNS | network | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    tmpfs = f"size={config['scratch_mb']}m,nr_inodes={config['max_files']},mode=1777"
    # What the interpreter needs from under a temp directory (a virtual environment or checkout under /tmp): held
    # open across the private tmpfs mounts, then bound back read-only at the same place.
    kept = []
    for path in config.get("needed_under_temp", ()):
        try:
            kept.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
        except OSError:
            pass
    for target in _PRIVATE_TEMP:
        if os.path.isdir(target):
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    for path, fd in kept:
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if os.path.isdir("/dev/pts"):  # its own pseudo-terminals (bubblewrap's one instance is every jail's), 8 at most
        mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620,max=8")
    if os.path.isdir("/sys/fs/cgroup"):  # every session's (and other trainers') usage: not the cells' business
        mount("tmpfs", "/sys/fs/cgroup", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=555")
    if network:
        with socket.socket() as s:  # SIOCSIFFLAGS lo IFF_UP|IFF_RUNNING
            fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x40, b""))


def install_seccomp(program):
    """Loads a classic-BPF seccomp filter (built on the host with libseccomp) for this process and its children."""
    filt = ctypes.create_string_buffer(program)

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(len(program) // 8, ctypes.cast(filt, ctypes.c_void_p))
    check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")


def probe_jail():
    """Whether this process can build jails (namespaces and mounts need root, or a user namespace's root)."""
    if os.geteuid() != 0:
        return "not root"
    pid = os.fork()
    if pid == 0:
        try:
            check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID), "unshare")
            mount(None, "/", None, MS_REC | MS_PRIVATE)
            mount("tmpfs", "/tmp", "tmpfs", 0, "size=1m")
            os._exit(0)
        except BaseException:  # noqa: B036
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return None if status == 0 else "unshare or mount failed"
