"""Runs `scripts/bench/bench_rollout.py` with this command's arguments: the same output (the JSON last line
with `--json`), results line and exit status. The benchmark lives with the others in `scripts/bench/`; this path
stays because the docs, CI and the recorded results name it."""

import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "bench"
sys.path.insert(0, str(BENCH))  # as when the benchmark is run from its own folder: its modules import by name
runpy.run_path(str(BENCH / "bench_rollout.py"), run_name="__main__")
