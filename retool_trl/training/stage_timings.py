"""Per-stage timings of every training step, logged under `retool/time/` through TRL's metric dict (so every
`report_to` receives them), with the interpreter's calls under `retool/interpreter/`.

[`StageTimings`] is mixed into `ReToolTrainer` ahead of `GRPOTrainer` and wraps TRL's own methods, each in one stage
of a [`StageClock`] (nested stages pause the enclosing one, so nothing is counted twice):

- `generation`: the rollout's engine time and the decoding (`_generate`);
- `interpreter`: cells running while no engine request is (moved out of whatever stage was running: the sandbox);
- `weight_sync`: pushing the new weights to vLLM (`vllm_generation.sync_weights`);
- `rewards`: the reward functions (`_calculate_rewards`);
- `logprobs`: the old-policy and reference log-prob passes (`_get_per_token_logps_and_entropies` outside the loss;
  the loss's own forward pass is the update's);
- `update`: forward, backward, clipping and the optimizer step (`training_step`, and what follows it in the step);
- `other`: the rest of the batch's preparation: padding, gathering, advantages, metrics (`_prepare_inputs`).

A step runs from the `on_step_begin` to the `on_step_end` callback; each stage is logged in seconds and as its share
of the step (`retool/time/<stage>_share`), with the step's wall seconds (`retool/time/step`). The timings are the main
process's (the one that logs). Their cost is a few clock reads per stage and a lock per sandbox call
(`scripts/bench/bench_stage_timings.py` measures it).
"""

from __future__ import annotations

import contextlib

from transformers import TrainerCallback

from .stage_clock import STAGES, BusyTracker, CallStats, StageClock, TimedSandbox, timed_engine


class StageTimingCallback(TrainerCallback):
    """Opens the trainer's [`StageClock`] at each step's begin and logs the stages at its end."""

    def __init__(self, trainer: StageTimings):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._time_weight_sync()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._stage_clock.begin_step()
        self.trainer._call_stats.recording = True

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        step_s, seconds = trainer._stage_clock.end_step()
        trainer._call_stats.recording = False
        metrics = stage_metrics(step_s, seconds)
        metrics.update(trainer._call_stats.take(seconds["interpreter"]))
        for name, value in metrics.items():
            trainer._metrics["train"][name].append(value)


def stage_metrics(step_s: float, seconds: dict[str, float]) -> dict[str, float]:
    """`retool/time/*` of one step: its wall seconds, and each stage's seconds and share of them."""
    metrics = {"retool/time/step": step_s}
    for stage in STAGES:
        metrics[f"retool/time/{stage}"] = seconds.get(stage, 0.0)
        metrics[f"retool/time/{stage}_share"] = seconds.get(stage, 0.0) / step_s if step_s > 0 else 0.0
    return metrics


class StageTimings:
    """Mixed into a `GRPOTrainer` subclass ahead of `GRPOTrainer`: times its steps by stage (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._busy = BusyTracker()
        self._stage_clock = StageClock(self._busy)
        self._call_stats = CallStats()
        self._timed: TimedSandbox | None = None
        self.add_callback(StageTimingCallback(self))

    def _stage(self, name: str):
        clock = getattr(self, "_stage_clock", None)  # TRL's constructor may call a timed method before ours ran
        return clock.stage(name) if clock is not None else contextlib.nullcontext()

    def timed_sandbox(self, sandbox):
        """`sandbox` with its calls timed (the same wrapper while the sandbox is the same)."""
        if self._timed is None or self._timed.sandbox is not sandbox:
            self._timed = TimedSandbox(sandbox, self._busy, self._call_stats)
        return self._timed

    def timed_engine(self, engine):
        """An async rollout's turn engine with its requests counted (cells running meanwhile are not waited on)."""
        return timed_engine(engine, self._busy)

    def _time_weight_sync(self) -> None:
        generation = getattr(self, "vllm_generation", None) if getattr(self, "use_vllm", False) else None
        sync = getattr(generation, "sync_weights", None)
        if sync is None or getattr(sync, "_retool_timed", False):
            return

        def sync_weights(*args, **kwargs):
            with self._stage("weight_sync"):
                return sync(*args, **kwargs)

        sync_weights._retool_timed = True
        generation.sync_weights = sync_weights

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._timed is not None:
                self._timed.unobserve()

    # TRL's methods, each in its stage --------------------------------------------------------------------------
    def training_step(self, *args, **kwargs):
        with self._stage("update"):
            output = super().training_step(*args, **kwargs)
        if getattr(self, "_stage_clock", None) is not None:
            self._stage_clock.base = "update"  # what follows until the step's end: clipping, the optimizer step
        return output

    def _prepare_inputs(self, *args, **kwargs):
        with self._stage("other"):
            return super()._prepare_inputs(*args, **kwargs)

    def _generate(self, *args, **kwargs):
        with self._stage("generation"):
            return super()._generate(*args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        with self._stage("rewards"):
            return super()._calculate_rewards(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        clock = getattr(self, "_stage_clock", None)
        if clock is None or clock.current == "update":  # the loss's own forward pass: part of the update
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        with clock.stage("logprobs"):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)


__all__ = ["StageTimingCallback", "StageTimings", "stage_metrics"]
