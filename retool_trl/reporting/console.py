"""The training console every command shares: a compact progress line on the console, every log in a file.

Transformers' `ProgressCallback` writes each log dict (about 40 keys, 2 KB) above the bar at every logging step, which
buries the bar, and `PrinterCallback` prints the same dicts without one. [`CompactProgressCallback`] replaces both:
on a terminal it is a tqdm bar whose postfix carries reward, accuracy, code ratio and calls per completion (tqdm
shows the step rate); when the output is a file or a pipe (where a bar would be a line of carriage returns) it prints
one line per logging step with the same numbers and the seconds per step. Both end with where the steps' time went
(`gen 61% tool 9% train 27%`: generation, the interpreter, the log-prob passes and the update). Every log, with its
step, goes to `RUN/log.jsonl`; TRL's `trainer_state.json` keeps them too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from transformers.trainer_callback import PrinterCallback, ProgressCallback


def accuracy_of(logs: dict) -> float | None:
    """The fraction of correct completions in a log: `retool/accuracy` (logged by `boxed_accuracy`), else the mean
    reward of the first `rewards/*/mean` read as +1/-1 (ReTool's default reward values)."""
    if isinstance(logs.get("retool/accuracy"), (int, float)):
        return float(logs["retool/accuracy"])
    key = next((k for k in logs if k.startswith("rewards/") and k.endswith("/mean")), None)
    value = logs.get(key) if key else None
    return (value + 1) / 2 if isinstance(value, (int, float)) and -1 <= value <= 1 else None


class CompactProgressCallback(ProgressCallback):
    """A few numbers per logging step on the console, and every log dict in `log_path` (JSON lines).

    Args:
        log_path (`str` or `Path`): The JSON-lines file (rewritten when training begins).
        stream (*optional*): Where the console lines go (default: `sys.stderr`, as tqdm's bar). A bar is drawn when
            it is a terminal; otherwise one line per log.
        label (`str`, *optional*): Starts every line (`text_rl | step 3/60 ...`), and lines replace the bar: for runs
            that share one console.
    """

    # (label, logged key, format). GRPO runs show the first five; SFT runs the last two.
    SHOWN = (
        ("reward", "reward", "{:+.2f}"),
        ("acc", None, "{:.0%}"),
        ("code", "retool/code_ratio", "{:.0%}"),
        ("calls", "retool/calls_per_completion", "{:.1f}"),
        ("recovery", "retool/recovery_rate", "{:.0%}"),
        ("loss", "loss", "{:.3f}"),
        ("token acc", "mean_token_accuracy", "{:.0%}"),
    )

    def __init__(self, log_path: str | Path, stream=None, label: str | None = None):
        super().__init__()
        self.log_path = Path(log_path)
        self._stream = stream
        self._prefix = f"{label} | " if label else ""
        self._last = None  # (time, step) of the previous log, for the step rate of plain lines

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stderr

    def _is_terminal(self) -> bool:
        if self._prefix:  # two bars on one terminal would overwrite each other
            return False
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def on_train_begin(self, args, state, control, **kwargs):
        self.current_step = 0
        self._last = (time.perf_counter(), state.global_step)
        if not state.is_world_process_zero:
            return
        if self._is_terminal():
            super().on_train_begin(args, state, control, **kwargs)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")

    def on_step_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_step_end(args, state, control, **kwargs)
        elif state.is_world_process_zero and state.global_step == 1 and (args.logging_steps or 0) > 1:
            # Without a terminal, the first line would wait for the first log: say the run is moving, and when.
            seconds = time.perf_counter() - self._last[0]
            print(
                f"{self._prefix}step 1/{state.max_steps} {seconds:.1f} s | next line at step "
                f"{int(args.logging_steps)}",
                file=self.stream,
                flush=True,
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self.training_bar is not None:
            super().on_train_end(args, state, control, **kwargs)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        with self.log_path.open("a") as handle:
            handle.write(json.dumps({"step": state.global_step, **logs}, default=str) + "\n")
        line = self.summary(logs)
        if not line:  # the final log (runtime, mean loss) keeps the last line shown
            return
        if self.training_bar is not None:
            self.training_bar.set_postfix_str(line, refresh=False)
            return
        now, step = time.perf_counter(), state.global_step
        rate = ""
        if self._last is not None and step > self._last[1]:
            rate = f" {(now - self._last[0]) / (step - self._last[1]):.1f} s/step"
        self._last = (now, step)
        print(f"{self._prefix}step {step}/{state.max_steps}{rate} | {line}", file=self.stream, flush=True)

    @classmethod
    def summary(cls, logs: dict) -> str:
        """The compact line for one log dict, e.g. `reward +0.50 | acc 75% | code 98% | calls 2.1`."""
        parts = []
        for label, key, fmt in cls.SHOWN:
            if parts and label == "loss":  # a GRPO log: its loss says little; an SFT log has no reward
                break
            value = accuracy_of(logs) if key is None else logs.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                parts.append(f"{label} {fmt.format(value)}")
        split = stage_split(logs)
        return " | ".join(parts + [split] if parts and split else parts)


# (label, stages) of the console's split of a step; the rest (rewards, preparing the batch) is shown only when it
# takes a tenth of the step or more.
SPLIT = (("gen", ("generation",)), ("tool", ("interpreter",)), ("train", ("logprobs", "update")))
SPLIT_MINOR = (("sync", ("weight_sync",)), ("reward", ("rewards",)), ("other", ("other",)))


def stage_split(logs: dict) -> str:
    """Where the logged steps' time went, in a few characters: `gen 61% tool 9% train 27%` (`retool/time/*`)."""

    def share(stages):
        values = [logs.get(f"retool/time/{stage}_share") for stage in stages]
        return sum(v for v in values if isinstance(v, (int, float))) if any(v is not None for v in values) else None

    parts = [f"{label} {value:.0%}" for label, stages in SPLIT if (value := share(stages)) is not None]
    parts += [f"{label} {value:.0%}" for label, stages in SPLIT_MINOR if (value := share(stages) or 0) >= 0.1]
    return " ".join(parts)


def use_compact_console(trainer, log_path: str | Path, label: str | None = None) -> CompactProgressCallback:
    """Replaces the trainer's console callbacks (which print every log dict) with a [`CompactProgressCallback`]
    (`label`: see there)."""
    for noisy in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(noisy)
    callback = CompactProgressCallback(log_path, label=label)
    trainer.add_callback(callback)
    return callback


__all__ = ["CompactProgressCallback", "accuracy_of", "stage_split", "use_compact_console"]
