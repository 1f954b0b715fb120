"""Running `python -m retool_trl` as a user would, from the repository, and reading its one error line."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, cwd=REPO, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "retool_trl", *args], capture_output=True, text=True, timeout=280, env=env, cwd=cwd
    )


def one_error_line(done: subprocess.CompletedProcess, command: str) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"retool-trl {command}: error:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
    return errors[0]
