r"""The emergence quickstart: RL creates the habit of calling code, from a checkpoint that almost never does.

The task is the arithmetic quickstart's (3x2-digit products, sums of three 4-digit numbers, `(a*b) % m`), but the
shipped checkpoint (`retool_trl/assets/emerge_model/`, built by `scripts/build/build_emerge_model.py`) is the
arithmetic quickstart's model cold-started further on traces of which only 2.5% call `<code>print(expr)</code>`: it can
still copy an expression into code, but at T=1 it does so in about 2% of its answers and guesses the rest, almost
always wrongly. GRPO with the interpreter finds the rare code samples among
a group's guesses, they are the ones rewarded, and the habit grows from there; the same GRPO without the interpreter
has nothing to grow. Every run also records, per step, the code ratio and accuracy of its training samples and the
step at which code use passed 50% (`step_code_ratio_passed_50`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..models.names import ASSETS, MODEL_ALIASES, quickstart_model_path
from ..reporting.panels import Panel
from ..reporting.run_logs import accuracy_of
from .arithmetic import arithmetic_table, step_curves
from .plan import RUNS, TaskPlan

EMERGE_MODEL_DIR = ASSETS / MODEL_ALIASES["quickstart_emerge"]


def emerge_model_path() -> str:
    """Folder of the shipped emergence quickstart model."""
    return quickstart_model_path("quickstart_emerge")


@dataclass
class EmergeTask:
    """The arithmetic task with a cold start that rarely calls code.

    Args:
        difficulty (`int`): Difficulty of the RL, evaluation and cold-start problems.
        kinds (`list[str]`): Problem kinds.
        test_fraction (`float`): Share of the problem space held out for evaluation.
        code_fraction (`float`): Share of cold-start traces that call the interpreter.
    """

    difficulty: int = field(default=2, metadata={"help": "Difficulty of the problems."})
    kinds: list[str] = field(default_factory=lambda: ["product", "sum", "mod"], metadata={"help": "Problem kinds."})
    test_fraction: float = field(default=0.2, metadata={"help": "Share of problems held out for evaluation."})
    code_fraction: float = field(default=0.025, metadata={"help": "Share of cold-start traces that call code."})


def passed_half(ratios: Sequence[float]) -> int | None:
    """The first step (1-based) at which the training samples' code ratio reached 50%; `None` if it never did."""
    return next((step for step, ratio in enumerate(ratios, 1) if ratio >= 0.5), None)


def code_start_probability(model, tokenizer, prompts: Sequence[str], code_start: str = "<code>") -> float:
    """The mean probability, over `prompts`, that the model's first token is `code_start`: how rare the habit is
    exactly, where sampling only bounds it (a policy that never samples code in 6,400 tries may still be at 1e-4, or
    at 1e-9). `code_start` must be one token (the shipped tokenizer's tags are)."""
    import torch

    token = tokenizer.convert_tokens_to_ids(code_start)
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    mask = batch["attention_mask"]
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # each prompt's last token, whichever side is padded
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=mask).logits[torch.arange(len(last)), last]
    return torch.softmax(logits.float(), dim=-1)[:, token].mean().item()


def code_start_probe(model, tokenizer, dataset, config, sandbox, seed: int, when: str) -> dict:
    """`train_run`'s probe: [`code_start_probability`] on the held-out prompts, before and after training."""
    prompts = [p if isinstance(p, str) else p[-1]["content"] for p in dataset["prompt"]]
    return {f"code_start_prob_{when}": code_start_probability(model, tokenizer, prompts, config.code_start)}


def emerge_summarize(results: dict, histories: Mapping[str, Sequence[dict]]) -> None:
    """Adds to each run's summary its per-step curves and `step_code_ratio_passed_50`."""
    for name in RUNS:
        curves = step_curves(histories[name])
        results[name].update(curves, step_code_ratio_passed_50=passed_half(curves["step_code_ratio"]))


COLORS = {"tool_rl": "tab:blue", "text_rl": "tab:orange"}


def plot_emergence(summaries: Mapping[int, dict], path: str | Path, title: str, footer: str | None = None) -> Path:
    """Code ratio and accuracy of the training samples against step, tool-RL and text-RL: each seed a thin line,
    their mean a thick one; held-out values before and after as markers at the ends (means over seeds).

    Args:
        summaries: Seed -> a run folder's summary (with `step_code_ratio` and `step_accuracy` per run).
        path: The PNG to write.
        title, footer: What was run, and the command and machine.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (key, held_out, label) in zip(
        axes,
        (
            ("step_code_ratio", "code_ratio", "completions that call code (%)"),
            ("step_accuracy", "accuracy", "correct completions (%)"),
        ),
    ):
        for run in RUNS:
            curves = [[100 * (v or 0.0) for v in s[run][key]] for s in summaries.values()]
            for curve in curves:
                ax.plot(range(1, len(curve) + 1), curve, color=COLORS[run], lw=0.7, alpha=0.35)
            n = min(len(c) for c in curves)
            mean = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
            ax.plot(range(1, n + 1), mean, color=COLORS[run], lw=2.4, label=f"{run} (mean of {len(curves)})")
            before = sum(s[run][f"{held_out}_before"] for s in summaries.values()) / len(summaries)
            after = sum(s[run][f"{held_out}_after"] for s in summaries.values()) / len(summaries)
            ax.scatter([0], [100 * before], marker="o", facecolors="none", edgecolors=COLORS[run], zorder=3)
            ax.scatter([n + 1], [100 * after], marker="o", color=COLORS[run], zorder=3)
        if key == "step_code_ratio":
            ax.axhline(50, color="0.5", lw=0.8, ls=":")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(label)
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.set_title(f"{label.split(' (')[0]}: training samples per step; held-out before (open) / after", fontsize=9)
    axes[0].legend(fontsize=8, loc="center right")
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.01, footer or f"CPU, {os.cpu_count()} cores", fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def emerge_plot(histories, results: dict, path: Path, title: str, footer: str, seed: int = 0) -> Path:
    """The run folder's plot: [`plot_emergence`] of this one seed."""
    return plot_emergence({seed: results}, path, title, footer)


EMERGE_PANELS = (
    Panel("code ratio", "completions that call code (%)", (("", "retool/code_ratio", None),), True, "code_ratio"),
    Panel("accuracy", "correct completions (%)", (("train samples", None, accuracy_of),), True, "accuracy"),
)


def emerge_table(summary: dict) -> str:
    """The console table: the arithmetic table, and the step at which code use passed 50%."""
    tool = summary["tool_rl"]
    return (
        arithmetic_table(summary)
        + f"\ntool_rl: training samples' code ratio passed 50% at step {tool['step_code_ratio_passed_50'] or '-'}; "
        + f"P(first token is code) on held-out prompts {tool['code_start_prob_before']:.2e} -> "
        + f"{tool['code_start_prob_after']:.2e}"
    )


def emerge_plan(args) -> TaskPlan:
    """The emergence task's part of `run_quickstart`: the arithmetic problems and the rarely-coding checkpoint."""
    from ..data.synthetic import make_splits

    task = EmergeTask()
    splits = make_splits(
        args.num_train,
        args.num_eval,
        seed=args.seed,
        difficulty=task.difficulty,
        kinds=task.kinds,
        test_fraction=task.test_fraction,
    )
    return TaskPlan(
        task,
        args.model or emerge_model_path(),
        splits,
        panels=EMERGE_PANELS,
        table=emerge_table,
        run_kwargs={"probe": code_start_probe},
        summarize=emerge_summarize,
        plot=emerge_plot,
    )
