"""Reading what a run left behind: TRL's log history, the runs inside a folder, and what the run was.

A leaf module (no torch, no TRL): `retool-trl plot` and the console read logs through it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

RUN_INFO = "retool_run.json"  # written next to trainer_state.json by `retool-trl train`/`sft` (see `write_run_info`)


def accuracy_of(logs: dict) -> float | None:
    """The fraction of correct completions in one log: `retool/accuracy` (logged by `boxed_accuracy`), else the
    mean of the first `rewards/*/mean` read as ReTool's default +1/-1 reward (logs written before that key)."""
    value = logs.get("retool/accuracy")
    if isinstance(value, (int, float)):
        return float(value)
    key = next((k for k in logs if k.startswith("rewards/") and k.endswith("/mean")), None)
    value = logs.get(key) if key else None
    return (value + 1) / 2 if isinstance(value, (int, float)) and -1 <= value <= 1 else None


def _state_file(path: Path) -> Path | None:
    """`path`'s own trainer_state.json, else the one of its latest `checkpoint-*`."""
    checkpoints = sorted(
        path.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1
    )
    candidates = [path / "trainer_state.json", *(c / "trainer_state.json" for c in reversed(checkpoints))]
    return next((c for c in candidates if c.is_file()), None)


def find_runs(folder: str | Path) -> dict[str, Path]:
    """The training runs in `folder`: `{name: trainer_state.json}`. `folder` is a run (its own `trainer_state.json`
    or a checkpoint's), a `trainer_state.json`, or a folder of runs such as the quickstart's (`tool_rl/`, `text_rl/`).

    Raises:
        FileNotFoundError: nothing to read, naming what was looked for.
    """
    path = Path(folder)
    if path.is_file():
        return {path.parent.name: path}
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} does not exist.")
    own = _state_file(path)
    if own is not None:
        return {path.resolve().name: own}
    runs = {child.name: child / "trainer_state.json" for child in sorted(path.iterdir())}
    runs = {name: state for name, state in runs.items() if state.is_file()}
    if not runs:
        raise FileNotFoundError(
            f"no trainer_state.json in {str(path)!r}, its checkpoint-* folders or its subfolders: point --run at the "
            "output_dir of a finished `retool-trl train`/`sft` run, or at a quickstart folder (with tool_rl/ and "
            "text_rl/)."
        )
    return runs


def load_log_history(run: str | Path) -> list[dict]:
    """The `log_history` of one run: `run` is a `trainer_state.json`, a checkpoint folder, or an `output_dir` (its
    own `trainer_state.json`, else the one of its latest `checkpoint-*`)."""
    path = Path(run)
    if path.is_dir():
        found = _state_file(path)
        if found is None:
            raise FileNotFoundError(
                f"no trainer_state.json in {str(path)!r} or its checkpoint-* folders: point --run at the output_dir "
                "of a finished `retool-trl train`/`sft` run (or of a run with save_strategy set)."
            )
        path = found
    elif not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist.")
    try:
        return list(json.loads(path.read_text())["log_history"])
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{str(path)!r} is not a trainer_state.json with a log_history ({error}).") from None


def read_run_info(folder: str | Path) -> dict:
    """What a run was (model, dataset, seed, reward range), from `RUN/retool_run.json` or a quickstart's
    `summary.json`; `{}` when neither is there."""
    folder = Path(folder)
    folder = folder.parent if folder.is_file() else folder
    for candidate in (folder / RUN_INFO, folder.parent / RUN_INFO):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    # A quickstart's summary: in the folder plotted, or in its parent when one of its runs is plotted alone.
    summary = next((f / "summary.json" for f in (folder, folder.parent) if (f / "summary.json").is_file()), None)
    if summary is not None:
        data = json.loads(summary.read_text())
        settings = data.get("settings", {})
        runs = {name: entry for name, entry in data.items() if isinstance(entry, dict) and "steps" in entry}
        return {
            "model": Path(str(data.get("model", ""))).name or None,
            "task": settings.get("task"),
            "seed": settings.get("seed"),
            "reward_range": [-1.0, 1.0],  # the quickstart's boxed_accuracy
            "runs": list(runs),  # in the order they were trained
            "evals": runs,  # held-out `<metric>_before` / `<metric>_after`
        }
    return {}


def write_run_info(output_dir: str | Path, **info) -> Path:
    """Writes `OUTPUT_DIR/retool_run.json` (model, dataset, seed, reward range) for titles of `retool-trl plot`."""
    path = Path(output_dir) / RUN_INFO
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2, default=str) + "\n")
    return path


def series(history: Sequence[dict], key: str, transform=None) -> tuple[list[float], list[float]]:
    """`(steps, values)` of a logged key (or of `transform(entry)` when `key` is `None`), numbers only."""
    steps, values = [], []
    for entry in history:
        value = transform(entry) if key is None else entry.get(key)
        if key is not None and transform is not None and isinstance(value, (int, float)):
            value = transform(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(entry.get("step", len(steps)))
            values.append(float(value))
    return steps, values


__all__ = ["RUN_INFO", "accuracy_of", "find_runs", "load_log_history", "read_run_info", "series", "write_run_info"]
