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

# Re-exported: the quickstart model is built with them (scripts/build_quickstart_model.py).
from .tiny import build_char_tokenizer, build_tiny_model  # noqa: F401

QUICKSTART_MODEL_DIR = Path(__file__).parent / "assets" / "quickstart_model"



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
    kinds: list[str] = field(
        default_factory=lambda: ["product", "sum", "mod"], metadata={"help": "Problem kinds."}
    )
    test_fraction: float = field(default=0.2, metadata={"help": "Share of problems held out for evaluation."})
    code_fraction: float = field(default=0.7, metadata={"help": "Share of cold-start traces that call code."})


# ----------------------------------------------------------------------------------------------- the quickstart run
@dataclass
class QuickstartArguments:
    """Settings of `retool-trl quickstart`: GRPO with and without the interpreter from the same checkpoint.

    The defaults are sized for 2 CPU cores: about 3 minutes in all, under 1 GB of memory.

    Args:
        output_dir (`str`): Run folder (`summary.json`, `quickstart.png`, `tool_rl/`, `text_rl/`).
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
    """

    output_dir: str = field(default="retool_quickstart", metadata={"help": "Run folder."})
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

    def __post_init__(self):
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


def _rl_config(args: QuickstartArguments, run_dir: Path, with_tools: bool, **overrides):
    from .config import ReToolConfig

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
        max_tool_calls=2 if with_tools else 0,  # one call suffices; a second is tolerated
        max_interpreter_output_chars=64,
        system_prompt="none",  # the model was cold-started on plain prompts
        sandbox_workers=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
    )
    return ReToolConfig(**{**settings, **overrides})


def _evaluate(model, tokenizer, dataset, config, sandbox, seed: int, name: str) -> dict[str, float]:
    """Held-out accuracy, code ratio and length at the sampling temperature; the completions are written to
    `RUN/NAME_samples.jsonl` (with `NAME.json` and `NAME.md`) for inspection."""
    from transformers import set_seed

    from .evaluation import evaluate, write_report

    set_seed(seed)
    model.eval()
    report = evaluate(model, tokenizer, dataset, config, num_samples=1, batch_size=64, sandbox=sandbox)
    write_report(report, config.output_dir, name)
    m = report.metrics
    return {"accuracy": m["avg@1"], "code_ratio": m["code_ratio"], "mean_length": m["mean_length"]}


def train_run(
    name: str, args: QuickstartArguments, start: str, tokenizer, splits, sandbox, out: Path, with_tools=None, **overrides
) -> dict:
    """Evaluates the starting checkpoint, trains one GRPO run, evaluates again, and saves model and logs.

    `with_tools` defaults to `name == "tool_rl"`; `overrides` are extra `ReToolConfig` fields (ablations).
    """
    from transformers import AutoModelForCausalLM

    from .trainer import ReToolTrainer

    run_dir = out / name
    config = _rl_config(args, run_dir, with_tools=name == "tool_rl" if with_tools is None else with_tools, **overrides)
    model = AutoModelForCausalLM.from_pretrained(start)
    print(f"\n== {name}: {RUNS.get(name, overrides or 'GRPO with the interpreter')} ==")
    before = _evaluate(model, tokenizer, splits["test"], config, sandbox, args.seed, "eval_before")
    started = time.perf_counter()
    trainer = ReToolTrainer(
        model, args=config, train_dataset=splits["train"], processing_class=tokenizer, sandbox=sandbox
    )
    trainer.train()
    train_s = time.perf_counter() - started
    trainer.save_model(str(run_dir / "model"))
    trainer.save_state()  # trainer_state.json with TRL's log_history
    after = _evaluate(trainer.model, tokenizer, splits["test"], config, sandbox, args.seed, "eval_after")
    return {
        **{f"{k}_before": v for k, v in before.items()},
        **{f"{k}_after": v for k, v in after.items()},
        "train_s": round(train_s, 1),
        "steps": trainer.state.global_step,
        "log_history": trainer.state.log_history,
    }


