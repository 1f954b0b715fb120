"""Cgroups for the local sandbox: per session a memory bound, a process bound, a CPU share and a freezer; for the
whole sandbox a memory bound, where the machine lets us.

The host makes one directory per `LocalSandbox` below its own cgroup (cgroup v1 `memory`, `pids`, `freezer`, `cpu`
and `cpuacct` hierarchies, or the v2 unified one where its controllers are delegated to us); the zygote makes one
directory per session below that and moves the session's process in. The freezer (v2: `cgroup.freeze`) lets the
host stop a jail's every process at once; `cpuacct` (v2: `cpu.stat`) counts the CPU of all of them. Where nothing is
writable, the per-process rlimits are all that bound a session. Directories of sandboxes whose trainer died (a
SIGKILL leaves them behind) are removed when the next sandbox starts.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from pathlib import Path

from ..jail.freezer import freezer_control, set_frozen

__all__ = [
    "SandboxCgroups",
    "default_memory_mb",
    "freezer_control",
    "make_v2_sandbox",
    "set_frozen",
    "task_budget",
    "v2_freeze",
    "v2_kill",
]

_ROOT = Path("/sys/fs/cgroup")
# v1 hierarchies we use, by the kind name the zygote knows them under.
_V1 = (("memory", "memory1"), ("pids", "pids"), ("freezer", "freezer"), ("cpu", "cpu"), ("cpuacct", "cpuacct"))
_V2_CONTROLLERS = ("memory", "pids", "cpu")
_TAG = re.compile(r"retool-sandbox-(\d+)-[0-9a-f]+")
_UNLIMITED = 1 << 60


def default_memory_mb(share: float = 0.5) -> int:
    """A share of the memory this process may use: the machine's, or less where a cgroup (a container) bounds it."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        total = _UNLIMITED
    own = _own_path("memory")
    if own is not None:  # v1: the tightest limit on the way up from our own cgroup
        path = _ROOT / "memory" / own.lstrip("/")
        while _ROOT / "memory" in [path, *path.parents]:
            try:
                total = min(total, int((path / "memory.limit_in_bytes").read_text()))
            except (OSError, ValueError):
                pass
            if path == _ROOT / "memory":
                break
            path = path.parent
    else:
        own = _own_path("")
        if own is not None:
            path = _ROOT / own.lstrip("/")
            while _ROOT in [path, *path.parents]:
                try:
                    text = (path / "memory.max").read_text().strip()
                    total = min(total, int(text)) if text != "max" else total
                except (OSError, ValueError):
                    pass
                if path == _ROOT:
                    break
                path = path.parent
    return max(256, int(total * share) >> 20)


def task_budget() -> int:
    """How many more tasks (processes and threads) this process may start: the tightest of its pids cgroups on the
    way up (v1, or v2's unified hierarchy: a container's task limit) and the kernel's `threads-max` and `pid_max`."""
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
        kernel = min(int(Path(f"/proc/sys/kernel/{name}").read_text()) for name in ("threads-max", "pid_max"))
        budget = kernel - running
    except (OSError, ValueError, IndexError):
        budget = _UNLIMITED
    own, top = _own_path("pids"), _ROOT / "pids"
    if own is None:
        own, top = _own_path(""), _ROOT if (_ROOT / "cgroup.controllers").exists() else _ROOT / "unified"
    if own is not None:
        path = top / own.lstrip("/")
        while top in [path, *path.parents]:
            try:
                limit = (path / "pids.max").read_text().strip()
                if limit != "max":
                    budget = min(budget, int(limit) - int((path / "pids.current").read_text()))
            except (OSError, ValueError):
                pass
            if path == top:
                break
            path = path.parent
    return max(0, budget)


def sandbox_task_limit(budget: int, ranks: int = 1) -> int:
    """The sandbox's share of the tasks left (`task_budget()`): a quarter, at least 64, stays with the trainer (its
    threads, data loaders, the zygote's forks of new jails), so sessions that each keep within their own process
    cap cannot together exhaust a container's task limit; the rest is divided among the `ranks` trainers of the
    node (`LOCAL_WORLD_SIZE`), each of which builds a sandbox of its own."""
    return max(1, (budget - max(64, budget // 4)) // max(1, ranks))


def _own_path(controller: str) -> str | None:
    """This process's cgroup path in the v1 hierarchy of `controller` ("" for v2), from /proc/self/cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return None


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
                _v1_end_jails(Path(root))
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


def v2_freeze(path: str | os.PathLike, frozen: bool, timeout_s: float = 1.0) -> bool:
    """Freezes (or thaws) every process of a v2 cgroup at once through `cgroup.freeze`; True once `cgroup.events`
    says the kernel is done (a freeze takes effect task by task)."""
    try:
        Path(path, "cgroup.freeze").write_text("1" if frozen else "0")
        deadline = time.monotonic() + timeout_s
        while True:
            done = f"frozen {int(frozen)}" in Path(path, "cgroup.events").read_text()
            if done or time.monotonic() > deadline:
                return done
            time.sleep(0.001)
    except OSError:
        return False


def v2_kill(path: str | os.PathLike, timeout_s: float = 2.0) -> bool:
    """Kills every process of a v2 cgroup and of the cgroups below it: `cgroup.kill` (Linux 5.14), which no fork
    escapes, else frozen, each listed process SIGKILLed, thawed. True once the cgroup holds no process."""
    kill_file = Path(path, "cgroup.kill")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if kill_file.exists():
                kill_file.write_text("1")
            else:
                v2_freeze(path, True)
                for pid in _v2_members(path):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                v2_freeze(path, False)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return True
        if not _v2_members(path):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def _v2_members(path: str | os.PathLike) -> set[int]:
    found = set()
    for directory, _, _ in os.walk(path):
        try:
            found.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def _v1_end_jails(root: Path) -> None:
    """Kills and thaws whatever is left in the sandbox's jails (v1 freezer). The zygote ends its jails as it shuts
    down, but a zygote that died first (killed by the machine's OOM killer, say) leaves its parked sessions frozen:
    a frozen process dies only once thawed, and would hold its memory after the trainer is gone."""
    for jail in root.glob("*/"):
        try:
            pids = [int(p) for p in (jail / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            continue
        for pid in (p for p in pids if p > 0):  # 0: a process outside our pid namespace
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            (jail / "freezer.state").write_text("THAWED")
        except OSError:
            pass


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
