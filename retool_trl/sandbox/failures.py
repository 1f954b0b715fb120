"""Why a call failed, in four kinds a user acts on differently: the cell's own error, the cell's own timeout, waiting
for the sandbox (a jail that did not come up in time, a service that asked the client to come back later or did not
answer in time), and the sandbox's own failure (a lost interpreter, a service error).

The first two are the model's doing and are scored; the last two are the infrastructure's and are not
(`ExecResult.infra_error`). They are told apart by the result alone, so every backend (local, remote, the server's
replies) is classified the same way.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from .base import ExecResult

FAILURE_KINDS = ("cell_error", "cell_timeout", "sandbox_wait", "sandbox_failure")

# An infrastructure error caused by waiting, as the backends word it: a jail not set up within its time, HTTP 429/503
# (the service is full: come back later), a request that ran out of time, retries that ran out.
_WAITING = re.compile(
    r"within \d[\d.]* s|HTTP (429|503)|ReadTimeout|ConnectTimeout|PoolTimeout|timed out|Retry-After|retries",
    re.IGNORECASE,
)


def failure_kind(result: ExecResult) -> str | None:
    """The kind of a failed call (one of `FAILURE_KINDS`), or `None` when the call succeeded."""
    if result.infra_error:
        return "sandbox_wait" if _WAITING.search(result.output) else "sandbox_failure"
    if result.ok:
        return None
    return "cell_timeout" if result.timed_out else "cell_error"


def failures_by_kind(results: Iterable[ExecResult]) -> dict[str, int]:
    """How many of `results` failed, per kind (every kind present, zeros included)."""
    counts = Counter(failure_kind(result) for result in results)
    return {kind: counts.get(kind, 0) for kind in FAILURE_KINDS}


__all__ = ["FAILURE_KINDS", "failure_kind", "failures_by_kind"]