def plot_comparison(histories: dict[str, list[dict]], output: str | Path, evals: dict[str, dict] | None = None) -> Path:
    """Reward, accuracy, code ratio and completion length over GRPO steps, one line per run, as a PNG.

    Args:
        histories (`dict[str, list[dict]]`): Run name -> TRL `log_history`.
        output (`str` or `Path`): PNG path.
        evals (`dict[str, dict]`, *optional*): Run name -> summary entry; held-out accuracy before/after is drawn as
            markers on the accuracy panel.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    from .plotting import save_figure

    def series(history, key, transform=lambda v: v):
        points = [(h["step"], transform(h[key])) for h in history if isinstance(h.get(key), (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    # The +1/-1 reward of boxed_accuracy maps to accuracy as (r + 1) / 2.
    panels = [
        ("reward", "reward", lambda v: v),
        ("accuracy (train samples)", "rewards/boxed_accuracy/mean", lambda v: (v + 1) / 2),
        ("code ratio (executed calls)", "retool/code_ratio", lambda v: v),
        ("mean completion length", "completions/mean_length", lambda v: v),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.2))
    for ax, (title, key, transform) in zip(axes, panels):
        for index, (name, history) in enumerate(histories.items()):
            steps, values = series(history, key, transform)
            if values:
                ax.plot(steps, values, label=name, color=f"C{index}", linewidth=1.5)
            if evals and key.startswith("rewards/") and name in evals:
                last = max((h.get("step", 0) for h in history), default=0)
                ax.plot([0, last], [evals[name]["accuracy_before"], evals[name]["accuracy_after"]], "o--",
                        color=f"C{index}", alpha=0.6, markersize=5, label=f"{name} held-out")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    return save_figure(fig, output)


def _table(summary: dict) -> str:
    rows = [("run", "acc before", "acc after", "code ratio before -> after", "mean length after", "train time")]
    for name in RUNS:
        r = summary[name]
        rows.append((
            name,
            f"{r['accuracy_before']:.1%}",
            f"{r['accuracy_after']:.1%}",
            f"{r['code_ratio_before']:.1%} -> {r['code_ratio_after']:.1%}",
            f"{r['mean_length_after']:.1f}",
            f"{r['train_s']:.0f} s",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def run_quickstart(output_dir: str | Path = "retool_quickstart", **kwargs) -> dict:
    """Runs the CPU quickstart and writes its run folder.

    From the shipped checkpoint, trains GRPO with the interpreter (`tool_rl`) and, with the same budget, without it
    (`text_rl`, `max_tool_calls=0`), evaluating each on held-out problems before and after at the sampling
    temperature. Writes `summary.json`, `quickstart.png` and, per run, `RUN/model/`, `RUN/trainer_state.json` (TRL's
    `log_history`) and `RUN/eval_{before,after}{.json,.md,_samples.jsonl}`.

    Args:
        output_dir (`str` or `Path`): Run folder.
        kwargs: Other [`QuickstartArguments`] fields.

    Returns:
        The summary (as written to `summary.json`).
    """
    from transformers import AutoTokenizer

    from .data.synthetic import make_splits
    from .sandbox.factory import sandbox_from_config

    args = QuickstartArguments(output_dir=str(output_dir), **kwargs)
    started = time.perf_counter()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = args.model or model_path()
    task = QuickstartTask()
    # Left padding, as TRL's GRPOTrainer loads tokenizers for generation.
    tokenizer = AutoTokenizer.from_pretrained(start, padding_side="left")
    splits = make_splits(args.num_train, args.num_eval, seed=args.seed, difficulty=task.difficulty,
                         kinds=task.kinds, test_fraction=task.test_fraction)
    # One sandbox for every evaluation and both runs (the text run never calls it): the pool starts once.
    sandbox = sandbox_from_config(_rl_config(args, out / "tool_rl", with_tools=True))
    try:
        results = {name: train_run(name, args, start, tokenizer, splits, sandbox, out) for name in RUNS}
    finally:
        sandbox.close()
    histories = {name: results[name].pop("log_history") for name in RUNS}
    plot = plot_comparison(histories, out / "quickstart.png", evals=results)
    summary = {
        **results,
        "wall_s": round(time.perf_counter() - started, 1),
        "model": start,
        "task": asdict(task),
        "settings": asdict(args),
        "plot": plot.name,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n" + _table(summary))
    print(f"\nwall time {summary['wall_s']:.0f} s; wrote {out / 'summary.json'} and {plot}")
    return summary


def main(argv: list[str] | None = None) -> int:
    """`retool-trl quickstart [--output-dir DIR] [--max-steps N] ...`: every [`QuickstartArguments`] field."""
    from .errors import UserError

    class _Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, no usage block (the CLI prints it)
            raise UserError(f"{message} (see `retool-trl quickstart --help`)")

    parser = _Parser(prog="retool-trl quickstart", description=QuickstartArguments.__doc__.split("\n\n")[0])
    for f in fields(QuickstartArguments):
        kind = {"int": int, "float": float}.get(str(f.type), str)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default, help=f.metadata["help"])
    options = vars(parser.parse_args(argv))
    try:
        QuickstartArguments(**options)  # bad values are reported before any work starts
    except ValueError as error:
        raise UserError(str(error)) from None
    if options["model"] is not None and not (Path(options["model"]) / "config.json").is_file():
        raise UserError(f"--model {options['model']!r} is not a model folder (no config.json); pass a checkpoint.")
    run_quickstart(**options)
    return 0
