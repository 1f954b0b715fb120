"""The figures a user reads in README.md and docs/performance.md are the ones the benchmarks wrote.

Each benchmark appends a JSON line to `scripts/results/<benchmark>.jsonl`; `scripts/render/render_figures.py` renders
the performance tables from those lines. These tests stand for a user who reruns a documented command and compares: a
figure edited by hand, or a results line added without re-rendering, fails here (and in CI).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "render"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # results_log

import render_figures  # noqa: E402
import results_log  # noqa: E402


def _copy_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    for page in render_figures.PAGES:
        shutil.copy(ROOT / page, root / page)
    shutil.copytree(ROOT / "scripts" / "results", root / "scripts" / "results")
    return root


def test_the_docs_figures_are_the_ones_in_the_results_files():
    """A user compares README/docs with the results files: the rendered tables must be exactly what they hold."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render" / "render_figures.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_every_page_has_its_figure_blocks():
    """The tables are rendered, not hand-written: each page carries the blocks the renderer fills."""
    readme = (ROOT / "README.md").read_text()
    perf = (ROOT / "docs" / "performance.md").read_text()
    assert "<!-- figures:readme -->" in readme
    for name in (
        "rollout",
        "vllm_rollout",
        "async_rollout",
        "async_rollout_gpu_model",
        "sandbox",
        "sandbox_scale",
        "sandbox_capacity",
    ):
        assert f"<!-- figures:{name} -->" in perf, name


def test_a_figure_edited_by_hand_fails_the_check(tmp_path):
    """Someone edits a figure in the docs instead of rerunning the benchmark: the check names the stale page."""
    root = _copy_repo(tmp_path)
    page = root / "docs" / "performance.md"
    text = page.read_text()
    # The first sandbox-scale run's burst, as rendered from its results line.
    row = next(line for line in text.splitlines() if line.startswith("| burst after `reserve`, first call"))
    measured = row.split("|")[2]
    assert re.fullmatch(r" \d+ / \d+ / \d+ ", measured), row
    page.write_text(text.replace(row, row.replace(measured, " 1 / 2 / 3 ", 1), 1))
    assert render_figures.main(["--check", "--root", str(root)]) == 1
    assert render_figures.main(["--root", str(root)]) == 0  # re-rendering restores the measured figure
    assert row in page.read_text()


def test_a_new_results_line_changes_the_docs_and_says_how_it_was_measured(tmp_path, monkeypatch):
    """A benchmark run appends its line with its conditions; the tables then show it, and a line measured with
    other flags than the documented command says so beside the figure."""
    root = _copy_repo(tmp_path)
    monkeypatch.setenv("RETOOL_RESULTS_DIR", str(root / "scripts" / "results"))
    # The only line: where the documented command has a line of its own, the table shows that one instead.
    (root / "scripts" / "results" / "sandbox.jsonl").unlink(missing_ok=True)
    monkeypatch.setattr(sys, "argv", ["scripts/bench_sandbox.py", "--sessions", "8", "--json"])
    run = results_log.conditions()
    for key in ("date", "commit", "command", "versions", "cpu_count", "load_avg_before"):
        assert run[key] is not None, key
    assert "torch" in run["versions"]
    figures = {"p50_ms": 0.5, "p99_ms": 4.0, "baseline_p50_ms": 10.0, "speedup_p50": 20.0, "throughput_per_s": 1e3}
    path = results_log.record("sandbox", figures, run)
    line = json.loads(path.read_text().splitlines()[-1])
    assert line["p50_ms"] == 0.5 and line["run"]["command"].endswith("scripts/bench_sandbox.py --sessions 8 --json")
    assert line["run"]["load_avg_after"]

    assert render_figures.main(["--check", "--root", str(root)]) == 1  # the docs no longer match the results
    assert render_figures.main(["--root", str(root)]) == 0
    perf = (root / "docs" / "performance.md").read_text()
    block = perf.split("<!-- figures:sandbox -->")[1].split("<!-- /figures:sandbox -->")[0]
    assert "**0.50** / 4.00" in block
    assert "measured as `python" in block and "--sessions 8" in block and "not the command above" in block
    readme = (root / "README.md").read_text()
    assert "**0.50 ms** vs 10.00 ms (20.0x)" in readme and "--sessions 8" in readme


