"""`bench_sandbox.py --scale`'s closing burst, at a tiny size: the measurement runs through the public API and each
session it opens is really gone after its call (the kernel's cgroup files say so), so the figure measures a burst
in which sessions close, as completions that answer after one call do."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

from sandbox_scale import _live_jails, bench_burst_close  # noqa: E402

from retool_trl.sandbox import LocalSandbox  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_the_closing_burst_closes_every_session_it_opens():
    with LocalSandbox(num_workers=2, timeout_s=10.0, preload=(), spares=0) as sandbox:
        if not sandbox.isolation_report().get("pids_cgroup"):
            pytest.skip("needs per-session cgroups to count live jails from the kernel's side")
        sandbox.session().run("pass")
        out = bench_burst_close(sandbox, size=12, bursts=1, threads=4, idle_s=0.5)
        assert 0 < out["p50_ms"] <= out["p99_ms"] <= out["max_ms"]
        deadline = time.monotonic() + 10
        while _live_jails(sandbox) and time.monotonic() < deadline:  # reserved jails left unused, being retired
            time.sleep(0.05)
        # Every session of the burst was closed right after its call: none of its jails is left running.
        assert len(_live_jails(sandbox)) <= 1, _live_jails(sandbox)
