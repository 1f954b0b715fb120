"""How a jail is made here. Host side: this code runs in the trainer, which picks the level and builds the zygote's
launch; what each session applies inside runs from `..jail`. May import the standard library, `pyseccomp` and the
shared pieces of `..jail`. One module per isolation level behind one small interface, and what they share.

Each level is an `IsolationLevel` object (`level.py`) in its own module, holding its facts (private file system,
confined reads and writes, namespaces per session, root refusal) and its `problem` check and `launch(...) -> Launch`
(how the zygote is started, what each session applies inside, what does not hold). `LEVELS` lists them in the order
`isolation="auto"` tries them: bubblewrap (namespaces: a private file system and network), then Landlock (no
privilege needed: a default container, a normal user without user namespaces), else the level without isolation,
which the sandbox refuses as root unless asked for. The jail side of each level is in `jail/jail_setup.py`
(namespaces), `jail/landlock.py` (`restrict_self`) and `jail/session_process.py` (uids, rlimits, seccomp, subreaper).
"""

from __future__ import annotations

from . import bubblewrap, none
from . import landlock as landlock_level
from .bubblewrap import bwrap_command, bwrap_usable, find_bwrap
from .common import (
    SANDBOX_SCRATCH_ROOT,
    Launch,
    can_drop_privileges,
    clean_env,
    isolation_summary,
    needed_under_temp,
    warn_once,
)
from .level import LEVELS, Choice, IsolationLevel, choose_level, isolation_modes, register
from .seccomp import seccomp_program

# The order `isolation="auto"` tries them; the level without isolation is its fallback, never its choice.
for _level in (bubblewrap.LEVEL, landlock_level.LEVEL, none.LEVEL):
    register(_level)
del _level

# The values `isolation=` accepts with the shipped levels (`isolation_modes()` also counts levels registered later).
ISOLATION_MODES = isolation_modes()

__all__ = [
    "ISOLATION_MODES",
    "LEVELS",
    "SANDBOX_SCRATCH_ROOT",
    "Choice",
    "IsolationLevel",
    "Launch",
    "bwrap_command",
    "bwrap_usable",
    "can_drop_privileges",
    "choose_level",
    "clean_env",
    "find_bwrap",
    "isolation_modes",
    "isolation_summary",
    "needed_under_temp",
    "register",
    "seccomp_program",
    "warn_once",
]
