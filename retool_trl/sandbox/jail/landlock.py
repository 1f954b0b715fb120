"""The Landlock level, for hosts where namespaces are refused (root in a default Docker/podman container, a normal
user without user namespaces): no privilege is needed. Each session restricts itself with Landlock (read only what
the interpreter needs, write only its own scratch directory, no TCP bind/connect, signals and abstract UNIX sockets
scoped to the session), on top of the seccomp filter (no socket family but AF_UNIX), a subreaper, rlimits and, where
the process may change uid, a uid of its own.

Jail side, stdlib-only: `restrict_self` runs in each session process (`session_process.py` imports this file as a
sibling script module); the trainer's Landlock level (`isolation/landlock.py`) reads the ABI and builds the rules
with the same functions, so both sides agree on the rights. The syscalls go through ctypes: the only Python binding
on PyPI (`landlock`) is a pre-release, and the jail side must not import third-party packages.
"""

import ctypes
import os
import struct
import sys

# Syscall numbers of the generic table (x86-64 and aarch64 alike).
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

# File-system rights by the ABI that introduced them (kernel versions in docs/sandbox.md).
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_ABI1_FS = (1 << 13) - 1  # execute ... make_sym
_REFER, _TRUNCATE, _IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_RESOLVE_UNIX = 1 << 16  # connect()/sendmsg() to a pathname UNIX socket (ABI 9): allowed only under the scratch
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | _TRUNCATE | _IOCTL_DEV  # the rights a rule on a file may carry
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2
READ = EXECUTE | READ_FILE | READ_DIR

# What a session reads besides the interpreter's own directories: shared libraries and the programs a cell may run,
# /proc (its own entries; others' memory, environment and descriptors stay behind Landlock's ptrace rule), the
# dynamic loader's cache, time zones, the user and host name tables. Never the rest of /etc, /root, /home or /run.
SYSTEM_READ = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/proc", "/sys/devices/system/cpu")
ETC_READ = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/mime.types",
    "/etc/os-release",
)
DEVICES_RW = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi_version():
    """The kernel's Landlock ABI (0: none, disabled at boot, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    version = _libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(0, int(version))


def handled_fs(abi):
    rights = _ABI1_FS
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    if abi >= 5:
        rights |= _IOCTL_DEV
    if abi >= 9:
        rights |= _RESOLVE_UNIX
    return rights


def not_enforced(abi):
    """What this kernel's Landlock cannot enforce, in words (each later ABI adds a protection)."""
    gaps = []
    if abi < 3:
        gaps.append("truncating readable files (Landlock ABI 3, Linux 6.2)")
    if abi < 4:
        gaps.append("TCP bind/connect rules (Landlock ABI 4, Linux 6.7; seccomp still refuses IP sockets)")
    if abi < 6:
        gaps.append(
            "signals and abstract UNIX sockets scoped to the session (Landlock ABI 6, Linux 6.12; only a uid of "
            "its own keeps sessions from signalling each other)"
        )
    if abi < 9:
        gaps.append(
            "connect() and sendmsg() to pathname UNIX sockets outside the session's scratch (Landlock ABI 9, after "
            "Linux 6.18; earlier kernels check only creating them): a session reaches every socket whose file "
            "modes let its uid write it (a socket of mode 0666, or, where sessions share the trainer's uid, the "
            "trainer's own sockets), and /proc/net/unix lists their paths"
        )
    return gaps


def landlock_problem():
    """None when this kernel gives Landlock to an unprivileged process, else the missing feature and its fix."""
    abi = abi_version()
    if abi < 1:
        return (
            "the kernel has no Landlock (needs Linux 5.13+ built with CONFIG_SECURITY_LANDLOCK and 'landlock' in the "
            "lsm= boot parameter)"
        )
    return None


def landlock_rules(read, write, abi=None):
    """The rules a session applies (JSON-able): paths it may read (and execute), paths it may write, and the ABI."""
    return {"abi": abi_version() if abi is None else abi, "read": list(read), "write": list(write)}


def open_rule_paths(rules):
    """`{path: O_PATH descriptor}` for each readable path of `rules` that exists: opened before the session drops
    root, so that a path only root can reach (a virtual environment under a mode-700 /root) is still ruled, and
    still reachable through the descriptor, by a session that keeps no capability."""
    held = {}
    for path in rules["read"]:
        try:
            held[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            pass  # absent on this machine (no /lib32, say): nothing to allow
    return held


def _add_path_rule(ruleset, path, rights, handled, held=None):
    try:
        fd = os.dup(held[path]) if held and path in held else os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # absent on this machine (no /lib32, say): nothing to allow
    try:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            rights &= _FILE_RIGHTS
        attr = struct.pack("=Qi", rights & handled, fd)
        buf = ctypes.create_string_buffer(attr, len(attr))
        if _libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, buf, ctypes.c_uint32(0)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"landlock_add_rule {path}: {os.strerror(code)}")
    finally:
        os.close(fd)


def restrict_self(rules, scratch, held=None):
    """Applies the session's Landlock domain to this process and all it starts (needs no_new_privs first): reads and
    executes under `rules["read"]`, writes under `rules["write"]` and `scratch` only; on ABI 4+ no TCP bind or
    connect at all; on ABI 6+ no signal to, and no abstract UNIX socket of, a process outside the session; on ABI 9+
    no connect() or sendmsg() to a pathname UNIX socket outside `scratch`. `held`: the read paths opened beforehand
    (`open_rule_paths`)."""
    abi = int(rules["abi"])
    handled = handled_fs(abi)
    attr = struct.pack("=Q", handled)
    if abi >= 4:
        attr += struct.pack("=Q", _NET_BIND_TCP | _NET_CONNECT_TCP)
    if abi >= 6:
        attr += struct.pack("=Q", _SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _libc.syscall(_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"landlock_create_ruleset: {os.strerror(code)}")
    try:
        for path in rules["read"]:
            _add_path_rule(ruleset, path, READ, handled, held)
        for path in [*rules["write"], scratch]:
            _add_path_rule(ruleset, path, handled & ~_REFER | READ, handled)
        if _libc.syscall(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"landlock_restrict_self: {os.strerror(code)}")
    finally:
        os.close(ruleset)
