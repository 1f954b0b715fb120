"""`scripts/ci/sandbox_soak.py` for about 20 seconds on the level `auto` picks here (bubblewrap as root on a host;
Landlock in a default container or as a normal user without user namespaces): its last line is the JSON object the
CI stage and the results file read, it ran benign and hostile cells over many sessions, its exit status says whether
an invariant broke, and on bubblewrap as root (where the contract holds whole) nothing broke, nothing was left and
the trainer stayed flat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ci" / "sandbox_soak.py"

pytestmark = pytest.mark.timeout(300)


def test_a_short_soak_reports_every_invariant_it_checked(tmp_path):
    env = {**os.environ, "RETOOL_RESULTS_DIR": str(tmp_path)}
    command = [sys.executable, str(SCRIPT), "--minutes", "0.33", "--level", "auto", "--seed", "7", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, env=env)
    if done.returncode == 2:
        pytest.skip(f"no isolation level starts here: {done.stderr.strip()[-300:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("minutes", "level", "seed", "cells", "benign", "benign_ok", "hostile", "violations", "leaks"):
        assert key in row, key
    assert set(row["leaks"]) == {"processes", "cgroups", "scratch", "fds"}
    assert row["cells"] >= row["benign"] + row["hostile"] > 0 and row["benign"] > 0 and row["hostile"] > 0
    assert row["sessions"] >= 10, row["sessions"]
    # The exit status is the verdict: 1 exactly when an invariant not expected broken broke.
    assert done.returncode == (1 if row["unexpected"] else 0), done.stdout[-2000:]
    assert row["violations"] == sorted(row["violation_counts"])
    recorded = [json.loads(line) for line in (tmp_path / "sandbox_soak.jsonl").read_text().splitlines()]
    assert recorded[-1]["cells"] == row["cells"] and "commit" in recorded[-1]["run"]
    if row["level"] == "bwrap" and os.geteuid() == 0:
        assert row["violations"] == [], row["violation_examples"]
        assert row["benign_ok"] == row["benign"]
        assert not any(row["leaks"].values())
