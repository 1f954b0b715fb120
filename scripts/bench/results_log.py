"""Where every benchmark keeps what it measured: one JSON line per run in `scripts/results/<benchmark>.jsonl`.

A line holds the benchmark's own figures (the object it prints with `--json`, each median with its `_min`/`_max`)
and, under `run`, the conditions they were measured under: UTC date, git commit (and whether the tree had
uncommitted changes), the exact command, package versions, CPU count and the load average before and after.
`scripts/render/render_figures.py` renders the docs' performance tables from these lines, so a figure a user reads is
the one a command wrote. `--no-record` (added by `add_arguments`) keeps a try-out run out of the file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
PACKAGES = ("torch", "transformers", "trl", "vllm", "retool-trl")


def results_dir() -> Path:
    # Tests point this elsewhere so that a smoke run never adds a line to the shipped files.
    return Path(os.environ.get("RETOOL_RESULTS_DIR", RESULTS_DIR))


def add_arguments(parser) -> None:
    parser.add_argument(
        "--no-record",
        action="store_true",
        help=f"do not append this run's JSON line to {RESULTS_DIR.name}/<benchmark>.jsonl (for try-out runs)",
    )


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=RESULTS_DIR.parent, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def conditions() -> dict:
    """What the machine was doing before the benchmark started: call first thing, before any warm-up."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    # Results files appended since the last commit do not change what is measured.
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)scripts/results")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": _git("rev-parse", "--short=10", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "command": shlex.join([Path(sys.executable).name, *_script_argv()]),
        "python": platform.python_version(),
        "versions": versions,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "load_avg_before": [round(x, 2) for x in os.getloadavg()],
    }


def _script_argv() -> list[str]:
    argv = list(sys.argv)
    if argv and os.path.isabs(argv[0]):
        try:
            argv[0] = os.path.relpath(argv[0], RESULTS_DIR.parent.parent)
        except ValueError:
            pass
    return argv


def record(benchmark: str, figures: dict, run: dict, *, enabled: bool = True) -> Path | None:
    """Append `figures` with the run's conditions (from `conditions()`) to `<benchmark>.jsonl`; returns its path."""
    if not enabled:
        return None
    run = {**run, "load_avg_after": [round(x, 2) for x in os.getloadavg()]}
    path = results_dir() / f"{benchmark}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({**figures, "run": run}, sort_keys=False)
    with path.open("a") as f:
        f.write(line + "\n")
    print(f"recorded in {path}", file=sys.stderr)
    return path


def read(benchmark: str, directory: Path | None = None) -> list[dict]:
    path = (directory or results_dir()) / f"{benchmark}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
