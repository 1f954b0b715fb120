"""The CPU quickstart: a tiny shipped model, a synthetic arithmetic task, and the pieces to rebuild the model.

The shipped checkpoint (`retool_trl/assets/quickstart_model/`) is a ~0.67M-parameter Qwen2 with a character-level
tokenizer, cold-started by SFT on synthetic traces (`scripts/build_quickstart_model.py` rebuilds it). It copies an
expression into `<code>print(...)</code>` well, but calls code only on part of its samples and cannot do the
arithmetic in its head, which is what the quickstart's RL runs then show.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ..plotting import ARITHMETIC_PANELS, plot_comparison

# Re-exported: the quickstart model is built with them (scripts/build_quickstart_model.py).
from ..tiny import build_char_tokenizer, build_tiny_model  # noqa: F401

QUICKSTART_MODEL_DIR = Path(__file__).parent.parent / "assets" / "quickstart_model"


def model_path() -> str:
    """Folder of the shipped quickstart model (load it with `from_pretrained`)."""
    if not (QUICKSTART_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"The quickstart model is missing from {QUICKSTART_MODEL_DIR}; rebuild it with "
            "`python scripts/build_quickstart_model.py`."
        )
    return str(QUICKSTART_MODEL_DIR)


@dataclass
class QuickstartTask:
    """The synthetic task the quickstart model is built and evaluated on.

    Args:
        difficulty (`int`): Difficulty of the RL and evaluation problems (see `retool_trl.data.synthetic`).
        sft_difficulties (`list[int]`): Levels the cold-start traces cover; every operand length that is evaluated
            must appear here, since a tiny model cannot copy lengths it never saw.
        kinds (`list[str]`): Problem kinds.
        test_fraction (`float`): Share of the problem space held out for evaluation.
        code_fraction (`float`): Share of cold-start traces that call the interpreter.
    """

    difficulty: int = field(default=2, metadata={"help": "Difficulty of RL and evaluation problems."})
    sft_difficulties: list[int] = field(
        default_factory=lambda: [2], metadata={"help": "Difficulty levels covered by the cold-start traces."}
    )
    kinds: list[str] = field(default_factory=lambda: ["product", "sum", "mod"], metadata={"help": "Problem kinds."})
    test_fraction: float = field(default=0.2, metadata={"help": "Share of problems held out for evaluation."})
    code_fraction: float = field(default=0.7, metadata={"help": "Share of cold-start traces that call code."})


# ----------------------------------------------------------------------------------------------- the quickstart run
TASKS = ("arithmetic", "multiturn")


@dataclass
class QuickstartArguments:
    """Settings of `retool-trl quickstart`: GRPO with and without the interpreter from the same checkpoint.

    The defaults are sized for 2 CPU cores: about 3 minutes in all, under 1 GB of memory. With `task="multiturn"`,
    fields left unset take that task's defaults (`retool_trl.quickstart_multiturn.MULTITURN_DEFAULTS`).

    Args:
        output_dir (`str`): Run folder (`summary.json`, `quickstart.png`, `tool_rl/`, `text_rl/`).
        task (`str`): `arithmetic` (one code call per answer) or `multiturn` (dependent cells under a per-cell
            length budget, and recovery from a failing cell; see `retool_trl.quickstart_multiturn`).
        model (`str`, *optional*): Checkpoint to start from; the shipped quickstart model by default.
        max_steps (`int`): GRPO steps of each run.
        prompts_per_step (`int`): Problems per GRPO step.
        num_generations (`int`): Samples per problem (GRPO group size).
        learning_rate (`float`): GRPO learning rate (constant).
        beta (`float`): KL coefficient to the starting model. Without it the tiny model's copying of short numbers
            (e.g. two-digit remainders into `\\boxed{}`) degrades while the policy shifts towards calling code.
        temperature (`float`): Sampling temperature of training and evaluation.
        num_train (`int`): Training problems.
        num_eval (`int`): Held-out problems evaluated before and after each run (one sample each).
        max_completion_length (`int`): Completion budget in tokens, interpreter tokens included.
        seed (`int`): Seed of data, sampling and training.
        threads (`int`): torch CPU threads; 0 keeps torch's default. One thread is several times faster than two
            for a model this small on a machine whose cores are busy (threads spin waiting for each other).
    """

    output_dir: str = field(default="retool_quickstart", metadata={"help": "Run folder."})
    task: str = field(default="arithmetic", metadata={"help": "Task: 'arithmetic' or 'multiturn'."})
    model: str | None = field(default=None, metadata={"help": "Starting checkpoint (default: the shipped model)."})
    max_steps: int = field(default=40, metadata={"help": "GRPO steps of each run."})
    prompts_per_step: int = field(default=8, metadata={"help": "Problems per GRPO step."})
    num_generations: int = field(default=8, metadata={"help": "Samples per problem (GRPO group size)."})
    learning_rate: float = field(default=3e-4, metadata={"help": "GRPO learning rate (constant)."})
    beta: float = field(default=0.2, metadata={"help": "KL coefficient to the starting model."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (training and evaluation)."})
    num_train: int = field(default=512, metadata={"help": "Training problems."})
    num_eval: int = field(default=256, metadata={"help": "Held-out problems evaluated before and after."})
    max_completion_length: int = field(default=64, metadata={"help": "Completion budget in tokens."})
    seed: int = field(default=0, metadata={"help": "Seed of data, sampling and training."})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)."})

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}.")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}.")
        for name in ("max_steps", "prompts_per_step", "num_eval", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (GRPO compares samples of a group), got {self.num_generations}."
            )
        if self.num_train < self.prompts_per_step:
            raise ValueError(f"num_train ({self.num_train}) must be >= prompts_per_step ({self.prompts_per_step}).")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the quickstart samples), got {self.temperature}.")


# The two runs differ only in whether code is executed.
RUNS = {"tool_rl": "GRPO with the interpreter", "text_rl": "GRPO without it (text only)"}


def _rl_config(args: QuickstartArguments, run_dir: Path, with_tools: bool, max_tool_calls: int = 2, **overrides):
    from ..config import ReToolConfig

    settings = dict(
        output_dir=str(run_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        beta=args.beta,
        max_completion_length=args.max_completion_length,
        # 2 for arithmetic (one call suffices, a second is tolerated); the multi-turn task passes its own.
        max_tool_calls=max_tool_calls if with_tools else 0,
        max_interpreter_output_chars=64,
        system_prompt="none",  # the model was cold-started on plain prompts
        sandbox_workers=2,
        logging_steps=1,
        disable_tqdm=False,  # the progress bar carries the compact log (CompactProgressCallback)
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
    )
    return ReToolConfig(**{**settings, **overrides})


def _evaluate(model, tokenizer, dataset, config, sandbox, seed: int, name: str, multiturn: bool = False) -> dict:
    """Held-out accuracy, code ratio and length at the sampling temperature (for the multi-turn task also calls per
    completion and recovery rate); the completions are written to `RUN/NAME_samples.jsonl` (with `NAME.json` and
    `NAME.md`) for inspection."""
    from transformers import set_seed

    from ..evaluation import evaluate, write_report

    set_seed(seed)
    model.eval()
    report = evaluate(model, tokenizer, dataset, config, num_samples=1, batch_size=64, sandbox=sandbox)
    write_report(report, config.output_dir, name)
    m = report.metrics
    metrics = {"accuracy": m["avg@1"], "code_ratio": m["code_ratio"], "mean_length": m["mean_length"]}
    if multiturn:
        from .multiturn import recovery_rate

        rate, failing = recovery_rate(report.records)
        metrics.update(calls_per_completion=m["calls_per_answer"], recovery_rate=rate, failing_completions=failing)
    return metrics


class CompactProgressCallback(ProgressCallback):
    """Replaces the console's log dicts with a few numbers on the progress bar, and keeps every log in a file.

    Transformers' `ProgressCallback` writes each log dict (about 40 keys) above the bar at every logging step, which
    buries the bar. This one shows reward, accuracy, code ratio and calls per completion (plus the recovery rate when
    logged) as the bar's postfix, and appends each full log, with its step, to `log_path` (JSON lines).

    Args:
        log_path (`str` or `Path`): The JSON-lines file (rewritten when training begins).
    """

    # (label, logged key, format); accuracy comes from the mean +1/-1 reward of `boxed_accuracy`.
    SHOWN = (
        ("reward", "reward", "{:+.2f}"),
        ("acc", "rewards/{accuracy}/mean", "{:.0%}"),
        ("code", "retool/code_ratio", "{:.0%}"),
        ("calls", "retool/calls_per_completion", "{:.1f}"),
        ("recovery", "retool/recovery_rate", "{:.0%}"),
    )

    def __init__(self, log_path: str | Path):
        super().__init__()
        self.log_path = Path(log_path)

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if state.is_world_process_zero:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_path.write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        with self.log_path.open("a") as handle:
            handle.write(json.dumps({"step": state.global_step, **logs}, default=str) + "\n")
        line = self.summary(logs)
        if self.training_bar is not None and line:  # the final log (runtime, mean loss) keeps the last line shown
            self.training_bar.set_postfix_str(line, refresh=False)

    @classmethod
    def summary(cls, logs: dict) -> str:
        """The compact line for one log dict, e.g. `reward +0.50 | acc 75% | code 98% | calls 2.1`."""
        accuracy = next((k.split("/")[1] for k in logs if k.startswith("rewards/") and k.endswith("/mean")), "")
        parts = []
        for label, key, fmt in cls.SHOWN:
            value = logs.get(key.format(accuracy=accuracy))
            if isinstance(value, (int, float)):
                parts.append(f"{label} {fmt.format((value + 1) / 2 if label == 'acc' else value)}")
        return " | ".join(parts)


def train_run(
    name: str,
    args: QuickstartArguments,
    start: str,
    tokenizer,
    splits,
    sandbox,
    out: Path,
    with_tools=None,
    reward_funcs=None,
    **overrides,
) -> dict:
    """Evaluates the starting checkpoint, trains one GRPO run, evaluates again, and saves model and logs.

    `with_tools` defaults to `name == "tool_rl"`; `reward_funcs` to the trainer's (`boxed_accuracy`); `overrides`
    are extra `ReToolConfig` fields (ablations, the multi-turn task's limits).
    """
    from transformers import AutoModelForCausalLM

    from ..trainer import ReToolTrainer

    run_dir = out / name
    config = _rl_config(args, run_dir, with_tools=name == "tool_rl" if with_tools is None else with_tools, **overrides)
    model = AutoModelForCausalLM.from_pretrained(start)
    print(f"\n== {name}: {RUNS.get(name, overrides or 'GRPO with the interpreter')} ==")
    multiturn = args.task == "multiturn"
    before = _evaluate(model, tokenizer, splits["test"], config, sandbox, args.seed, "eval_before", multiturn)
    started = time.perf_counter()
    trainer = ReToolTrainer(
        model, reward_funcs, args=config, train_dataset=splits["train"], processing_class=tokenizer, sandbox=sandbox
    )
    for noisy in (ProgressCallback, PrinterCallback):  # both print every log dict
        trainer.remove_callback(noisy)
    trainer.add_callback(CompactProgressCallback(run_dir / "log.jsonl"))
    trainer.train()
    train_s = time.perf_counter() - started
    trainer.save_model(str(run_dir / "model"))
    trainer.save_state()  # trainer_state.json with TRL's log_history
    after = _evaluate(trainer.model, tokenizer, splits["test"], config, sandbox, args.seed, "eval_after", multiturn)
    return {
        **{f"{k}_before": v for k, v in before.items()},
        **{f"{k}_after": v for k, v in after.items()},
        "train_s": round(train_s, 1),
        "steps": trainer.state.global_step,
        "log_history": trainer.state.log_history,
    }


def _table(summary: dict) -> str:
    rows = [("run", "acc before", "acc after", "code ratio before -> after", "mean length after", "train time")]
    for name in RUNS:
        r = summary[name]
        rows.append(
            (
                name,
                f"{r['accuracy_before']:.1%}",
                f"{r['accuracy_after']:.1%}",
                f"{r['code_ratio_before']:.1%} -> {r['code_ratio_after']:.1%}",
                f"{r['mean_length_after']:.1f}",
                f"{r['train_s']:.0f} s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


@dataclass
class TaskPlan:
    """What a quickstart task contributes to the shared run: its task description, starting checkpoint, data,
    sandbox wrapper, extra `train_run` arguments, plot panels and console table."""

    task: object
    model: str
    splits: object
    wrap_sandbox: object = None
    run_kwargs: dict = field(default_factory=dict)
    panels: tuple = ARITHMETIC_PANELS
    table: object = _table


def _arithmetic_plan(args: QuickstartArguments) -> TaskPlan:
    from ..data.synthetic import make_splits

    task = QuickstartTask()
    splits = make_splits(
        args.num_train,
        args.num_eval,
        seed=args.seed,
        difficulty=task.difficulty,
        kinds=task.kinds,
        test_fraction=task.test_fraction,
    )
    return TaskPlan(task, args.model or model_path(), splits)


def run_quickstart(output_dir: str | Path = "retool_quickstart", **kwargs) -> dict:
    """Runs the CPU quickstart and writes its run folder.

    From the shipped checkpoint, trains GRPO with the interpreter (`tool_rl`) and, with the same budget, without it
    (`text_rl`, `max_tool_calls=0`), evaluating each on held-out problems before and after at the sampling
    temperature. Writes `summary.json`, `quickstart.png` and, per run, `RUN/model/`, `RUN/trainer_state.json` (TRL's
    `log_history`), `RUN/log.jsonl` (every log as it was written) and `RUN/eval_{before,after}{.json,.md,
    _samples.jsonl}`.

    Args:
        output_dir (`str` or `Path`): Run folder.
        kwargs: Other [`QuickstartArguments`] fields; with `task="multiturn"`, unset ones take
            `MULTITURN_DEFAULTS`.

    Returns:
        The summary (as written to `summary.json`).
    """
    import torch
    from transformers import AutoTokenizer

    from ..sandbox.factory import sandbox_from_config

    if kwargs.get("task") == "multiturn":
        from .multiturn import MULTITURN_DEFAULTS, multiturn_plan

        kwargs = {**MULTITURN_DEFAULTS, **kwargs}
    args = QuickstartArguments(output_dir=str(output_dir), **kwargs)
    started = time.perf_counter()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = multiturn_plan(args) if args.task == "multiturn" else _arithmetic_plan(args)
    start = plan.model
    # Left padding, as TRL's GRPOTrainer loads tokenizers for generation.
    tokenizer = AutoTokenizer.from_pretrained(start, padding_side="left")
    # One sandbox for every evaluation and both runs (the text run never calls it): the pool starts once.
    sandbox = sandbox_from_config(_rl_config(args, out / "tool_rl", with_tools=True))
    sandbox = plan.wrap_sandbox(sandbox) if plan.wrap_sandbox else sandbox
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        results = {
            name: train_run(name, args, start, tokenizer, plan.splits, sandbox, out, **plan.run_kwargs)
            for name in RUNS
        }
    finally:
        torch.set_num_threads(threads)
        sandbox.close()
    histories = {name: results[name].pop("log_history") for name in RUNS}
    plot = plot_comparison(histories, out / "quickstart.png", evals=results, panels=plan.panels)
    summary = {
        **results,
        "wall_s": round(time.perf_counter() - started, 1),
        "model": start,
        "task": asdict(plan.task),
        "settings": asdict(args),
        "plot": plot.name,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n" + plan.table(summary))
    print(f"\nwall time {summary['wall_s']:.0f} s; wrote {out / 'summary.json'} and {plot}")
    return summary


def main(argv: list[str] | None = None) -> int:
    """`retool-trl quickstart [--output-dir DIR] [--max-steps N] ...`: every [`QuickstartArguments`] field."""
    from ..errors import UserError

    class _Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, no usage block (the CLI prints it)
            raise UserError(f"{message} (see `retool-trl quickstart --help`)")

    parser = _Parser(prog="retool-trl quickstart", description=QuickstartArguments.__doc__.split("\n\n")[0])
    from .multiturn import MULTITURN_DEFAULTS

    for f in fields(QuickstartArguments):
        kind = {"int": int, "float": float}.get(str(f.type), str)
        default = f"{f.default}" + (
            f"; multiturn: {MULTITURN_DEFAULTS[f.name]}" if f.name in MULTITURN_DEFAULTS else ""
        )
        # No argparse defaults: an unset option takes the task's default (see `run_quickstart`).
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=kind,
            default=None,
            choices=TASKS if f.name == "task" else None,
            help=f"{f.metadata['help']} (default: {default})",
        )
    options = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    try:
        defaults = MULTITURN_DEFAULTS if options.get("task") == "multiturn" else {}
        QuickstartArguments(**{**defaults, **options})  # bad values are reported before any work starts
    except ValueError as error:
        raise UserError(str(error)) from None
    if options.get("model") is not None and not (Path(options["model"]) / "config.json").is_file():
        raise UserError(f"--model {options['model']!r} is not a model folder (no config.json); pass a checkpoint.")
    run_quickstart(**options)
    return 0
