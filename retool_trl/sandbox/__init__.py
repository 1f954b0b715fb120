"""Code execution for ReTool rollouts: stateful, isolated Python sessions.

`LocalSandbox` runs sessions in forked, resource-limited processes on this machine (bubblewrap namespaces when
available); `RemoteSandbox` talks to a SandboxFusion-compatible HTTP service. Both hand out sessions whose state
persists across calls, and run a batch of cells concurrently with `run_many`. This package imports neither torch nor
transformers.
"""

from .base import ExecResult, Sandbox, Session, truncate_output
from .local import LocalSandbox, LocalSession, UnsafeSandboxError

__all__ = [
    "ExecResult",
    "LocalSandbox",
    "LocalSession",
    "RemoteSandbox",
    "RemoteSession",
    "Sandbox",
    "Session",
    "build_sandbox",
    "truncate_output",
    "UnsafeSandboxError",
]

_BACKENDS = ("local", "remote")


def __getattr__(name):
    # httpx is only imported when the remote backend is used.
    if name in ("RemoteSandbox", "RemoteSession"):
        from . import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_sandbox(backend: str = "local", **kwargs) -> Sandbox:
    """Builds a sandbox backend by name: `"local"` -> `LocalSandbox(**kwargs)`, `"remote"` ->
    `RemoteSandbox(**kwargs)`.

    Raises `ValueError` naming the backend when it is neither.
    """
    if backend == "local":
        return LocalSandbox(**kwargs)
    if backend == "remote":
        from .remote import RemoteSandbox

        return RemoteSandbox(**kwargs)
    raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {_BACKENDS}")
