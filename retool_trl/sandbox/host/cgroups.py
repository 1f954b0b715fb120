"""Cgroups for the local sandbox: per session a memory bound, a process bound, a CPU share and a freezer; for the
whole sandbox a memory bound, where the machine lets us.

The host makes one directory per `LocalSandbox` below its own cgroup (cgroup v1 `memory`, `pids`, `freezer`, `cpu`
and `cpuacct` hierarchies, or the v2 unified one where its controllers are delegated to us); the zygote makes one
directory per session below that and moves the session's process in. The freezer (v2: `cgroup.freeze`) lets the
host stop a jail's every process at once; `cpuacct` (v2: `cpu.stat`) counts the CPU of all of them. Where nothing is
writable, the per-process rlimits are all that bound a session. Directories of sandboxes whose trainer died (a
SIGKILL leaves them behind) are removed when the next sandbox starts. What the machine leaves this process is read in
`machine_limits.py`; freezing and killing a cgroup's processes is `cgroup_control.py`.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from .cgroup_control import v1_end_jails, v2_kill
from .machine_limits import _ROOT, _own_path, sandbox_task_limit, task_budget

__all__ = ["SandboxCgroups", "make_v2_sandbox"]

# v1 hierarchies we use, by the kind name the zygote knows them under.
_V1 = (("memory", "memory1"), ("pids", "pids"), ("freezer", "freezer"), ("cpu", "cpu"), ("cpuacct", "cpuacct"))
_V2_CONTROLLERS = ("memory", "pids", "cpu")
_TAG = re.compile(r"retool-sandbox-(\d+)-[0-9a-f]+")


class SandboxCgroups:
    """The cgroup directories of one sandbox: `roots` is `[(kind, path)]` with kind `memory1`, `pids`, `freezer`,
    `cpu` or `cpuacct` (v1; co-mounted controllers share a path) or `v2`.

    Args:
        tag (`str`): The directory name, `retool-sandbox-<trainer pid>-<hex>`.
        memory_mb (`int`, *optional*): Memory bound of the whole sandbox (all its sessions together).
        cpu_weight (`int`, defaults to `1`): The sandbox's CPU weight against the trainer's threads, in threads.
        ranks (`int`, defaults to `1`): Trainers on this node that share its task budget (`LOCAL_WORLD_SIZE`).

    `missing` says, for `isolation_report()`, which bound could not be set up and why."""

    def __init__(self, tag: str, memory_mb: int | None = None, cpu_weight: int = 1, ranks: int = 1):
        self.roots: list[tuple[str, str]] = []
        self.missing: list[str] = []
        self.v2_controllers: list[str] = []
        self.task_limit: int | None = None  # tasks of all sessions together (pids.max of the sandbox's cgroup)
        if os.geteuid() != 0:
            self.missing.append("cgroups (not root: no writable memory/pids cgroup)")
            return
        for controller, kind in _V1:
            own = _own_path(controller)
            base = _ROOT / controller
            if own is None or not (base / "cgroup.procs").exists():
                continue
            _remove_stale(base / own.lstrip("/"))
            self._make(kind, base / own.lstrip("/") / tag)
        if not self.roots:
            self._try_v2(tag)
        self._limit_whole(memory_mb, cpu_weight)
        self.task_limit = self._limit_tasks(ranks)
        kinds = self.kinds
        if not kinds & {"memory1", "memory"}:
            self.missing.append("memory cgroup (per-session memory is bounded per process only)")
        if not kinds & {"pids"}:
            self.missing.append(
                "pids cgroup (the per-session process cap is RLIMIT_NPROC only; no bound on all sessions' tasks)"
            )
        if not kinds & {"freezer", "v2"}:
            self.missing.append("freezer cgroup (processes a cell leaves are found through /proc only)")
        if not kinds & {"cpu"}:
            self.missing.append("cpu cgroup (no per-session CPU share; the CPU budget counts the main process only)")

    @property
    def kinds(self) -> set[str]:
        return {kind for kind, _ in self.roots} | set(self.v2_controllers)

    def _limit_whole(self, memory_mb: int | None, cpu_weight: int) -> None:
        """The sandbox's own bounds: all sessions' memory together, and its CPU weight against the trainer."""
        for kind, root in self.roots:
            values = {
                "memory1": {"memory.limit_in_bytes": memory_mb << 20 if memory_mb else None},
                "cpu": {"cpu.shares": 1024 * max(1, cpu_weight)},
                "v2": {"memory.max": memory_mb << 20 if memory_mb else None, "cpu.weight": 100 * max(1, cpu_weight)},
            }.get(kind, {})
            for name, value in values.items():
                if value is not None and os.path.exists(os.path.join(root, name)):
                    try:
                        Path(root, name).write_text(str(value))
                    except OSError:
                        self.missing.append(f"{name} of the whole sandbox (could not be written)")

    def _limit_tasks(self, ranks: int) -> int | None:
        """Bounds the tasks of all sessions together (`sandbox_task_limit`); the limit written, or None."""
        limit = sandbox_task_limit(task_budget(), ranks)
        for kind, root in self.roots:
            if kind == "pids" or (kind == "v2" and "pids" in self.v2_controllers):
                try:
                    Path(root, "pids.max").write_text(str(limit))
                    return limit
                except OSError:
                    self.missing.append("pids.max of the whole sandbox (could not be written)")
        return None

    def _try_v2(self, tag: str) -> None:
        own = _own_path("")
        unified = _ROOT if (_ROOT / "cgroup.controllers").exists() else _ROOT / "unified"
        if own is None or not (unified / "cgroup.controllers").exists():
            return
        _remove_stale(unified / own.lstrip("/"))
        path, self.v2_controllers, problem = make_v2_sandbox(unified / own.lstrip("/"), tag, _V2_CONTROLLERS)
        if path is not None:
            self.roots.append(("v2", str(path)))
        if problem:
            self.missing.append(problem)

    def _make(self, kind: str, path: Path) -> bool:
        if any(os.path.realpath(made) == os.path.realpath(path) for _, made in self.roots):
            self.roots.append((kind, str(path)))  # co-mounted with a controller already made (cpu,cpuacct)
            return True
        try:
            path.mkdir(mode=0o755)
        except OSError:
            return False
        self.roots.append((kind, str(path)))
        return True

    def remove(self, timeout_s: float = 5.0) -> None:
        """Removes the sandbox's cgroups (and any per-session ones left), once the kernel has let go of them."""
        deadline = time.monotonic() + timeout_s
        for kind, root in self.roots:
            if kind == "v2":  # a v2 cgroup with a process in it cannot be removed: nothing of the sandbox may stay
                v2_kill(root, timeout_s)
            elif kind == "freezer":
                v1_end_jails(Path(root))
        for root in dict.fromkeys(path for _, path in self.roots):
            while True:
                try:
                    for child in sorted(Path(root).iterdir()):
                        if child.is_dir():
                            child.rmdir()
                    os.rmdir(root)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
        self.roots = []