def test_no_record_keeps_a_try_out_out_of_the_file(tmp_path, monkeypatch):
    """A user trying a benchmark with tiny sizes passes --no-record: no line is added."""
    monkeypatch.setenv("RETOOL_RESULTS_DIR", str(tmp_path))
    assert results_log.record("sandbox", {"p50_ms": 1.0}, results_log.conditions(), enabled=False) is None
    assert not (tmp_path / "sandbox.jsonl").exists()


@pytest.mark.parametrize("command", ["python3", "/usr/bin/python", ".venv-engines/bin/python"])
def test_the_interpreter_path_does_not_make_another_command(command):
    """The same benchmark run from another interpreter path measures the same thing: not flagged as different."""
    key = render_figures.command_key(f"{command} scripts/bench_rollout.py --backend vllm --json")
    assert key == ("scripts/bench_rollout.py", "--backend", "vllm")


def _capacity_row(sessions: int, rate: float, failures: dict) -> dict:
    row = {"sessions": sessions, "runs": 3, "calls": 3 * sessions, "failures_by_kind": failures}
    for key, value in (("calls_per_s_per_core", rate), ("p50_ms", 12.0), ("p99_ms", 900.0)):
        row.update({key: value, f"{key}_min": value * 0.9, f"{key}_max": value * 1.1})
    row["intended_failures"] = {"cell_error": 30, "cell_timeout": 3}
    return row


def test_the_capacity_table_and_its_extrapolation_come_from_the_newest_line(tmp_path, monkeypatch):
    """A user sizing a node reads the capacity table: every figure, the arithmetic of the per-node sentence, and a
    failure the load did not mean (flagged, not hidden among the intended ones) come from the results line."""
    import render_capacity

    monkeypatch.setenv("RETOOL_RESULTS_DIR", str(tmp_path))
    old = {"capacity": [_capacity_row(64, 1.0, {})], "baseline": [_capacity_row(64, 0.5, {})], "cpu_count": 2}
    new = {
        "capacity": [
            _capacity_row(64, 40.0, {"cell_error": 30}),
            _capacity_row(1024, 50.0, {"cell_error": 30}),
            _capacity_row(4096, 60.0, {"cell_error": 30, "sandbox_wait": 5}),  # overloaded: calls failed waiting
        ],
        "baseline": [
            _capacity_row(64, 4.0, {}),
            _capacity_row(1024, 5.0, {"sandbox_error": 2}),
            _capacity_row(4096, 6.0, {}),
        ],
        "cpu_count": 2,
        "workers": 2,
        "isolation": "bwrap",
        "max_cell_ms": 1000.0,
    }
    for line in (old, new):
        results_log.record("sandbox_capacity", line, {"command": render_capacity.COMMAND}, enabled=True)
    text = render_capacity.blocks(tmp_path)["sandbox_capacity"]
    assert "| 1,024 | `retool-trl sandbox-server` | **50.0 (45.0-55.0)** |" in text
    assert "| 64 | subprocess per call | 4.0 (3.6-4.4) |" in text
    assert "cell_error 30 (meant 30)" in text and "sandbox_error 2 (**not meant**)" in text
    # 64 cores x 50 calls/s per core = 3,200 calls/s; 1,536 calls in 0.48 s, and 1,536 / (64 x 5) = 4.8 s.
    assert "64 x 50.0 = 3,200 calls/s, a step's 1,536 calls in 0.5 s (subprocess per call: 4.8 s)" in text
    assert "an extrapolation, not a measurement" in text and "line 2" in text
    # The per-node sentence uses the busiest load carried without unmeant failures, not the overloaded one.
    assert "At 1,024 sessions" in text and "sandbox_wait 5 (**not meant**)" in text
    png = render_capacity.draw(tmp_path)
    assert png is not None and png.stat().st_size > 10_000


def test_no_page_repeats_a_section():
    """A merge that pasted a section twice leaves a reader two versions of the same facts, one stale: every page's
    headings are unique."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        headings = [line for line in page.read_text().splitlines() if re.match(r"#{1,4} ", line)]
        repeated = sorted({h for h in headings if headings.count(h) > 1})
        assert not repeated, f"{page.name} repeats {repeated}"
