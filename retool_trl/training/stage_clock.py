"""Where a training step's wall time goes: a clock of exclusive stages, and the interpreter's share of the rollout.

[`StageClock`] attributes every moment of a step to one stage: entering a stage pauses the one it is nested in (the
weight sync inside generation, the log-prob pass inside the scoring), so nested calls are never counted twice. The
interpreter is not a stage of the trainer's thread: the async rollout runs cells in worker threads while the engine
generates for other completions. [`BusyTracker`] counts what is in flight in every thread, and the interpreter's
time is the time during which cells were running and no engine request was (in the barrier loop, where the two
alternate, simply the time cells ran); the clock moves it out of whatever stage the trainer's thread was in.

[`TimedSandbox`] and [`timed_engine`] report to the tracker; [`CallStats`] keeps what the step's calls were: caller-
seen latency, the waits before they started (a CPU slot, a jail), fresh-jail starts, and failures by kind.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, defaultdict

from ..sandbox.base import FAILURE_KINDS, SandboxWrapper, failure_kind

STAGES = ("generation", "interpreter", "weight_sync", "rewards", "logprobs", "update", "other")


class BusyTracker:
    """Counts engine requests and sandbox calls in flight over all threads, and the seconds during which cells ran
    while no engine request did (`interpreter_seconds`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._engine = 0
        self._cells = 0
        self._since = time.perf_counter()
        self._alone = 0.0

    def _shift(self, now: float) -> None:
        if self._cells and not self._engine:
            self._alone += now - self._since
        self._since = now

    @contextlib.contextmanager
    def busy(self, what: str):
        """Around one engine request (`what="engine"`) or one sandbox call (`"cells"`)."""
        with self._lock:
            self._shift(time.perf_counter())
            setattr(self, f"_{what}", getattr(self, f"_{what}") + 1)
        try:
            yield
        finally:
            with self._lock:
                self._shift(time.perf_counter())
                setattr(self, f"_{what}", getattr(self, f"_{what}") - 1)

    def interpreter_seconds(self, now: float) -> float:
        """Seconds so far during which cells ran and the engine did not (an ever-growing total)."""
        with self._lock:
            running = now - self._since if self._cells and not self._engine else 0.0
            return self._alone + running


class StageClock:
    """Seconds per stage of the current step, stages exclusive (see the module docstring).

    Stages are entered by the trainer's own thread only; a stage entered from another thread (a reward function's
    worker) is part of whatever the trainer's thread is doing. Outside a step (evaluation, saving) nothing is counted.
    """

    def __init__(self, tracker: BusyTracker):
        self.tracker = tracker
        self.open = False
        self.base: str | None = None  # what the time outside every stage is, within the step (None: not counted)
        self._stack: list[str] = []
        self._owner: int | None = None
        self._seconds: dict[str, float] = defaultdict(float)
        self._mark = self._cells_mark = self._began = 0.0

    @property
    def current(self) -> str | None:
        return self._stack[-1] if self._stack else self.base

    def _accrue(self, now: float) -> None:
        elapsed = now - self._mark
        cells = self.tracker.interpreter_seconds(now)
        interpreter = min(max(cells - self._cells_mark, 0.0), elapsed)
        self._mark, self._cells_mark = now, cells
        stage = self.current
        if stage is None:
            return
        self._seconds["interpreter"] += interpreter
        self._seconds[stage] += elapsed - interpreter

    def begin_step(self) -> None:
        now = time.perf_counter()
        self.open, self.base, self._owner = True, None, threading.get_ident()
        self._stack.clear()
        self._seconds.clear()
        self._began = self._mark = now
        self._cells_mark = self.tracker.interpreter_seconds(now)

    def end_step(self) -> tuple[float, dict[str, float]]:
        """Closes the step: its wall seconds, and the seconds of every stage (`STAGES`, zeros included)."""
        now = time.perf_counter()
        if self.open:
            self._accrue(now)
        self.open = False
        return now - self._began, {stage: self._seconds.get(stage, 0.0) for stage in STAGES}

    @contextlib.contextmanager
    def stage(self, name: str):
        """Counts the time inside the block as `name` (pausing the enclosing stage), during a step, on the trainer's
        thread; elsewhere the block runs untimed."""
        if not self.open or threading.get_ident() != self._owner:
            yield
            return
        self._accrue(time.perf_counter())
        self._stack.append(name)
        try:
            yield
        finally:
            if self.open and self._stack and self._stack[-1] == name:
                self._accrue(time.perf_counter())
                self._stack.pop()


class CallStats:
    """What the step's sandbox calls were, kept while `recording`: latency as the caller saw it, waits, fresh-jail
    starts and failures by kind (thread-safe: the async rollout calls from worker threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.recording = False
        self._reset()

    def _reset(self) -> None:
        self.durations: list[float] = []  # each result's own `duration_s` (its execution)
        self.latencies: list[float] = []  # caller-seen, where the sandbox reports it (`call_observer`)
        self.wait_s = self.jail_s = 0.0
        self.fresh_jails = 0
        self.failures: Counter = Counter()

    def results(self, results) -> None:
        if not self.recording:
            return
        with self._lock:
            for result in results:
                self.durations.append(result.duration_s)
                kind = failure_kind(result)
                if kind:
                    self.failures[kind] += 1

    def raised(self, calls: int) -> None:
        """A `run_many` that raised: the sandbox's own failure, for each of its calls."""
        if self.recording:
            with self._lock:
                self.failures["sandbox_failure"] += calls
                self.durations.extend([0.0] * calls)

    def observe(self, wait_s: float, jail_s: float, latency_s: float) -> None:
        """The sandbox's `call_observer` (`retool_trl.sandbox.host.batch.CallObserver`)."""
        if not self.recording:
            return
        with self._lock:
            self.latencies.append(latency_s)
            self.wait_s += max(wait_s - jail_s, 0.0)
            self.jail_s += jail_s
            self.fresh_jails += jail_s > 0

    def take(self, interpreter_s: float) -> dict[str, float]:
        """The step's `retool/interpreter/*` metrics, and starts the next step's.

        `interpreter_s` (the interpreter stage's wall seconds) is split into execution, waiting for a CPU slot and
        fresh-jail starts in proportion to the calls' own seconds in each (calls overlap: only the split is theirs).
        """
        with self._lock:
            durations, latencies = self.durations, self.latencies or self.durations
            wait_s, jail_s, fresh, failures = self.wait_s, self.jail_s, self.fresh_jails, self.failures
            self._reset()
        calls = len(durations)
        metrics = {"retool/interpreter/calls": float(calls), "retool/interpreter/fresh_jails": float(fresh)}
        parts = {"exec": sum(durations), "wait": wait_s, "jail_start": jail_s}
        total = sum(parts.values())
        if total <= 0:  # no call, or none took measurable time: all of it was execution
            parts, total = {"exec": 1.0, "wait": 0.0, "jail_start": 0.0}, 1.0
        for part, seconds in parts.items():
            metrics[f"retool/interpreter/{part}_s"] = interpreter_s * seconds / total
        if latencies:
            ordered = sorted(latencies)
            metrics["retool/interpreter/latency_ms_p50"] = 1000 * percentile(ordered, 50)
            metrics["retool/interpreter/latency_ms_p99"] = 1000 * percentile(ordered, 99)
        for kind in FAILURE_KINDS:
            metrics[f"retool/interpreter/failed/{kind}"] = failures.get(kind, 0) / calls if calls else 0.0
        return metrics


def percentile(ordered: list[float], q: float) -> float:
    """The `q`-th percentile of sorted values, nearest rank (a value that was measured)."""
    if not ordered:
        return 0.0
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[min(int(rank), len(ordered)) - 1]


class TimedSandbox(SandboxWrapper):
    """A sandbox whose calls are counted by a [`BusyTracker`] and a [`CallStats`]; everything else is the wrapped
    backend's. The innermost local sandbox also tells `stats` how long each call waited (its `call_observer`)."""

    observes_calls = True

    def __init__(self, sandbox, tracker: BusyTracker, stats: CallStats):
        super().__init__(sandbox)
        self.tracker, self.stats = tracker, stats
        inner = sandbox
        while isinstance(inner, SandboxWrapper):  # wrappers hand unknown attributes on: set it on the backend
            inner = inner.sandbox
        if hasattr(inner, "call_observer"):
            inner.call_observer = stats.observe
        self._observed = inner

    def run_many(self, pairs):
        pairs = list(pairs)
        with self.tracker.busy("cells"):
            try:
                results = list(self.sandbox.run_many(pairs))
            except Exception:
                self.stats.raised(len(pairs))
                raise
        self.stats.results(results)
        return results

    def unobserve(self) -> None:
        if getattr(self._observed, "call_observer", None) == self.stats.observe:
            self._observed.call_observer = None


class _TimedEngine:
    """An async turn engine whose requests are counted by a [`BusyTracker`]."""

    def __init__(self, engine, tracker: BusyTracker):
        self.engine, self.tracker = engine, tracker

    def __getattr__(self, name):
        if "engine" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["engine"], name)

    async def generate(self, *args, **kwargs):
        with self.tracker.busy("engine"):
            return await self.engine.generate(*args, **kwargs)


class _TimedContextEngine(_TimedEngine):
    async def __aenter__(self):
        await self.engine.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self.engine.__aexit__(*exc)


def timed_engine(engine, tracker: BusyTracker):
    """`engine` (an async rollout's turn engine) with its requests in flight counted by `tracker`."""
    return (_TimedContextEngine if hasattr(engine, "__aenter__") else _TimedEngine)(engine, tracker)


__all__ = ["STAGES", "BusyTracker", "CallStats", "StageClock", "TimedSandbox", "percentile", "timed_engine"]
