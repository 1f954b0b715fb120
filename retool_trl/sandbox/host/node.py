"""This process's share of the node, for the local sandbox's defaults: the CPUs it may use (its affinity mask and its
cgroup's CPU quota, not the machine's count) and its memory, divided among the ranks that a launcher started on the
same node.

`torchrun` and `accelerate launch` start one trainer per GPU on a node and tell each how many there are
(`LOCAL_WORLD_SIZE`) and which one it is (`LOCAL_RANK`); each trainer builds its own sandbox. Without this, 8 ranks
would each take every CPU and half of the memory: 8 times the node. With it, the defaults of all ranks add up to the
node (each rank gets at least one CPU slot). Also this process's own limit on open files, which a sandbox with
hundreds of live sessions needs raised.
"""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path

from .machine_limits import _ROOT, _own_path, default_memory_mb

__all__ = ["local_ranks", "node_share_cpus", "node_share_memory_mb", "raise_open_file_limit", "usable_cpus"]


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def local_ranks() -> tuple[int, int]:
    """`(local_rank, local_world_size)` as the launcher set them (`LOCAL_RANK`, `LOCAL_WORLD_SIZE`); `(0, 1)` for a
    process started alone."""
    size = _env_int("LOCAL_WORLD_SIZE")
    if size is None or size < 1:
        return 0, 1
    rank = _env_int("LOCAL_RANK")
    return (rank if rank is not None and 0 <= rank < size else 0), size


def _cpu_quota() -> float | None:
    """CPUs' worth of time this process's cgroup (or one above it) may use: v2 `cpu.max`, v1 `cpu.cfs_quota_us /
    cpu.cfs_period_us`; the tightest on the way up; None where unbounded or unreadable."""
    quotas = []
    own = _own_path("cpu")
    if own is not None:  # v1
        top = _ROOT / "cpu"
        path = top / own.lstrip("/")
        for directory in [path, *path.parents]:
            if top not in [directory, *directory.parents]:
                break
            try:
                quota = int((directory / "cpu.cfs_quota_us").read_text())
                period = int((directory / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if quota > 0 and period > 0:
                quotas.append(quota / period)
    else:
        own = _own_path("")
        if own is not None:  # v2
            path = _ROOT / own.lstrip("/")
            for directory in [path, *path.parents]:
                if _ROOT not in [directory, *directory.parents]:
                    break
                try:
                    quota, period = Path(directory / "cpu.max").read_text().split()
                except (OSError, ValueError):
                    continue
                if quota != "max" and int(period) > 0:
                    quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def usable_cpus() -> int:
    """CPUs this process may use: those of its affinity mask (`taskset`, a container's cpuset), bounded by its
    cgroup's CPU quota (`docker --cpus`, a Kubernetes CPU limit), rounded up; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def node_share_cpus() -> int:
    """This rank's CPU slots: the usable CPUs split among the node's ranks (the first ranks take the remainder, so
    that the shares add up to the CPUs exactly), at least 1."""
    rank, size = local_ranks()
    cpus = usable_cpus()
    return max(1, cpus // size + (rank < cpus % size))


def node_share_memory_mb(share: float = 0.5) -> int:
    """This rank's memory for its sandbox: `share` of what this machine (or the container) allows, split among the
    node's ranks."""
    return default_memory_mb(share / local_ranks()[1])


def raise_open_file_limit() -> None:
    """Raises this process's soft limit on open files to its hard limit, as servers do: a live session holds several
    descriptors here (its socket, pipes, output, pidfd, /proc and cgroup files), and the soft limit most systems
    start with (1,024) ends a batch of 128 first calls with "too many open files". Sessions keep their own limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError):  # an infinite hard limit above the kernel's nr_open: take that instead
            try:
                with open("/proc/sys/fs/nr_open") as f:
                    nr_open = int(f.read())
                resource.setrlimit(resource.RLIMIT_NOFILE, (min(nr_open, hard), hard))
            except (OSError, ValueError):
                pass
