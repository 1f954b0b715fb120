"""The level without isolation (`isolation="none"`, or a host with neither bubblewrap nor Landlock, when allowed):
the zygote runs directly; sessions get rlimits, the seccomp filter, a uid of their own where the trainer is root and
the interpreter is readable by others, and namespaces where the zygote may still make them (root on a host whose
bubblewrap is missing). Cells can read whatever the session's uid can read."""

from __future__ import annotations

import os

from .common import Launch, can_drop_privileges
from .level import IsolationLevel
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


class NoIsolation(IsolationLevel):
    """Taken only when asked for by name, or by `"auto"` where no level that isolates runs; as root, only with the
    user's opt-in (cells would see the host file system with root's reach)."""

    name = "none"
    title = "none"
    auto = False
    fallback = True
    root_needs_opt_in = True

    def launch(self, worker: str, network: bool, writable: tuple[str, ...], why: str) -> Launch:
        return launch(worker, network, why or "isolation='none' was asked for")

    def root_refusal(self, why: str, fell_back: bool) -> str | None:
        if os.geteuid() != 0:
            return None
        if fell_back:
            return (
                f"LocalSandbox refuses to run untrusted code as root without isolation ({why}). Fix: run on a "
                "kernel with Landlock (Linux 5.13+, 'landlock' in lsm=) or where bubblewrap may make namespaces "
                "(docker run --security-opt seccomp=unconfined --cap-add SYS_ADMIN), or opt in with "
                "LocalSandbox(allow_root_without_isolation=True)."
            )
        return (
            "LocalSandbox refuses to run untrusted code as root with isolation='none': cells would see the host "
            "file system with root's reach. Use isolation='auto', or opt in with "
            "LocalSandbox(allow_root_without_isolation=True) (ReToolConfig.sandbox_allow_root_without_isolation)."
        )

    def warning(self, why: str, drops_privileges: bool) -> str | None:
        return (
            f"LocalSandbox: bubblewrap is unavailable ({why or 'isolation=none asked for'}), so cells can read "
            "the host file system"
            + (
                ""
                if os.geteuid() == 0
                else ", see other sessions' files and processes, and are bounded by rlimits only"
            )
            + ("" if drops_privileges else "; sessions share one uid (they can signal each other)")
            + ". LocalSandbox.isolation_report()['missing'] lists what does not hold."
        )


LEVEL = NoIsolation()
