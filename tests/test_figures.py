"""The figures a user reads in README.md and docs/performance.md are the ones the benchmarks wrote.

Each benchmark appends a JSON line to `scripts/results/<benchmark>.jsonl`; `scripts/render_figures.py` renders the
performance tables from those lines. These tests stand for a user who reruns a documented command and compares: a
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

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
        [sys.executable, str(ROOT / "scripts" / "render_figures.py"), "--check"],
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
    for name in ("rollout", "vllm_rollout", "async_rollout", "async_rollout_gpu_model", "sandbox", "sandbox_scale"):
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
