"""Acting on every process of a cgroup at once: freezing, thawing and killing them (v2's `cgroup.freeze` and
`cgroup.kill`; v1's freezer through `jail/freezer.py`, which the zygote shares). Runs in the trainer; the cgroups
themselves are made in `cgroups.py`.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

from ..jail.freezer import freezer_control, set_frozen

__all__ = ["freezer_control", "set_frozen", "v1_end_jails", "v2_freeze", "v2_kill"]


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


def v1_end_jails(root: Path) -> None:
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
