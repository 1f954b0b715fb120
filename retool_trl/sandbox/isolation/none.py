"""The level without isolation (`isolation="none"`, or a host with neither bubblewrap nor Landlock, when allowed):
the zygote runs directly; sessions get rlimits, the seccomp filter, a uid of their own where the trainer is root and
the interpreter is readable by others, and namespaces where the zygote may still make them (root on a host whose
bubblewrap is missing). Cells can read whatever the session's uid can read."""

from __future__ import annotations

import os

from .common import Launch, can_drop_privileges
from .seccomp import FAMILIES_IN_A_NETWORK_NAMESPACE, FAMILIES_WITHOUT_NAMESPACES


def launch(worker: str, network: bool, problem: str) -> Launch:
    """`problem` says why no stronger level runs here (it goes into the warning and the report)."""
    missing = ["read-only host file system (bubblewrap)", f"file-system rules (Landlock): {problem}"]
    if not can_drop_privileges(worker):
        missing.append("own uid per session (sessions can signal each other and read each other's /proc)")
    if os.geteuid() != 0:  # root may still get namespaces of its own per session (the zygote probes)
        missing.append("per-session memory, process and scratch bounds beyond rlimits")
    families = FAMILIES_IN_A_NETWORK_NAMESPACE if network else FAMILIES_WITHOUT_NAMESPACES
    return Launch("none", [], None, None, families, missing)
