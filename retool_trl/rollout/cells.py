"""Running the rows' calls in the sandbox: a session per row, opened on first use, reserved ahead of the rollout,
closed as soon as the row is done; cells of different rows at once, one row's cells in order; an infrastructure
failure retried once in a fresh session with the row's earlier cells replayed.

Shared by both loops, so a call runs, fails and is retried the same way whether the batch waits for it or not.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..format.calls import Call
from ..sandbox import ExecResult
from .spec import RolloutSpec

if TYPE_CHECKING:
    from .rows import Row


def run_calls(sandbox, pending: Sequence[tuple[Row, list[Call]]]) -> list[list[ExecResult]]:
    """Runs every row's calls of a turn: the rows' calls concurrently, one row's several calls in order in its
    session. A call that did not parse is not run: its result is the error the model is shown."""
    runnable = [(row, call.code) for row, calls in pending for call in calls if call.code is not None]
    ran = iter(run_cells(sandbox, runnable))
    return [
        [next(ran) if call.code is not None else ExecResult(call.error or "", False, False, 0.0) for call in calls]
        for _, calls in pending
    ]


def reserve_sessions(sandbox, n: int, spec: RolloutSpec) -> None:
    """Lets the sandbox prepare `n` sessions while the model generates their first turn (`reserve`, where the
    backend has one: a local sandbox forks jails in the background). Nothing when no code can run
    (`max_tool_calls=0`, a text-only run)."""
    reserve = getattr(sandbox, "reserve", None)
    if callable(reserve) and spec.max_tool_calls > 0:
        reserve(n)


def prepare_next_rollout(sandbox, n: int, spec: RolloutSpec) -> None:
    """Asks the sandbox, as a rollout ends, for the next rollout's `n` sessions: their jails then set up while the
    trainer scores and updates (on a GPU node, on host cores idle meanwhile), not during the next rollout's first
    turn, when a fast turn (a short first turn, a small model) would otherwise wait for them at its first code call.
    Jails nobody takes are released by the sandbox after a minute."""
    reserve_sessions(sandbox, n, spec)


def release_session(row: Row) -> None:
    """Closes a finished completion's session now, not at the end of the rollout: its memory goes back to the rows
    still running."""
    if row.session is not None:
        row.session.close()


def _run_many(sandbox, pairs) -> list[ExecResult]:
    started = time.perf_counter()
    try:
        return list(sandbox.run_many(pairs))
    except Exception as exc:  # the sandbox itself failed: not the model's fault, and training must go on
        message = f"SandboxError: {type(exc).__name__}: {exc}"
        elapsed = time.perf_counter() - started
        return [ExecResult(output=message, ok=False, timed_out=False, duration_s=elapsed, infra_error=True)] * len(
            pairs
        )


def run_cells(sandbox, pending: Sequence[tuple[Row, str]]) -> list[ExecResult]:
    """Runs each row's new cells in the row's session (opened on first use): different rows' cells concurrently
    (one `run_many`), a row's second cell after its first (rounds), so they run in order in one session.
    """
    results: list[ExecResult | None] = [None] * len(pending)
    left = list(range(len(pending)))
    while left:
        taken, now, later = set(), [], []
        for k in left:
            (later if id(pending[k][0]) in taken else now).append(k)
            taken.add(id(pending[k][0]))
        for k, result in zip(now, _run_round(sandbox, [pending[k] for k in now]), strict=True):
            results[k] = result
            pending[k][0].cells.append(pending[k][1])  # replayed, with the cells before it, if the session is lost
        left = later
    return results


def _run_round(sandbox, pending: Sequence[tuple[Row, str]]) -> list[ExecResult]:
    """Runs one cell per row (concurrently, one `run_many`), in the row's session (opened on first use).

    Infrastructure failures (worker lost, service down) are retried once; the snippet's own errors never are. The
    failed session may be broken for good, so the retry gets a fresh one with the row's earlier cells replayed. A
    failure that survives the retry marks the row `infra_failed`.
    """
    for row, _ in pending:
        if row.session is None:
            row.session = sandbox.session()
    results = _run_many(sandbox, [(row.session, code) for row, code in pending])
    retry = [k for k, result in enumerate(results) if result.infra_error]
    if retry:
        pairs, last = [], []
        for k in retry:
            row, code = pending[k]
            row.session.close()
            row.session = sandbox.session()
            pairs += [(row.session, cell) for cell in row.cells] + [(row.session, code)]
            last.append(len(pairs) - 1)
        again = _run_many(sandbox, pairs)
        for k, j in zip(retry, last, strict=True):
            results[k] = again[j]
            pending[k][0].infra_failed |= again[j].infra_error
    return results


def close_sessions(rows: Sequence[Row]) -> None:
    """Closes the sessions rows still hold as a rollout ends, however it ended (a failed turn leaves some open)."""
    for row in rows:
        if row.session is not None:
            row.session.close()
