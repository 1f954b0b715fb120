"""Sandboxes that fail (one that goes away after its probe) and a port nothing listens on, for the tests of how
failures stop a run."""

from __future__ import annotations

import socket

from retool_trl.sandbox import ExecResult
from retool_trl.testing import FakeSandbox


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------- the trainer's own check
class DownAfterProbe(FakeSandbox):
    """A sandbox that runs its first call and then fails every call for its own reasons (a service that goes away
    during the run)."""

    def run_many(self, pairs):
        if not self.batches:
            return super().run_many(pairs)
        self.batches.append(len(pairs))
        return [ExecResult("SandboxError: worker pool lost", False, False, 0.0, infra_error=True) for _ in pairs]


SCRIPTS = ["<code>print(1)</code>\\boxed{1}", "<code>print(2)</code>\\boxed{2}", "\\boxed{4}", "<code>print(4)</code>"]


class FailsFirst:
    """A sandbox that fails its first `n` calls after the probe for its own reasons (a short burst of HTTP 429 from a
    busy service, a retry included), then runs everything; `message` is what the failed calls say."""

    def __init__(self, n: int, message: str = "SandboxError: HTTP 429 (after 4 attempts)"):
        from retool_trl.testing import FakeSandbox

        self.inner, self.left, self.message, self.probes = FakeSandbox(), n, message, 0

    def session(self):
        return self.inner.session()

    def run_many(self, pairs):
        from retool_trl.sandbox import ExecResult

        pairs = list(pairs)
        results = []
        for session, code in pairs:
            if code == "1":
                self.probes += 1
                results += self.inner.run_many([(session, code)])
            elif self.left:
                self.left -= 1
                results.append(ExecResult(self.message, False, False, 0.0, infra_error=True))
            else:
                results += self.inner.run_many([(session, code)])
        return results

    def close(self):
        pass
