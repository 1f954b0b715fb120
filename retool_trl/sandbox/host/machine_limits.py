"""What this trainer process may use on its machine: the memory and the tasks left to it, read from the cgroups above
it (a container's limits) and the kernel. Runs in the trainer; standard library only. The sandbox's own cgroup
directories are made in `cgroups.py`; `node.py` divides these among the ranks of a node.
"""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path("/sys/fs/cgroup")
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
