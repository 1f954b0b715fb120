"""Watching a session of another uid without CAP_SYS_PTRACE (root in a default container). Host side.

The trainer learns that a call is over from `/proc/PID/syscall`, which the kernel shows only to a reader that may
ptrace the process: the same uid (the reader's fsuid) with every capability the process holds in its effective set,
and a process that is dumpable; or CAP_SYS_PTRACE, which container runtimes do not grant. So a session under a uid of
its own stays dumpable (`session_process.py`), and the trainer reads that file with its fsuid and fsgid set to the
session's uid and its effective capabilities raised back to its permitted ones (a nonzero fsuid drops the file
capabilities, which the trainer needs again right after), for that one read and on that thread only. Sessions keep
no capability, so the reader's always cover theirs. Six system calls, a few microseconds, once per look at a
call's end.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import subprocess
import sys
import time
from functools import lru_cache

_CAP_HEADER = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
_CAP_SETGID, _CAP_SETUID, _CAP_SYS_PTRACE = 6, 7, 19


def _has(cap: int) -> bool:
    """Whether this process holds capability `cap` in its effective set (as `common.has_capability`, which imports
    this module)."""
    with open("/proc/self/status") as f:
        effective = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    return bool(effective >> cap & 1)


@lru_cache(maxsize=1)
def _calls():
    """libc, and the capset arguments that raise the effective set to the permitted one and restore it."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = ctypes.create_string_buffer(_CAP_HEADER, 8), ctypes.create_string_buffer(24)
    if libc.capget(header, data):
        raise OSError(ctypes.get_errno(), "capget")
    effective0, permitted0, inheritable0, effective1, permitted1, inheritable1 = struct.unpack("6I", data.raw)
    raised = struct.pack("6I", permitted0, permitted0, inheritable0, permitted1, permitted1, inheritable1)
    return libc, header, ctypes.create_string_buffer(raised, 24), ctypes.create_string_buffer(data.raw, 24)


@lru_cache(maxsize=1)
def needed() -> bool:
    """Whether reading a session of another uid needs `pread_as` here: root without CAP_SYS_PTRACE."""
    return os.geteuid() == 0 and not _has(_CAP_SYS_PTRACE)


def pread_as(uid: int | None, fd: int, size: int) -> bytes:
    """`os.pread(fd, size, 0)` with this thread's fsuid and fsgid set to `uid` (see the module's docstring); a plain
    `pread` where `uid` is None."""
    if uid is None:
        return os.pread(fd, size, 0)
    with acting_as(uid):
        return os.pread(fd, size, 0)


@contextlib.contextmanager
def acting_as(uid: int | None):
    """Runs the body with this thread's fsuid and fsgid set to `uid` and its permitted capabilities effective, as
    `pread_as` does (nothing where None): to open a session's `/proc/PID/fd/N`, say, which asks the same as its
    `syscall` file. Whatever raises in the window (the body, or a signal handler: a Ctrl-C's KeyboardInterrupt runs
    at any bytecode of the main thread), the thread's own ids and capabilities are restored before it propagates;
    the restore is checked, and one that did not take raises."""
    if uid is None:
        yield
        return
    libc, header, raised, original = _calls()
    try:
        libc.setfsgid(uid)
        libc.setfsuid(uid)
        libc.capset(header, raised)
        yield
    finally:
        libc.setfsuid(os.geteuid())
        libc.setfsgid(os.getegid())
        restored = libc.capset(header, original) == 0
        # setfsuid/setfsgid of an invalid id change nothing and return the current one.
        if not restored or libc.setfsuid(-1) != os.geteuid() or libc.setfsgid(-1) != os.getegid():
            raise OSError("could not restore the trainer thread's file-system ids and capabilities")


# A stand-in session: its own uid, no capability (as a session), dumpable, blocked reading stdin.
_PROBE_CHILD = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid = int(sys.argv[1])
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
libc.prctl(4, 1, 0, 0, 0)
os.write(1, b"1")
os.read(0, 1)
"""


@lru_cache(maxsize=1)
def works() -> bool:
    """Whether this trainer can watch a session of another uid through `pread_as` (tried once on a stand-in: a
    kernel with Yama's ptrace_scope 2, or a security module in the way, says no)."""
    if not needed() or not (_has(_CAP_SETGID) and _has(_CAP_SETUID)):
        return False
    uid = 0x7FFF0000 + os.getpid() % 0xFFFF
    try:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _PROBE_CHILD, str(uid)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={},
        )
    except OSError:
        return False
    try:
        if child.stdout.read(1) != b"1":  # set up (or dead): from now on a refusal is the kernel's answer
            return False
        fd = os.open(f"/proc/{child.pid}/syscall", os.O_RDONLY)
        try:
            for _ in range(2500):  # until it blocks in its read (5 s at most)
                if len(pread_as(uid, fd, 256).split()) == 9:  # "nr arg0 ... arg5 sp pc" while in a system call
                    return True
                time.sleep(0.002)
        finally:
            os.close(fd)
        return False
    except OSError:
        return False
    finally:
        child.kill()
        child.communicate()
