"""Where a training step's time goes (`retool/time/*`, `retool/interpreter/*`): the stage clock, the interpreter's
share of a rollout whose cells overlap the engine, the sandbox's report of each call's wait, failures by kind, the
console's split and the stacked plot, and a real CPU training run whose stages add up to its measured steps."""

import json
import time

import pytest

from retool_trl.reporting.console import CompactProgressCallback, stage_split
from retool_trl.sandbox.base import FAILURE_KINDS, ExecResult, failure_kind, failures_by_kind
from retool_trl.training import stage_clock
from retool_trl.training.stage_clock import BusyTracker, CallStats, StageClock, percentile


class FakeTime:
    """`time.perf_counter` of the clock module, moved by hand: durations are exact, whatever the machine's load."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(stage_clock.time, "perf_counter", clock)
    return clock


def test_nested_stages_are_counted_once(fake_time):
    """The weight sync inside generation and a log-prob pass inside the batch's preparation pause the stage around
    them: each second of the step is in exactly one stage, and the loss's own forward stays in the update."""
    clock = StageClock(BusyTracker())
    clock.begin_step()
    with clock.stage("other"):
        fake_time.now += 0.5
        with clock.stage("generation"):
            fake_time.now += 2.0
            with clock.stage("weight_sync"):
                fake_time.now += 1.0
            fake_time.now += 3.0
        with clock.stage("logprobs"):
            fake_time.now += 0.25
    with clock.stage("update"):
        fake_time.now += 4.0
    clock.base = "update"  # the optimizer step, after training_step returned
    fake_time.now += 0.75
    wall, seconds = clock.end_step()
    assert wall == pytest.approx(11.5)
    assert seconds["generation"] == pytest.approx(5.0) and seconds["weight_sync"] == pytest.approx(1.0)
    assert seconds["other"] == pytest.approx(0.5) and seconds["logprobs"] == pytest.approx(0.25)
    assert seconds["update"] == pytest.approx(4.75)
    assert sum(seconds.values()) == pytest.approx(wall)


def test_interpreter_time_is_cells_running_while_the_engine_is_not(fake_time):
    """The async rollout: cells run in worker threads while the engine serves other completions. Only the time
    when cells ran and no engine request did is the interpreter's; the rest of the rollout is generation."""
    tracker = BusyTracker()
    clock = StageClock(tracker)
    clock.begin_step()
    with clock.stage("generation"):
        with tracker.busy("engine"):
            fake_time.now += 1.0
            with tracker.busy("cells"):  # overlapped by the engine: generation's
                fake_time.now += 2.0
            fake_time.now += 0.5
        with tracker.busy("cells"):  # alone: the interpreter's
            fake_time.now += 1.5
        fake_time.now += 0.25
    _, seconds = clock.end_step()
    assert seconds["interpreter"] == pytest.approx(1.5)
    assert seconds["generation"] == pytest.approx(3.75)


def test_nothing_is_counted_outside_a_step(fake_time):
    """Evaluation runs generation after a step's end: it must not land in the next step's stages."""
    clock = StageClock(BusyTracker())
    with clock.stage("generation"):
        fake_time.now += 5.0
    clock.begin_step()
    fake_time.now += 1.0
    _, seconds = clock.end_step()
    assert sum(seconds.values()) == 0.0  # the step's second was outside every stage (before training_step)


def test_call_stats_split_the_interpreter_wall_and_take_percentiles():
    stats = CallStats()
    stats.recording = True
    ok = ExecResult("1\n", ok=True, timed_out=False, duration_s=0.1)
    stats.results([ok] * 98 + [ExecResult("x", ok=False, timed_out=True, duration_s=0.1)] * 2)
    for i in range(100):
        stats.observe(wait_s=0.3 if i == 0 else 0.0, jail_s=0.2 if i == 0 else 0.0, latency_s=0.1 + i / 1000)
    metrics = stats.take(interpreter_s=2.0)
    # call-seconds: 10 executing, 0.1 waiting for a slot, 0.2 starting a jail; the 2 s of wall split so
    assert metrics["retool/interpreter/exec_s"] == pytest.approx(2.0 * 10 / 10.3)
    assert metrics["retool/interpreter/wait_s"] == pytest.approx(2.0 * 0.1 / 10.3)
    assert metrics["retool/interpreter/jail_start_s"] == pytest.approx(2.0 * 0.2 / 10.3)
    assert metrics["retool/interpreter/latency_ms_p50"] == pytest.approx(149.0)
    assert metrics["retool/interpreter/latency_ms_p99"] == pytest.approx(198.0)
    assert metrics["retool/interpreter/failed/cell_timeout"] == pytest.approx(0.02)
    assert metrics["retool/interpreter/calls"] == 100 and metrics["retool/interpreter/fresh_jails"] == 1
    assert stats.take(0.0)["retool/interpreter/calls"] == 0  # taken: the next step starts empty


def test_percentile_is_a_measured_value():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and percentile([5.0], 99) == 5.0
    assert percentile(list(range(1, 101)), 99) == 99


