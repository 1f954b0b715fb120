"""`scripts/bench_sandbox.py --server-capacity --json` at a tiny size: the real `retool-trl sandbox-server` on
127.0.0.1 and the subprocess-per-call baseline service run the same GRPO-shaped load, and the last stdout line is
the object DESIGN §8 names (one row per size and service, failures by every kind)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = {"sessions", "calls_per_s_per_core", "p50_ms", "p99_ms", "failures_by_kind"}


def test_server_capacity_json_shape(tmp_path):
    env = {**os.environ, "RETOOL_RESULTS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "scripts/bench_sandbox.py", "--server-capacity", "--sessions", "2", "3"]
    done = subprocess.run(
        [*command, "--max-cell-ms", "2", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for service in ("capacity", "baseline"):
        rows = out[service]
        assert [row["sessions"] for row in rows] == [2, 3]
        for row in rows:
            assert ROW_KEYS <= set(row)
            assert set(row["failures_by_kind"]) == {"cell_error", "cell_timeout", "sandbox_wait", "sandbox_failure"}
            assert row["calls_per_s_per_core"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"]
            # The load's own failures, and no other: every planned exception came back as the cell's error.
            assert row["failures_by_kind"]["cell_error"] == row["intended_failures"]["cell_error"]
            assert row["failures_by_kind"]["sandbox_failure"] == 0
    recorded = (tmp_path / "sandbox_capacity.jsonl").read_text().splitlines()
    assert len(recorded) == 1 and json.loads(recorded[0])["capacity"] == out["capacity"]
