"""Code execution for ReTool rollouts: stateful, isolated Python sessions.

`LocalSandbox` runs sessions in forked, resource-limited processes on this machine (bubblewrap namespaces when
available); `RemoteSandbox` talks to a SandboxFusion-compatible HTTP service. Both hand out sessions whose state
persists across calls, and run a batch of cells concurrently with `run_many`. This package imports neither torch nor
transformers.

Folders by where the code runs and whom it trusts: `jail/` runs inside the sandbox (the zygote and the session
processes: untrusted cells can reach it; stdlib only); `host/` runs in the trainer and drives the local jails;
`isolation/` is the trainer's choice of jail level; `remote/` is the HTTP client and the program it sends to a
service; `server/` is that service. `base.py`, `cell_limits.py` and `factory.py` are the interface both backends share.
"""

from .base import ExecResult, Sandbox, Session, truncate_output
from .host.local import LocalSandbox, LocalSession, UnsafeSandboxError

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
        from .remote import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_sandbox(backend: str = "local", **kwargs) -> Sandbox:
    """Builds a sandbox backend by name: `"local"` -> `LocalSandbox(**kwargs)`, `"remote"` ->
    `RemoteSandbox(**kwargs)`.

    Raises `ValueError` naming the backend when it is neither.
    """
    if backend == "local":
        return LocalSandbox(**kwargs)
    if backend == "remote":
        from .remote.client import RemoteSandbox

        return RemoteSandbox(**kwargs)
    raise ValueError(f"unknown sandbox backend {backend!r}; expected one of {_BACKENDS}")
