"""How a jail is made here. Host side: this code runs in the trainer, which picks the level and builds the zygote's
launch; what each session applies inside runs from `..jail`. May import the standard library, `pyseccomp` and the
shared pieces of `..jail`. One module per isolation level behind one small interface, and what they share.

Each level has `launch(...) -> Launch` (how the zygote is started, what each session applies inside, what does not
hold); `bubblewrap` and `landlock` also have a `problem` check (None when the level runs on this host, else why not).
`isolation="auto"` takes the first that runs: bubblewrap (namespaces: a private file system and network), then
Landlock (no privilege needed: a default container, a normal user without user namespaces), else none of them, which
the sandbox refuses unless asked for. The jail side of each level is in `jail/jail_setup.py` (namespaces),
`jail/landlock.py` (`restrict_self`) and `jail/session_process.py` (uids, rlimits, seccomp, subreaper).
"""

from __future__ import annotations

from . import bubblewrap, none
from . import landlock as landlock_level
from .bubblewrap import bwrap_command, bwrap_usable, find_bwrap
from .common import (
    ISOLATION_MODES,
    SANDBOX_SCRATCH_ROOT,
    Launch,
    can_drop_privileges,
    clean_env,
    isolation_summary,
    needed_under_temp,
    warn_once,
)
from .seccomp import seccomp_program

__all__ = [
    "ISOLATION_MODES",
    "SANDBOX_SCRATCH_ROOT",
    "Launch",
    "bwrap_command",
    "bwrap_usable",
    "can_drop_privileges",
    "choose_level",
    "clean_env",
    "find_bwrap",
    "isolation_summary",
    "needed_under_temp",
    "seccomp_program",
    "warn_once",
]


def choose_level(mode: str, worker: str, network: bool, writable: tuple[str, ...]) -> tuple[Launch | None, list[str]]:
    """The level `mode` resolves to on this host, and why each stronger level does not run here.

    Returns `(None, problems)` when `mode` names a level that does not run, or `"auto"` finds neither bubblewrap
    nor Landlock: the caller decides between refusing and the level without isolation."""
    problems = []
    if mode in ("auto", "bwrap"):
        problem = bubblewrap.problem(network)
        if problem is None:
            return bubblewrap.launch(worker, network, writable), problems
        problems.append(f"bubblewrap: {problem}")
        if mode == "bwrap":
            return None, problems
    if mode in ("auto", "landlock"):
        problem = landlock_level.landlock_problem() or _seccomp_problem()
        if problem is None:
            return landlock_level.launch(worker, network), problems
        problems.append(f"Landlock: {problem}")
        return None, problems
    return none.launch(worker, network, "isolation='none' was asked for"), problems


def _seccomp_problem() -> str | None:
    """The Landlock level leans on seccomp for the network (no IP sockets): without a filter it is no level."""
    from .seccomp import FAMILIES_WITHOUT_NAMESPACES

    why = seccomp_program(FAMILIES_WITHOUT_NAMESPACES, confined_owner=True)[1]
    return None if why is None else f"no seccomp filter ({why}; pip install pyseccomp and libseccomp2)"
