"""What every isolation level shares: the sessions' clean environment, the paths the interpreter needs, whether
sessions can get uids of their own, and the once-per-process warning for a degraded level."""

from __future__ import annotations

import logging
import os
import stat
import sys
import sysconfig
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

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


def has_capability(cap: int) -> bool:
    """Whether this process holds capability `cap` (its number) in its effective set."""
    with open("/proc/self/status") as f:
        effective = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    return bool(effective >> cap & 1)


CAP_SETUID, CAP_SYS_PTRACE = 7, 19


def may_watch_other_uids() -> bool:
    """Root that may change uids and still watch a session of another uid (the trainer reads /proc/PID/syscall,
    which needs ptrace access): with CAP_SYS_PTRACE, or without it (a container runtime's root) through the
    session's own uid as the reader's fsuid (`fsuid.py`, tried once on a stand-in)."""
    if os.geteuid() != 0 or not has_capability(CAP_SETUID):
        return False
    from . import fsuid

    return has_capability(CAP_SYS_PTRACE) or fsuid.works()


def can_drop_privileges(worker: str) -> bool:
    """Without bubblewrap, whether sessions can run under their own uid: we must be root that may watch other uids
    (`may_watch_other_uids`) and the interpreter and its libraries must be reachable by other users (not under a
    mode-700 home)."""
    return may_watch_other_uids() and not _hidden_roots(_needed_paths(worker), ())


@dataclass(frozen=True)
class Launch:
    """What a level hands the sandbox: how the zygote is started and what each session applies inside its jail.

    `command` goes before the interpreter (empty: the zygote runs directly); `scratch_root` is where sessions'
    scratch directories live (None: a host temp directory of the sandbox's own); `landlock` holds the rules each
    session applies (None: no Landlock); `socket_families` are the socket families the seccomp filter leaves;
    `missing` lists, in words, the protections of the isolation contract this level cannot give on this host;
    `confined_owner`: sessions may own what lies outside their scratch (the Landlock level), so the seccomp filter
    also refuses metadata changes, uncounted shared memory and calls on other processes (`seccomp.py`)."""

    level: str
    command: list[str]
    scratch_root: str | None
    landlock: dict | None = None
    socket_families: tuple[int, ...] = (1,)
    missing: list[str] = field(default_factory=list)
    confined_owner: bool = False

    def seccomp(self) -> tuple[bytes | None, str | None]:
        """The sessions' seccomp filter on this level, or why there is none (`seccomp.seccomp_program`)."""
        from .seccomp import seccomp_program

        return seccomp_program(self.socket_families, self.confined_owner)

    @property
    def ip_sockets_refused(self) -> bool:
        """Whether cells cannot open an IP socket at all: the seccomp filter applies and leaves neither AF_INET nor
        AF_INET6 (the Landlock level: the host's network stays, out of the cells' reach)."""
        import socket

        ip = {socket.AF_INET, socket.AF_INET6}
        return self.seccomp()[0] is not None and not ip & set(self.socket_families)


# The flags of `LocalSandbox.isolation_report()` in words, for its one-line `summary` (what holds, what does not).
_FLAG_WORDS = {
    "jail_per_session": "namespaces of its own per session",
    "filesystem_confined": "reads and writes confined to what the interpreter needs",
    "network_isolated": "no network",
    "own_uid_per_session": "a uid of its own per session",
    "seccomp": "seccomp filter",
    "memory_cgroup": "memory bounded by a cgroup",
    "pids_cgroup": "process count bounded by a cgroup",
}


def isolation_summary(report: dict) -> str:
    """One line a person reads first: the level, the protections that hold, those that do not (the list
    `missing` says each in full)."""
    holds = [words for flag, words in _FLAG_WORDS.items() if report.get(flag)]
    lacks = [words for flag, words in _FLAG_WORDS.items() if not report.get(flag)]
    text = f"isolation level {report.get('isolation')}: holds: {', '.join(holds) or 'nothing of the contract'}"
    if lacks:
        text += f"; does not hold: {', '.join(lacks)} (each in full under 'missing')"
    return text + "."
