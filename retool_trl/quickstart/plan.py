"""What every quickstart task shares: the run's settings, the GRPO config both runs train with, and a task's plan.

A task module (`arithmetic`, `multiturn`) builds a [`TaskPlan`] from [`QuickstartArguments`]; the runner
(`retool_trl.quickstart.runner`) trains and evaluates whatever plan it is given. Task modules import this one and
never the runner, so imports run one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

TASKS = ("arithmetic", "multiturn", "emerge")

# What `--task multiturn` takes where the user sets nothing (arithmetic: `QuickstartArguments`' own defaults).
MULTITURN_DEFAULTS = {
    "max_steps": 60,
    "prompts_per_step": 8,
    "num_generations": 8,
    "max_completion_length": 144,
    "num_eval": 256,
    "threads": 1,
}
# `--task emerge`: more steps than the arithmetic task, whose starting model already calls code in 70% of its answers,
# and a weaker KL term: `beta` 0.2 anchors the policy to a starting model that answers without code 97% of the time,
# and in a group whose samples all call code and are right the KL term is the only force left, pulling towards that
# habit (at 0.2 it balances the reward's push at about 90% code).
EMERGE_DEFAULTS = {"max_steps": 120, "lr_decay_steps": 60, "beta": 0.02, "threads": 1}
TASK_DEFAULTS = {"arithmetic": {}, "multiturn": MULTITURN_DEFAULTS, "emerge": EMERGE_DEFAULTS}
# The call formats the arithmetic task ships a model for (`--call-format`), and what each takes where the user sets
# nothing: one torch thread (as `emerge`); 60 steps, since the digits are copied across a fence or a call's JSON
# rather than a tag, and those slips take longer to train away (at 50 steps the lowest of five seeds was 94.9% in
# `markdown`); and for `tool_call` a longer budget, since its completion carries the call's JSON and the template's
# tool turn (about 60 tokens for a sum, where `tags` needs about 35), a lower learning rate (at 3e-4 its training
# accuracy fell to 35-50% for a few steps mid-run on some seeds and one seed of four ended at 94.5%) and no KL term:
# over five seeds the held-out accuracy is the same within noise (mean 96.6% with `beta` 0.2, 96.5% without), but the
# lowest seed rises from 94.9% to 95.3%, and without it TRL skips the reference model's forward pass (about a tenth
# less training time).
FORMAT_DEFAULTS = {
    "tags": {},
    "markdown": {"threads": 1, "max_steps": 60},
    "tool_call": {"max_completion_length": 96, "threads": 1, "max_steps": 60, "learning_rate": 2e-4, "beta": 0.0},
}
CALL_FORMATS = tuple(FORMAT_DEFAULTS)  # the first (the default format) is shipped for every task

# The two runs differ only in whether code is executed.
RUNS = {"tool_rl": "GRPO with the interpreter", "text_rl": "GRPO without it (text only)"}


@dataclass
class QuickstartArguments:
    """Settings of `retool-trl quickstart`: GRPO with and without the interpreter from the same checkpoint.

    The defaults are sized for 2 CPU cores: about 3 minutes in all, under 1 GB of memory. With `task="multiturn"`,
    fields left unset take that task's defaults (`retool_trl.quickstart.plan.MULTITURN_DEFAULTS`; `emerge`:
    `EMERGE_DEFAULTS`).

    Args:
        output_dir (`str`): Run folder (`summary.json`, `quickstart.png`, `tool_rl/`, `text_rl/`).
        task (`str`): `arithmetic` (one code call per answer), `multiturn` (dependent cells under a per-cell
            length budget, and recovery from a failing cell; see `retool_trl.quickstart.multiturn`) or `emerge` (the
            arithmetic task from a checkpoint that almost never calls code; see `retool_trl.quickstart.emerge`).
        call_format (`str`): How the model calls the interpreter (arithmetic task): `tags` (`<code>` tags),
            `markdown` (```` ```python ```` blocks) or `tool_call` (a chat model's `<tool_call>` JSON); each has its
            own shipped model, cold-started on the same traces written in that format.
        model (`str`, *optional*): Checkpoint to start from; the shipped quickstart model (of `call_format`) by
            default.
        max_steps (`int`): GRPO steps of each run.
        prompts_per_step (`int`): Problems per GRPO step.
        num_generations (`int`): Samples per problem (GRPO group size).
        learning_rate (`float`): GRPO learning rate, constant until the last `lr_decay_steps` steps.
        lr_decay_steps (`int`): Steps at the end over which the learning rate decays to 0 (warmup-stable-decay
            schedule, no warmup); 0 keeps it constant. The decay is what makes the trained model a stable one: at a
            constant rate single updates now and then break the tiny model's copying of digits for a step, and the
            last update decides what is evaluated (held-out accuracy spread over 89-99% across seeds at a constant
            rate).
        beta (`float`): KL coefficient to the starting model. Without it the `tags` model's copying of short numbers
            (e.g. two-digit remainders into `\\boxed{}`) degrades while the policy shifts towards calling code (the
            `tool_call` model, already calling code in two answers of three, trains without it).
        temperature (`float`): Sampling temperature of training and evaluation.
        num_train (`int`): Training problems.
        num_eval (`int`): Held-out problems evaluated before and after each run (one sample each).
        max_completion_length (`int`): Completion budget in tokens, interpreter tokens included.
        seed (`int`): Seed of data, sampling and training.
        threads (`int`): torch CPU threads; 0 keeps torch's default. One thread is several times faster than two
            for a model this small on a machine whose cores are busy (threads spin waiting for each other).
        side_by_side (`bool`): Train the two runs at once, the text-only run in a forked process with its own
            sandbox, when `threads` is set and the machine has `threads` cores for each run; otherwise one after the
            other. Each run is seeded alone, so the results do not depend on it; only the wall time does.
    """

    output_dir: str = field(default="retool_quickstart", metadata={"help": "Run folder."})
    task: str = field(default="arithmetic", metadata={"help": "Task: 'arithmetic', 'multiturn' or 'emerge'."})
    call_format: str = field(
        default="tags", metadata={"help": "Call format: 'tags', 'markdown' or 'tool_call' (arithmetic task)."}
    )
    model: str | None = field(default=None, metadata={"help": "Starting checkpoint (default: the shipped model)."})
    max_steps: int = field(default=50, metadata={"help": "GRPO steps of each run."})
    prompts_per_step: int = field(default=8, metadata={"help": "Problems per GRPO step."})
    num_generations: int = field(default=8, metadata={"help": "Samples per problem (GRPO group size)."})
    learning_rate: float = field(default=3e-4, metadata={"help": "GRPO learning rate (constant, then decayed)."})
    lr_decay_steps: int = field(
        default=15, metadata={"help": "Last steps over which the learning rate decays to 0 (0: constant)."}
    )
    beta: float = field(default=0.2, metadata={"help": "KL coefficient to the starting model."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (training and evaluation)."})
    num_train: int = field(default=512, metadata={"help": "Training problems."})
    num_eval: int = field(default=256, metadata={"help": "Held-out problems evaluated before and after."})
    max_completion_length: int = field(default=64, metadata={"help": "Completion budget in tokens."})
    seed: int = field(default=0, metadata={"help": "Seed of data, sampling and training."})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)."})
    side_by_side: bool = field(
        default=True,
        metadata={"help": "Train both runs at once when `threads` is set and there are cores for both (true/false)."},
    )

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}.")
        if self.call_format not in CALL_FORMATS:
            raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {self.call_format!r}.")
        if self.call_format != CALL_FORMATS[0] and self.task != "arithmetic":
            raise ValueError(
                f"call_format {self.call_format!r} is shipped for the arithmetic task only; the {self.task} task "
                "uses 'tags'."
            )
        if isinstance(self.side_by_side, str):  # from the command line
            if self.side_by_side.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"side_by_side must be true or false, got {self.side_by_side!r}.")
            self.side_by_side = self.side_by_side.lower() in ("true", "1", "yes")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}.")
        if self.lr_decay_steps < 0:
            raise ValueError(f"lr_decay_steps must be >= 0, got {self.lr_decay_steps}.")
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


def lr_schedule(max_steps: int, decay_steps: int) -> dict:
    """`ReToolConfig` fields of a learning rate that is constant, then decays to 0 over the last `decay_steps` steps
    (transformers' warmup-stable-decay schedule without warmup); constant when `decay_steps` is 0."""
    if decay_steps <= 0:
        return {"lr_scheduler_type": "constant"}
    return {
        "lr_scheduler_type": "warmup_stable_decay",
        "lr_scheduler_kwargs": {"num_decay_steps": min(decay_steps, max_steps)},
    }


def rl_config(args: QuickstartArguments, run_dir: Path, with_tools: bool, max_tool_calls: int = 2, **overrides):
    """The `ReToolConfig` of one quickstart run.

    Args:
        args ([`QuickstartArguments`]): The run's settings.
        run_dir (`Path`): The run's output folder.
        with_tools (`bool`): Whether code is executed (`False` sets `max_tool_calls=0`).
        max_tool_calls (`int`): Calls per completion when `with_tools` (2 for arithmetic: one call suffices, a
            second is tolerated; the multi-turn task passes its own).
        overrides: Other `ReToolConfig` fields, applied last.
    """
    from ..config import ReToolConfig

    settings = dict(
        output_dir=str(run_dir),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        temperature=args.temperature,
        learning_rate=args.learning_rate,
        **lr_schedule(args.max_steps, args.lr_decay_steps),
        beta=args.beta,
        max_completion_length=args.max_completion_length,
        max_tool_calls=max_tool_calls if with_tools else 0,
        call_format=args.call_format,
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


@dataclass
class TaskPlan:
    """What a quickstart task contributes to the shared run.

    Args:
        task: The task's description (a dataclass; written to `summary.json`).
        model (`str`): Starting checkpoint.
        splits: `{"train": Dataset, "test": Dataset}`.
        panels (`tuple`): Plot panels (`retool_trl.reporting.plotting.plot_comparison`).
        table (`Callable[[dict], str]`): The console table of the summary.
        run_kwargs (`dict`): Extra `train_run` arguments (reward functions, `eval_metrics`, `ReToolConfig` fields).
        summarize (`Callable[[dict, dict], None]`, *optional*): Adds the task's figures to the runs' results, from
            the runs' TRL `log_history` (`summarize(results, histories)`).
        plot (`Callable`, *optional*): The run folder's plot, `plot(histories, results, path, title, footer, seed)`
            -> path; by default `plot_comparison` of `panels`.
    """

    task: object
    model: str
    splits: object
    panels: tuple
    table: object
    run_kwargs: dict = field(default_factory=dict)
    summarize: object = None
    plot: object = None


def quickstart_parser(parser_class):
    """The parser of `retool-trl quickstart`: every [`QuickstartArguments`] field and `--seeds`. No argparse
    defaults: an unset option takes its task's default (see `run_quickstart`); the help names each task's. Built from
    this module alone, so that `--help` imports nothing heavy."""
    from dataclasses import fields

    parser = parser_class(prog="retool-trl quickstart", description=QuickstartArguments.__doc__.split("\n\n")[0])
    for f in fields(QuickstartArguments):
        kind = {"int": int, "float": float}.get(str(f.type), str)
        text = f.metadata["help"]
        if "(default:" not in text:  # a help that says its default in words keeps its own
            default = f"{f.default}" + "".join(
                f"; {task}: {values[f.name]}"
                for task, values in {**TASK_DEFAULTS, **FORMAT_DEFAULTS}.items()
                if f.name in values
            )
            text += f" (default: {default})"
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=kind,
            default=None,
            choices={"task": TASKS, "call_format": CALL_FORMATS}.get(f.name),
            help=text,
        )
    parser.add_argument(
        "--seeds",
        default=None,
        help="Run once per seed (e.g. 0-4 or 0,2,7) into OUTPUT_DIR/seed{N}/, then write seeds.json, seeds.md (mean, "
        "min, max) and seeds.png across them. Overrides --seed.",
    )
    return parser