def test_failure_kinds_from_what_the_backends_write():
    """The texts are the backends' own: the local jail that did not come up in time, the remote client after a
    service answered 429 to every retry, a lost interpreter, a cell's exception and its timeout."""
    waited = "SystemError: the sandbox could not set up the session's jail: it did not reach its wait for requests "
    cases = {
        ExecResult("ZeroDivisionError: division by zero", ok=False, timed_out=False, duration_s=0.0): "cell_error",
        ExecResult("TimeoutError: execution exceeded 5 s", ok=False, timed_out=True, duration_s=5.0): "cell_timeout",
        ExecResult(waited + "within 30 s", False, False, 30.0, infra_error=True): "sandbox_wait",
        ExecResult(
            "SandboxError: the code execution service failed: HTTP 429", False, False, 1.0, infra_error=True
        ): "sandbox_wait",
        ExecResult("SystemError: the sandbox lost the interpreter process", False, False, 0.1, True): (
            "sandbox_failure"
        ),
        ExecResult("42\n", ok=True, timed_out=False, duration_s=0.0): None,
    }
    for result, kind in cases.items():
        assert failure_kind(result) == kind, result.output
    counts = failures_by_kind(cases)
    assert set(counts) == set(FAILURE_KINDS) and counts["sandbox_wait"] == 2 and sum(counts.values()) == 5


def test_local_sandbox_reports_each_calls_wait_and_latency():
    """The real local sandbox: each dispatched call tells its observer its caller-seen latency (at least its
    execution), its wait before it started, and whether a jail was handed to it then (its first call)."""
    from retool_trl.sandbox import LocalSandbox

    seen = []
    with LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox:
        sandbox.call_observer = lambda *timing: seen.append(timing)
        a, b = sandbox.session(), sandbox.session()
        # Two sleepy cells of one session run one after the other; the other session runs alongside.
        results = sandbox.run_many([(a, "import time; time.sleep(0.2)"), (a, "1"), (b, "2")])
        assert all(r.ok for r in results), results
        sandbox.call_observer = None
        sandbox.run_many([(a, "3")])
    assert len(seen) == 3
    latencies = sorted(latency for _, _, latency in seen)
    assert latencies[-1] >= 0.2 - 1e-3  # the sleeper (or the cell queued behind it) saw the whole sleep
    assert all(wait >= jail >= 0 and latency >= wait for wait, jail, latency in seen)
    assert sum(jail > 0 for _, jail, _ in seen) == 2  # the first call of each session got its jail then


def test_console_line_shows_the_split():
    logs = {
        "reward": 0.5,
        "retool/time/generation_share": 0.612,
        "retool/time/interpreter_share": 0.09,
        "retool/time/logprobs_share": 0.07,
        "retool/time/update_share": 0.2,
        "retool/time/rewards_share": 0.01,
        "retool/time/other_share": 0.02,
    }
    assert stage_split(logs) == "gen 61% tool 9% train 27%"
    assert CompactProgressCallback.summary(logs).endswith("| gen 61% tool 9% train 27%")
    logs["retool/time/rewards_share"] = 0.3  # a stage that takes a large part is shown too
    assert stage_split(logs).endswith("reward 30%")
    assert stage_split({"loss": 1.0}) == ""  # an SFT log has no stages


def _quickstart_trainer(out, steps: int):
    from transformers import AutoTokenizer

    from retool_trl.quickstart.arithmetic import arithmetic_plan
    from retool_trl.quickstart.plan import QuickstartArguments, rl_config
    from retool_trl.trainer import ReToolTrainer

    args = QuickstartArguments(
        output_dir=str(out), max_steps=steps, prompts_per_step=4, num_generations=4, num_train=16, num_eval=4
    )
    plan = arithmetic_plan(args)
    tokenizer = AutoTokenizer.from_pretrained(plan.model, padding_side="left")
    config = rl_config(args, out / "tool_rl", with_tools=True, disable_tqdm=True, max_steps=steps)
    return ReToolTrainer(plan.model, None, args=config, train_dataset=plan.splits["train"], processing_class=tokenizer)


