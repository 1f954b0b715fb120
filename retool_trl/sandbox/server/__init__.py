"""The sandbox server: runs as its own service (`retool-trl sandbox-server`), serving the host side's `LocalSandbox`
jails over HTTP to trainers on other machines; it trusts no client beyond its token. Imports `..host`, never the
reverse.

`retool-trl sandbox-server` runs `create_app(ServerConfig(...))` under uvicorn. It speaks SandboxFusion's
`POST /run_code` (so verl's, SkyRL's and the `sandbox-fusion` client work unchanged) and offers stateful sessions of
its own (`/sessions`), which `RemoteSandbox` uses instead of replaying a session's cells. Needs the `server` extra
(`pip install -e ".[server]"` from a clone); the client side (`..remote`) needs only httpx.
"""

from __future__ import annotations

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name):
    # starlette is only imported by the server itself, never by the client.
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
