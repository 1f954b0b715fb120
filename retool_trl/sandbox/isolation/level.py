"""What the sandbox asks of an isolation level, and the one registry of levels. Host side.

Each level is an object defined in its own module (`bubblewrap.py`, `landlock.py`, `none.py`): the pool reads its
facts and calls its methods, and never looks at a level's name to decide what the level means, so a new level is one
module plus its place in `LEVELS`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .common import Launch, can_drop_privileges


class IsolationLevel:
    """One way of making a session's jail, and what it means for the pool.

    Facts (class attributes): `name` (the value of `isolation=` and of the report's `"isolation"`); `title` (how a
    report names the level when it does not run here: "<title>: <why not>"); `auto` (whether `isolation="auto"` may
    take it, in the registry's order); `fallback` (what `"auto"` runs when no level it may take runs here, refused as
    root unless the user opts in); `private_filesystem` (cells see a private read-only view of the host);
    `filesystem_confined` (cells read only what the interpreter needs and write only their scratch, or see the
    private view); `always_jails` (the zygote tries namespaces of its own for each session whoever the trainer is;
    otherwise only as root); `root_needs_opt_in` (as root, refused without `allow_root_without_isolation`)."""

    name = ""
    title = ""
    auto = True
    fallback = False
    private_filesystem = False
    filesystem_confined = False
    always_jails = False
    root_needs_opt_in = False

    def problem(self, network: bool) -> str | None:
        """None when the level runs on this host, else why not."""
        return None

    def launch(self, worker: str, network: bool, writable: tuple[str, ...], why: str) -> Launch:
        """How the zygote starts and what each session applies. `writable`: the sandbox's own cgroup directories;
        `why`: why each stronger level does not run here ("" when this level was asked for by name)."""
        raise NotImplementedError

    def jails(self) -> bool:
        """Whether the zygote tries namespaces of its own for each session (root may make them on any level; the
        zygote goes on without them, with a warning, where the kernel refuses them)."""
        return self.always_jails or os.geteuid() == 0

    def drops_privileges(self, launch: Launch, worker: str) -> bool:
        """Whether sessions run under uids of their own: where the trainer may watch other uids and others can reach
        the interpreter, or where the level's sessions reach it through descriptors opened while still root."""
        return can_drop_privileges(worker) or bool((launch.landlock or {}).get("read_override"))

    def root_refusal(self, why: str, fell_back: bool) -> str | None:
        """Why the pool refuses to run cells on this level as root without the user's opt-in, or None."""
        return None

    def warning(self, why: str, drops_privileges: bool) -> str | None:
        """What to warn about once when this level is in force (a degraded level), or None."""
        return None


@dataclass(frozen=True)
class Choice:
    """The level an `isolation=` value resolves to here (None: the level named does not run), why each stronger
    level does not run, and whether `"auto"` fell back to the level without isolation."""

    level: IsolationLevel | None
    problems: tuple[str, ...] = ()
    fell_back: bool = False

    @property
    def why(self) -> str:
        return "; ".join(self.problems)


# Every level, in the order `isolation="auto"` tries them (filled by `isolation/__init__.py`; `register` adds more).
LEVELS: list[IsolationLevel] = []


def register(level: IsolationLevel, before: str | None = None) -> IsolationLevel:
    """Adds `level` to the registry: last, or just before the level named `before` (for `"auto"`'s order)."""
    if any(known.name == level.name for known in LEVELS):
        raise ValueError(f"an isolation level named {level.name!r} is already registered")
    names = [known.name for known in LEVELS]
    LEVELS.insert(names.index(before) if before is not None else len(LEVELS), level)
    return level


def isolation_modes() -> tuple[str, ...]:
    """The values `isolation=` accepts: `"auto"`, then each level's name."""
    return ("auto", *(level.name for level in LEVELS))


def choose_level(mode: str, network: bool) -> Choice:
    """The level `mode` resolves to on this host: the level it names, if it runs; for `"auto"`, the first level that
    may be taken and runs, else the fallback level. Each level that does not run says why in `problems`."""
    problems: list[str] = []
    for level in LEVELS:
        if mode != level.name and not (mode == "auto" and level.auto):
            continue
        problem = level.problem(network)
        if problem is None:
            return Choice(level, tuple(problems))
        problems.append(f"{level.title}: {problem}")
        if mode == level.name:
            return Choice(None, tuple(problems))
    fallback = next((level for level in LEVELS if level.fallback), None) if mode == "auto" else None
    return Choice(fallback, tuple(problems), fell_back=fallback is not None)