def test_a_real_training_run_logs_stages_that_add_up_to_its_steps(tmp_path, capsys):
    """The quickstart's tiny model trains two GRPO steps on the CPU with the real local sandbox. A callback of the
    test's own measures each step's wall time; the stages logged for that step add up to it within 5%, the
    rollout's stages are there (generation, code really run), and the metrics reach the logged history, the run's
    log file and the console line."""
    from transformers import TrainerCallback

    from retool_trl.reporting.console import use_compact_console

    class Wall(TrainerCallback):
        def __init__(self):
            self.walls = []

        def on_step_begin(self, *args, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.walls.append(time.perf_counter() - self.started)

    trainer = _quickstart_trainer(tmp_path, steps=2)
    wall = Wall()
    trainer.add_callback(wall)
    callback = use_compact_console(trainer, tmp_path / "log.jsonl")
    callback._stream = __import__("sys").stdout
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "retool/time/step" in entry]
    assert len(logged) == len(wall.walls) == 2
    stages = ("generation", "interpreter", "weight_sync", "rewards", "logprobs", "update", "other")
    for entry, measured in zip(logged, wall.walls):
        total = sum(entry[f"retool/time/{stage}"] for stage in stages)
        assert total == pytest.approx(measured, rel=0.05), (entry, measured)
        assert sum(entry[f"retool/time/{stage}_share"] for stage in stages) == pytest.approx(1.0, abs=0.05)
        assert entry["retool/time/generation"] > 0 and entry["retool/time/update"] > 0
        assert entry["retool/time/rewards"] > 0 and entry["retool/time/weight_sync"] == 0.0  # no vLLM here
    assert any(entry["retool/interpreter/calls"] > 0 for entry in logged)  # the model called code
    ran = [entry for entry in logged if entry["retool/interpreter/calls"] > 0]
    assert all(entry["retool/time/interpreter"] > 0 and "retool/interpreter/latency_ms_p99" in entry for entry in ran)
    assert all("retool/sandbox_latency_ms_p50" in entry for entry in ran)
    in_file = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert any("retool/time/generation_share" in entry for entry in in_file)
    assert "gen " in capsys.readouterr().out


def test_plot_stacks_the_stages_up_to_each_step(tmp_path, monkeypatch):
    """`retool-trl plot` of a run that logged stages: one stacked panel whose top is each step's measured time."""
    import retool_trl.reporting.plotting as plotting

    saved = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, output, layout=True: saved.append(fig) or output)
    history = []
    for step in range(1, 6):
        seconds = {"generation": 2.0 + step, "interpreter": 0.5, "update": 1.0, "logprobs": 0.25, "rewards": 0.1}
        entry = {"step": step, "reward": 0.1 * step, "retool/time/step": sum(seconds.values())}
        entry.update({f"retool/time/{stage}": value for stage, value in seconds.items()})
        entry.update({"retool/time/weight_sync": 0.0, "retool/time/other": 0.0})
        history.append(entry)
    plotting.plot_log_history(history, tmp_path / "t.png")
    [ax] = [ax for ax in saved[-1].axes if ax.get_title() == "where a step's time goes"]
    tops = max(path.vertices[:, 1].max() for c in ax.collections for path in c.get_paths())
    assert tops == pytest.approx(max(entry["retool/time/step"] for entry in history))
    labels = ax.get_legend().get_texts()
    assert [t.get_text() for t in labels][:3] == ["step (measured)", "generation", "interpreter"]
    assert "weight sync" not in {t.get_text() for t in labels}  # never entered: no band


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_losss_own_forward_is_the_update_not_a_logprob_pass(tmp_path, beta):
    """Without a reference model (beta 0) and with aligned steps, TRL makes no log-prob pass outside the loss: the
    `logprobs` stage stays empty although the loss calls the same TRL method; with a KL term the reference pass is
    there. The scripted rollout's cells really run (in-process), so the interpreter stage is there too."""
    from helpers.testing_utils import TOOL_SCRIPTS, ramp_reward, trainer_for

    trainer = trainer_for(tmp_path, TOOL_SCRIPTS, reward_funcs=ramp_reward, beta=beta, max_steps=1, logging_steps=1)
    trainer.train()
    [entry] = [e for e in trainer.state.log_history if "retool/time/step" in e]
    assert entry["retool/time/update"] > 0 and entry["retool/time/generation"] > 0
    assert entry["retool/interpreter/calls"] > 0 and entry["retool/time/interpreter"] > 0
    assert (entry["retool/time/logprobs"] > 0) == (beta > 0)


def test_async_rollout_counts_a_slow_cell_alone_as_the_interpreters():
    """The async rollout through the timed engine and sandbox: completions run their own loops, cells in worker
    threads. One completion's 0.3 s cell runs after the others have finished, so the rollout waits on the
    interpreter alone for at least those 0.3 s; every call is counted once, its failure by kind. (How time overlapped
    by engine requests is left out is checked on a clock moved by hand, above.)"""
    from helpers.async_scripted import SCRIPTS, SPEC, TOKENIZER, AsyncScripted, ThreadSafeSandbox, prompts
    from retool_trl.rollout.per_completion import async_rollout
    from retool_trl.training.stage_clock import TimedSandbox, timed_engine

    tracker, stats = BusyTracker(), CallStats()
    stats.recording = True
    engine = AsyncScripted(SCRIPTS)
    engine.requests = 0
    sandbox = TimedSandbox(ThreadSafeSandbox(), tracker, stats)
    before = tracker.interpreter_seconds(time.perf_counter())
    started = time.perf_counter()
    result = async_rollout(prompts(4), timed_engine(engine, tracker), sandbox, TOKENIZER, SPEC)
    wall = time.perf_counter() - started
    alone = tracker.interpreter_seconds(time.perf_counter()) - before
    assert sum(result.num_tool_calls) == len(stats.durations) > 0
    assert 0.29 <= alone <= wall
    assert stats.take(alone)["retool/interpreter/failed/cell_error"] > 0  # the 1/0 cell
