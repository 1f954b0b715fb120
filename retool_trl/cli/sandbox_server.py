"""`retool-trl sandbox-server`: serves this machine's `LocalSandbox` jails over HTTP (SandboxFusion's `/run_code`
plus stateful sessions), one server per CPU node; trainers point `sandbox_url` (verl and SkyRL their SandboxFusion
URL) at it."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

from ..errors import UserError, one_line
from .common import PROG
from .parser import OneLineParser

logger = logging.getLogger("retool_trl")


def _parser() -> OneLineParser:
    from ..sandbox.server.config import ServerConfig

    parser = OneLineParser(
        prog=f"{PROG} sandbox-server",
        description="Serve jailed, stateful Python sessions over HTTP: SandboxFusion's POST /run_code, our "
        "/sessions, /health and /metrics. Ctrl-C or SIGTERM lets running calls finish (up to --grace-s), then "
        "kills every jail.",
    )
    defaults = ServerConfig()
    parser.add_argument("--host", default=defaults.host, help="Address to listen on (0.0.0.0 in a container).")
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument(
        "--token",
        default=None,
        help="Bearer token every call but /health must carry (default: $RETOOL_SANDBOX_TOKEN; none: no check). "
        "Refused where cells can read command lines (the landlock and none levels): use the variable or "
        "--token-file.",
    )
    parser.add_argument(
        "--token-file", default=None, help="A file whose first line is the token (instead of --token)."
    )
    parser.add_argument(
        "--tokens-file",
        default=None,
        help="Per-tenant tokens instead of one token: a file of 'TOKEN TENANT' lines (blank lines and # comments "
        "ignored; mode 600, readable by you alone). Every call but /health must carry one of the tokens, and the "
        "per-client bounds are kept per tenant. Without it a client is its address: all of loopback is one client, "
        "an IPv6 address counts as its /64. $RETOOL_SANDBOX_TOKEN is not read then.",
    )
    for field in dataclasses.fields(ServerConfig):
        if field.name in ("host", "port", "token", "tokens"):
            continue
        flag = "--" + field.name.replace("_", "-")
        said = field.metadata.get("help", "")
        if field.type in ("bool",):
            parser.add_argument(flag, action="store_true", help=f"{said} (default: {field.default})".strip())
            continue
        kind = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float}[field.type]
        shown = "" if field.default is None else f" (default: {field.default})"  # a None default's help says it
        parser.add_argument(flag, type=kind, default=field.default, help=f"{said}{shown}".strip())
    return parser


def main(argv: Sequence[str]) -> int:
    """`retool-trl sandbox-server --host H --port P [--token T | --tokens-file F] [...]`."""
    args = _parser().parse_args(list(argv))
    token_in_argv = args.token is not None
    token_file, tokens_file = args.token_file, args.tokens_file
    del args.token_file, args.tokens_file
    if token_in_argv and token_file:
        raise UserError("give the token once: --token or --token-file, not both")
    if tokens_file and (token_in_argv or token_file):
        raise UserError("--tokens-file holds every tenant's token: drop --token and --token-file")
    if tokens_file:
        from ..sandbox.server.clients import TokensFileError, read_tokens_file

        try:
            args.tokens = read_tokens_file(tokens_file)
        except TokensFileError as error:
            raise UserError(one_line(error)) from None
    elif token_file:
        try:
            with open(token_file) as handle:
                args.token = handle.readline().strip() or None
        except OSError as error:
            raise UserError(f"cannot read --token-file: {one_line(error)}") from None
        if args.token is None:
            raise UserError(f"--token-file {token_file} is empty")
    elif not token_in_argv:
        args.token = os.environ.get("RETOOL_SANDBOX_TOKEN") or None
    try:
        import uvicorn

        from ..sandbox.server import ServerConfig, create_app
    except ImportError as error:
        raise UserError(
            f"{one_line(error)}: install the server's dependencies: pip install 'retool-trl[server]'"
        ) from None
    try:
        config = ServerConfig(**vars(args))
    except ValueError as error:
        raise UserError(one_line(error)) from None
    from ..sandbox.host.zygote import SandboxStartError, UnsafeSandboxError
    from ..sandbox.server.http import head_timeout_protocol
    from ..sandbox.server.table import SessionTable

    try:
        table = SessionTable(config)
    except ValueError as error:  # a memory budget that holds no session of the default memory_mb
        raise UserError(one_line(error)) from None
    # The isolation is reported before the port opens, so that a log shows it even if the server never serves.
    try:
        report = table.isolation_report()
    except (UnsafeSandboxError, SandboxStartError) as error:
        table.close()
        raise UserError(f"the sandbox cannot start here: {one_line(error)}") from None
    if token_in_argv and not report.get("private_filesystem"):
        # Without a private /proc (the landlock and none levels) every cell can read this process's command line.
        table.close()
        raise UserError(
            f"--token on the command line is readable by every cell on the {report.get('isolation')} level "
            "(command lines are visible in /proc there): give it as $RETOOL_SANDBOX_TOKEN or --token-file"
        )
    # One line of what holds and what does not; each missing protection in full is in GET /health's `missing`.
    where = " What it does not give, in full: GET /health ('missing')." if report.get("missing") else ""
    print(f"[retool-trl] sandbox isolation: {report.get('summary', report.get('isolation'))}{where}", flush=True)
    # How many sessions the memory budget holds at once: every live session reserves its `memory_mb`, so a trainer
    # that keeps more rollouts in flight than this waits on 429s; said at the start rather than found in a slow run.
    print(
        f"[retool-trl] memory budget {table.memory_budget_mb} MB: at most "
        f"{table.memory_budget_mb // config.memory_mb} live sessions of the default {config.memory_mb} MB at once "
        f"(a session asking for less takes less; --total-memory-mb sets the budget), one client at most "
        f"{table.memory_per_client_mb} MB of it (--max-memory-per-client-mb).",
        flush=True,
    )
    app = create_app(config, table)
    print(f"[retool-trl] sandbox server on http://{config.host}:{config.port}", flush=True)
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level="warning",
        timeout_graceful_shutdown=config.grace_s,
        # Keep-alive connections of a trainer's pool stay open between rollout steps.
        timeout_keep_alive=75,
        # A request head must come whole and soon: bounded in size (h11's limit) and in time (the protocol's).
        http=head_timeout_protocol(config.header_timeout_s),
        h11_max_incomplete_event_size=16 * 1024,
        # Without per-tenant tokens, clients are told apart by their address (the per-client bounds): a
        # forwarded-for header from a loopback peer, which uvicorn trusts by default, would let any local client
        # claim a fresh address for each request.
        proxy_headers=False,
    )
    return 0
