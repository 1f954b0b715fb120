"""The sandbox a training or evaluation config asks for (kept here so the trainer and inference both import it from
the sandbox package, not from each other)."""

from __future__ import annotations

from . import build_sandbox
from .base import Sandbox
from .cell_limits import with_cell_limits
from .remote.service import DEFAULT_MEMORY_WAIT_S


def sandbox_from_config(args) -> Sandbox:
    """Builds the sandbox of a `ReToolConfig` (or any object with its `sandbox_*` fields): `sandbox_backend` and its
    limits, with `max_cell_chars` and `interpreter_errors` applied ([`~retool_trl.sandbox.cell_limits.CellLimits`]).

    Args:
        args: Has `sandbox_backend`, `sandbox_timeout_s`, `sandbox_memory_mb`, `max_interpreter_output_chars` and,
            for `"local"`, `sandbox_workers` and `sandbox_allow_root_without_isolation`; for `"remote"`, `sandbox_url`,
            `sandbox_max_concurrency` and `sandbox_memory_wait_s`.
    """
    return with_cell_limits(_backend_from_config(args), args)


def _backend_from_config(args) -> Sandbox:
    # The rollout truncates to `max_interpreter_output_chars` on the side the config asks for; keep more here.
    max_output_chars = max(4 * args.max_interpreter_output_chars, 4096)
    if args.sandbox_backend == "remote":  # the same limits as a local session: the model sees the same results
        return build_sandbox(
            "remote",
            url=args.sandbox_url,
            timeout_s=args.sandbox_timeout_s,
            memory_mb=args.sandbox_memory_mb,
            max_output_chars=max_output_chars,
            max_concurrency=args.sandbox_max_concurrency,
            memory_wait_s=getattr(args, "sandbox_memory_wait_s", DEFAULT_MEMORY_WAIT_S),
        )
    return build_sandbox(
        "local",
        num_workers=args.sandbox_workers,
        timeout_s=args.sandbox_timeout_s,
        memory_mb=args.sandbox_memory_mb,
        allow_root_without_isolation=getattr(args, "sandbox_allow_root_without_isolation", False),
        max_output_chars=max_output_chars,
    )


__all__ = ["sandbox_from_config", "with_cell_limits"]
