"""Cgroups for the local sandbox: one memory bound and one process bound per session, where the machine lets us.

The host makes one directory per `LocalSandbox` below its own cgroup (cgroup v1 `memory` and `pids` hierarchies, or
the v2 unified one where its controllers are delegated to us); the zygote makes one directory per session below that
and moves the session's process in. Where neither is writable, the per-process rlimits are all that bound a session.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["SandboxCgroups"]

_ROOT = Path("/sys/fs/cgroup")


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
    """The cgroup directories of one sandbox: `roots` is `[(kind, path)]` with kind `memory1` or `pids` (v1) or `v2`.

    `missing` says, for `isolation_report()`, which bound could not be set up and why."""

    def __init__(self, tag: str):
        self.roots: list[tuple[str, str]] = []
        self.missing: list[str] = []
        if os.geteuid() != 0:
            self.missing.append("cgroups (not root: no writable memory/pids cgroup)")
            return
        for controller, kind in (("memory", "memory1"), ("pids", "pids")):
            own = _own_path(controller)
            base = _ROOT / controller
            if own is None or not (base / "cgroup.procs").exists():
                continue
            self._make(kind, base / own.lstrip("/") / tag)
        if not self.roots:
            self._try_v2(tag)
        kinds = {kind for kind, _ in self.roots} | set(getattr(self, "v2_controllers", []))
        if not kinds & {"memory1", "memory"}:
            self.missing.append("memory cgroup (per-session memory is bounded per process only)")
        if not kinds & {"pids"}:
            self.missing.append("pids cgroup (the per-session process cap is RLIMIT_NPROC only)")

    def _try_v2(self, tag: str) -> None:
        own = _own_path("")
        unified = _ROOT if (_ROOT / "cgroup.controllers").exists() else _ROOT / "unified"
        if own is None or not (unified / "cgroup.controllers").exists():
            return
        parent = unified / own.lstrip("/")
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError:
            return
        wanted = [c for c in ("memory", "pids") if c in enabled]
        path = parent / tag
        if wanted and self._make("v2", path):
            try:  # the per-session directories below get these controllers' files
                (path / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
            except OSError:
                pass
            self.v2_controllers = wanted

    def _make(self, kind: str, path: Path) -> bool:
        try:
            path.mkdir(mode=0o755)
        except OSError:
            return False
        self.roots.append((kind, str(path)))
        return True

    def remove(self, timeout_s: float = 5.0) -> None:
        """Removes the sandbox's cgroups (and any per-session ones left), once the kernel has let go of them."""
        deadline = time.monotonic() + timeout_s
        for _, root in self.roots:
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