def make_v2_sandbox(own: Path, tag: str, wanted: tuple[str, ...]) -> tuple[Path | None, list[str], str | None]:
    """Makes the sandbox's directory `own/tag` in the unified (v2) hierarchy, `own` being this process's cgroup, with
    the `wanted` controllers delegated to the per-session directories below it. Returns the directory (None if it
    could not be made), the controllers the sessions get, and why any is missing, in one line with its fix.

    cgroup v2 lets a controller reach a cgroup's children only through the parent's `cgroup.subtree_control`, and
    refuses that while the parent itself holds processes (the no-internal-processes rule; only the root is exempt).
    This process is in `own`: where it and its own descendants are all that `own` holds, they move into a leaf
    `own/retool-trainer-<pid>` first, so that `own` may delegate. Processes of others in `own` are not moved."""
    try:
        available = (own / "cgroup.controllers").read_text().split()
        enabled = (own / "cgroup.subtree_control").read_text().split()
    except OSError as exc:
        return None, [], f"cgroup v2: {own} cannot be read ({exc.strerror})"
    todo = [c for c in wanted if c in available and c not in enabled]
    problems = [f"{c} is not delegated to {own}" for c in wanted if c not in available]
    is_root = not (own / "cgroup.type").exists()  # the hierarchy's root, exempt from the rule (not a namespace's)
    if todo and (is_root or _v2_leave_for_leaf(own)):
        for controller in todo:
            try:
                (own / "cgroup.subtree_control").write_text(f"+{controller}")
                enabled.append(controller)
            except OSError as exc:
                problems.append(f"{controller} cannot be enabled below {own} ({exc.strerror})")
    elif todo:
        problems.append(
            f"{', '.join(todo)} cannot be enabled below {own}: it holds other processes (cgroup v2 lets a cgroup "
            "with processes delegate no controller; start the trainer in a cgroup of its own, e.g. systemd-run "
            "--scope -p Delegate=yes)"
        )
    got = [c for c in wanted if c in enabled]
    path = own / tag
    try:
        path.mkdir(mode=0o755)
    except OSError as exc:
        return None, [], f"cgroup v2: {path} cannot be made ({exc.strerror})"
    try:  # the sandbox's directory holds no process: the sessions' directories below it get these controllers
        if got:
            (path / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in got))
    except OSError as exc:
        problems.append(f"{' '.join(got)} cannot be enabled below {path} ({exc.strerror})")
        got = []
    return path, got, ("cgroup v2: " + "; ".join(problems)) if problems else None


def _v2_leave_for_leaf(own: Path) -> bool:
    """Moves this process, and its descendants in `own`, into the leaf `own/retool-trainer-<pid>`, if `own` holds
    nothing else; True when `own` then holds no process."""
    try:
        members = {int(p) for p in (own / "cgroup.procs").read_text().split()}
    except (OSError, ValueError):
        return False
    ours = {os.getpid()} | _descendants(os.getpid())
    if not members:
        return True
    if not members <= ours:
        return False
    leaf = own / f"retool-trainer-{os.getpid()}"
    try:
        leaf.mkdir(mode=0o755, exist_ok=True)
        for pid in sorted(members):
            (leaf / "cgroup.procs").write_text(str(pid))
        return not (own / "cgroup.procs").read_text().split()
    except OSError:
        return False


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{parent}/task"):
                children = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
                todo += [int(c) for c in children if int(c) not in found]
                found.update(int(c) for c in children)
        except (OSError, ValueError):
            continue
    return found


def _remove_stale(parent: Path) -> None:
    """Removes the empty cgroup directories that sandboxes of trainers no longer alive left below `parent`."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        match = _TAG.fullmatch(entry.name)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        try:
            for child in entry.iterdir():
                if child.is_dir():
                    child.rmdir()
            entry.rmdir()
        except OSError:
            continue  # still holds a process (or another user's): left alone
