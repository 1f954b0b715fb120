"""Stops a run whose sandbox cannot run code, with the sandbox's own reason, instead of training or scoring on
infrastructure errors.

An infrastructure error (`ExecResult.infra_error`) is a call that failed for the sandbox's reasons, not the code's:
the completion is left out of the loss (`drop_infra_failures`) and scored as nothing. That is right for a few calls
(a session the kernel killed, one lost request), and wrong when the sandbox cannot run anything: the run would go on
for hours learning from completions that never saw an interpreter, and an evaluation would report 0% as a result.
So, around each rollout ([`SandboxHealth.step`]):

- before the first rollout that may run code, one trivial cell is run; if the sandbox cannot run it (it refuses to
  start, its zygote dies, the service is down), the run stops before generating anything;
- a rollout in which *every* call the sandbox answered was an infrastructure error (the first retry with a fresh
  session included) stops the run when the trivial cell then fails too: a dead sandbox fails both, while a rollout
  that made a call or two caught in a short burst of refusals (HTTP 429) finds the sandbox working again and goes
  on, with a warning; a rollout in which only some calls failed goes on, with a warning naming the sandbox's reason
  when more than half of its calls (retries included) failed.

The probe, like the rollout, tries a fresh session after a failure: with several servers (`sandbox_url` a list), as
many sessions as there are servers, each placed away from the servers found down, so one server down does not stop
the run while the others answer.

Either stop is a [`SandboxUnavailableError`] (a `UserError`: the command line prints it as one line, exit status 2)
whose message carries the sandbox's reason in full, with its fix.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from ..errors import UserError, one_line
from ..sandbox.base import SandboxWrapper

logger = logging.getLogger(__name__)

# The cell run before the first rollout: it cannot fail on its own (and fits any `max_cell_chars`).
PROBE_CODE = "1"

# An infrastructure error whose message is empty still has a reason to give.
NO_MESSAGE = "an infrastructure error without a message"


class SandboxUnavailableError(UserError):
    """The sandbox could not run code: it did not start, or every call of a rollout failed for its own reasons.

    The message names what the sandbox reported (its refusal and fix, or the service's error), on one line."""


class WatchedSandbox(SandboxWrapper):
    """A sandbox whose answers are counted by a [`SandboxHealth`]; everything else is the wrapped backend's."""

    def __init__(self, sandbox, health: SandboxHealth):
        super().__init__(sandbox)
        self.health = health

    def run_many(self, pairs):
        pairs = list(pairs)
        try:
            results = list(self.sandbox.run_many(pairs))
        except Exception as exc:
            self.health.record(len(pairs), len(pairs), f"{type(exc).__name__}: {exc}")
            raise
        failed = [result.output or NO_MESSAGE for result in results if result.infra_error]
        self.health.record(len(results), len(failed), failed[0] if failed else None)
        return results


class SandboxHealth:
    """Counts the calls a sandbox answers, rollout by rollout, and stops the run when it cannot run code.

    Args:
        what (`str`): What stops, for the message (`"training"`, `"evaluation"`).
    """

    def __init__(self, what: str = "training"):
        self.what = what
        self.probed = False
        self._lock = threading.Lock()  # the async rollout runs cells from several threads
        self._watched: WatchedSandbox | None = None
        self._warned: set[str] = set()
        self._reset()

    def _reset(self) -> None:
        self.calls, self.failed, self.reason = 0, 0, None

    def watch(self, sandbox) -> WatchedSandbox:
        """`sandbox` with its answers counted here (the same wrapper while the sandbox is the same)."""
        if isinstance(sandbox, WatchedSandbox):
            return sandbox
        if self._watched is None or self._watched.sandbox is not sandbox:
            self._watched = WatchedSandbox(sandbox, self)
        return self._watched

    def record(self, calls: int, failed: int, reason: str | None) -> None:
        with self._lock:
            self.calls += calls
            self.failed += failed
            if self.reason is None and reason:
                self.reason = one_line(reason)

    @contextlib.contextmanager
    def step(self, sandbox, uses_code: bool = True, accelerator=None):
        """Around one rollout that runs its cells in `sandbox` (as returned by [`watch`]).

        Args:
            sandbox: The sandbox of the rollout.
            uses_code (`bool`): Whether the rollout may run code at all (`max_tool_calls > 0`); if not, nothing is
                checked.
            accelerator (*optional*): With several processes, every process stops when one of them must (a
                collective call, made by every process at the same point), so that none waits for the others.

        Raises:
            `SandboxUnavailableError`: before the first rollout if the sandbox cannot run a trivial cell; after a
                rollout in which every call was an infrastructure error.
        """
        if uses_code and not self.probed:
            self.probed = True
            with _unobserved(sandbox) as inner:
                problem = probe(inner)
            url = getattr(sandbox, "url", None)  # a remote service: say which one to look at
            if problem is not None and isinstance(url, str):
                problem += f"; check that the code execution service at {url} is running and reachable"
            _stop_if_any(
                problem,
                accelerator,
                f"the sandbox cannot run code, so {self.what} stops before its first rollout",
            )
        with self._lock:
            self._reset()
        yield
        with self._lock:
            calls, failed, reason = self.calls, self.failed, self.reason
        all_failed = uses_code and calls > 0 and failed == calls
        recovered = False
        if all_failed:
            with _unobserved(sandbox) as inner:
                recovered = probe(inner) is None
        if recovered:
            all_failed = False  # the sandbox runs code again: the failures were a passing burst, not an outage
            logger.warning(
                "all %d sandbox calls of a rollout failed for the sandbox's own reasons, but it runs code again; "
                "the sandbox said: %s",
                calls,
                reason or NO_MESSAGE,
            )
        _stop_if_any(
            (reason or NO_MESSAGE) if all_failed else None,
            accelerator,
            f"all {calls} sandbox calls of a rollout (retries included) failed for the sandbox's own reasons "
            f"(infrastructure errors, not the model's code), so {self.what} stops rather than go on without an "
            "interpreter",
        )
        if 2 * failed > calls and reason not in self._warned:
            self._warned.add(reason)
            logger.warning(
                "%d of %d sandbox calls of a rollout (retries included) failed for the sandbox's own reasons (their "
                "completions are left out of the loss and the scores); "
                "the sandbox said: %s",
                failed,
                calls,
                reason,
            )


@contextlib.contextmanager
def _unobserved(sandbox):
    """`sandbox` without what watches or counts its calls: a probe is not a call of the rollout, neither in the
    watch's failure count nor in the step's interpreter metrics and time. The wrappers that count are left out, and
    the backend's own observer (the local sandbox tells it each call's waits and fresh jails) is off meanwhile."""
    while isinstance(sandbox, WatchedSandbox) or getattr(type(sandbox), "observes_calls", False):
        sandbox = sandbox.sandbox
    backend = sandbox
    while isinstance(backend, SandboxWrapper):
        backend = backend.sandbox
    observer = getattr(backend, "call_observer", None)
    if observer is not None:
        backend.call_observer = None
    try:
        yield sandbox
    finally:
        if observer is not None:
            backend.call_observer = observer


def probe(sandbox) -> str | None:
    """Runs one trivial cell in a fresh session of `sandbox`: None when it ran, else the sandbox's reason.

    A failure is tried again in another fresh session, as the rollout retries a call: once, or as many times as the
    sandbox has servers (a remote one places each new session away from the servers that just failed)."""
    problem = None
    for _ in range(max(2, len(getattr(sandbox, "urls", None) or ()))):
        problem = _probe_once(sandbox)
        if problem is None:
            return None
    return problem


def _probe_once(sandbox) -> str | None:
    session = None
    try:
        session = sandbox.session()
        [result] = sandbox.run_many([(session, PROBE_CODE)])
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises is the reason to report
        return f"{type(exc).__name__}: {exc}"
    finally:
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()
    return (result.output or NO_MESSAGE) if result.infra_error else None


def _stop_if_any(problem: str | None, accelerator, what: str) -> None:
    """Raises `SandboxUnavailableError` on every process when `problem` is set on any of them."""
    anywhere = problem is not None
    if accelerator is not None and getattr(accelerator, "num_processes", 1) > 1:
        import torch

        flag = torch.tensor([anywhere], dtype=torch.int32, device=accelerator.device)
        anywhere = bool(accelerator.gather(flag).any())
    if not anywhere:
        return
    if problem is None:
        problem = "another process's sandbox failed (its own message gives the reason)"
    raise SandboxUnavailableError(f"{what}: {one_line(problem)}")


__all__ = ["PROBE_CODE", "SandboxHealth", "SandboxUnavailableError", "WatchedSandbox", "probe"]
