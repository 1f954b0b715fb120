"""The quickstart run: from a task's plan, GRPO with and without the interpreter, evaluated before and after.

`run_quickstart` looks the task up in `PLANS` (its plan and defaults), starts one sandbox, trains and evaluates both
runs with `train_run`, and writes the summary and plot; `main` is `retool-trl quickstart`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

from ..reporting.plotting import hardware, plot_comparison
from .arithmetic import arithmetic_plan
from .emerge import emerge_plan
from .multiturn import multiturn_plan
from .plan import (
    EMERGE_DEFAULTS,
    FORMAT_DEFAULTS,
    MULTITURN_DEFAULTS,
    RUNS,
    QuickstartArguments,
    quickstart_parser,
    rl_config,
)
from .seeds import parse_seeds, run_seeds

# Each task: the function that builds its `TaskPlan`, and the `QuickstartArguments` values it takes where the user
# sets none.
PLANS = {
    "arithmetic": (arithmetic_plan, {}),
    "multiturn": (multiturn_plan, MULTITURN_DEFAULTS),
    "emerge": (emerge_plan, EMERGE_DEFAULTS),
}


def _evaluate(model, tokenizer, dataset, config, sandbox, seed: int, name: str, eval_metrics=None, label=None) -> dict:
    """Held-out accuracy, code ratio and length at the sampling temperature (plus what `eval_metrics(report)`
    returns); the completions are written to `RUN/NAME_samples.jsonl` (with `NAME.json` and `NAME.md`) for
    inspection. With a `label` (runs sharing a console) a line labelled with it replaces the progress bar."""
    from transformers import set_seed

    from ..evaluation.scoring import evaluate, write_report

    set_seed(seed)
    model.eval()
    run, side = Path(config.output_dir).name, name.replace("eval_", "")
    desc = f"{run}, held-out, {side} training"  # e.g. "tool_rl, held-out, before training"
    started = time.perf_counter()
    report = evaluate(
        model, tokenizer, dataset, config, num_samples=1, batch_size=64, sandbox=sandbox, desc=desc, progress=not label
    )
    write_report(report, config.output_dir, name)
    m = report.metrics
    if label:
        print(
            f"{label} | held-out, {side} training: accuracy {m['avg@1']:.1%}, code {m['code_ratio']:.0%} "
            f"({time.perf_counter() - started:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    metrics = {"accuracy": m["avg@1"], "code_ratio": m["code_ratio"], "mean_length": m["mean_length"]}
    # Model-written tokens only, as TRL's logged completions/mean_length counts them (the plot puts them side by side).
    metrics["mean_model_tokens"] = m["mean_model_tokens"]
    if eval_metrics is not None:
        metrics.update(eval_metrics(report))
    return metrics


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
    eval_metrics=None,
    probe=None,
    console_label=None,
    callbacks=None,
    evaluate_before=True,
    **overrides,
) -> dict:
    """Evaluates the starting checkpoint, trains one GRPO run, evaluates again, and saves model and logs.

    `with_tools` defaults to `name == "tool_rl"`; `reward_funcs` to the trainer's (`boxed_accuracy`);
    `eval_metrics(report)` adds a task's metrics to each evaluation; `probe(model, tokenizer, dataset, config,
    sandbox, seed, when)` runs after each evaluation (`when`: `"before"` or `"after"`) and returns more summary
    figures, named by itself (the multi-turn task's recovery probe); `console_label` starts each progress line (runs
    trained side by side); `callbacks` are more `TrainerCallback`s (an ablation's stop at a sample budget);
    `evaluate_before=False` skips the evaluation of the starting checkpoint (arms of an ablation share it);
    `overrides` are extra `ReToolConfig` fields (ablations, the multi-turn task's limits).
    """
    from transformers import AutoModelForCausalLM

    from ..reporting.console import use_compact_console
    from ..trainer import ReToolTrainer

    run_dir = out / name
    config = rl_config(args, run_dir, with_tools=name == "tool_rl" if with_tools is None else with_tools, **overrides)
    model = AutoModelForCausalLM.from_pretrained(start)
    print(f"\n== {name}: {RUNS.get(name, overrides or 'GRPO with the interpreter')} ==", flush=True)
    evaluated = dict(eval_metrics=eval_metrics, label=console_label)
    before, probed = {}, {}
    if evaluate_before:
        before = _evaluate(model, tokenizer, splits["test"], config, sandbox, args.seed, "eval_before", **evaluated)
        probed = probe(model, tokenizer, splits["test"], config, sandbox, args.seed, "before") if probe else {}
    started = time.perf_counter()
    trainer = ReToolTrainer(
        model,
        reward_funcs,
        args=config,
        train_dataset=splits["train"],
        processing_class=tokenizer,
        sandbox=sandbox,
        callbacks=callbacks,
    )
    use_compact_console(trainer, run_dir / "log.jsonl", label=console_label)
    trainer.train()
    train_s = time.perf_counter() - started
    trainer.save_model(str(run_dir / "model"))
    trainer.save_state()  # trainer_state.json with TRL's log_history
    after = _evaluate(trainer.model, tokenizer, splits["test"], config, sandbox, args.seed, "eval_after", **evaluated)
    if probe:  # the model is in eval mode (`_evaluate`)
        probed.update(probe(trainer.model, tokenizer, splits["test"], config, sandbox, args.seed, "after"))
    return {
        **{f"{k}_before": v for k, v in before.items()},
        **{f"{k}_after": v for k, v in after.items()},
        **probed,
        "train_s": round(train_s, 1),
        "steps": trainer.state.global_step,
        "log_history": trainer.state.log_history,
    }


def side_by_side(args: QuickstartArguments) -> bool:
    """Whether the two runs train at once: asked for, with a set number of threads, and a core for each thread."""
    return bool(args.side_by_side and args.threads and len(os.sched_getaffinity(0)) >= len(RUNS) * args.threads)


def _train_side_by_side(args, start, tokenizer, plan, out, make_sandbox) -> dict:
    """Trains the first run here and the other in a forked process, each with its own sandbox, and returns both
    results as `train_run` gives them. The fork comes before any sandbox starts (its threads and sockets are not
    copied); a failure or death of the other process is raised here, naming its run."""
    import ctypes
    import multiprocessing
    import signal
    import traceback

    from transformers.utils import logging as transformers_logging

    from ..reporting.isolation import record_isolation

    first, second = RUNS
    context = multiprocessing.get_context("fork")

    def other_run():
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: it ends with the quickstart, however it ends
        try:
            sandbox = make_sandbox()
            try:
                result = train_run(
                    second, args, start, tokenizer, plan.splits, sandbox, out, console_label=second, **plan.run_kwargs
                )
            finally:
                sandbox.close()
            send.send(("ok", result))
        except BaseException as exc:  # noqa: B036 - the parent reports it, whatever it was
            send.send(("error", "".join(traceback.format_exception(exc))))

    # Two processes' bars on one console write over each other's lines: each run prints labelled lines instead.
    bars = transformers_logging.is_progress_bar_enabled()
    receive = send = process = None
    try:
        transformers_logging.disable_progress_bar()
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=other_run, name=f"quickstart {second}")
        process.start()
        send.close()
        sandbox = make_sandbox()
        try:
            record_isolation(sandbox, out)
            results = {
                first: train_run(
                    first, args, start, tokenizer, plan.splits, sandbox, out, console_label=first, **plan.run_kwargs
                )
            }
        finally:
            sandbox.close()
        try:
            kind, value = receive.recv()  # EOFError once the other process is gone without a word
        except EOFError:
            process.join()
            raise RuntimeError(
                f"the {second} run's process ended without a result (exit code {process.exitcode}); run again with "
                "--side-by-side false to train the runs one after the other"
            ) from None
        if kind == "error":
            raise RuntimeError(f"the {second} run failed in its own process:\n{value}")
        results[second] = value
        return results
    finally:
        if process is not None:
            if process.is_alive():
                process.terminate()
            process.join()
        if receive is not None:
            receive.close()
        if bars:
            transformers_logging.enable_progress_bar()


def run_quickstart(output_dir: str | Path = "retool_quickstart", **kwargs) -> dict:
    """Runs the CPU quickstart and writes its run folder.

    From the shipped checkpoint, trains GRPO with the interpreter (`tool_rl`) and, with the same budget, without it
    (`text_rl`, `max_tool_calls=0`), evaluating each on held-out problems before and after at the sampling
    temperature. Writes `summary.json`, `quickstart.png` and, per run, `RUN/model/`, `RUN/trainer_state.json` (TRL's
    `log_history`), `RUN/log.jsonl` (every log as it was written) and `RUN/eval_{before,after}{.json,.md,
    _samples.jsonl}`.

    Args:
        output_dir (`str` or `Path`): Run folder.
        kwargs: Other [`QuickstartArguments`] fields; unset ones take the task's defaults (`PLANS`; for
            `task="multiturn"`, `MULTITURN_DEFAULTS`).

    Returns:
        The summary (as written to `summary.json`).
    """
    import torch
    from transformers import AutoTokenizer

    from ..reporting.isolation import record_isolation
    from ..sandbox.factory import sandbox_from_config

    make_plan, defaults = PLANS.get(kwargs.get("task", "arithmetic"), PLANS["arithmetic"])
    kwargs = {**defaults, **FORMAT_DEFAULTS.get(kwargs.get("call_format", "tags"), {}), **kwargs}
    args = QuickstartArguments(output_dir=str(output_dir), **kwargs)
    started = time.perf_counter()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args)
    start = plan.model
    # Left padding, as TRL's GRPOTrainer loads tokenizers for generation.
    tokenizer = AutoTokenizer.from_pretrained(start, padding_side="left")

    def make_sandbox():
        # One sandbox for the evaluations and the runs of a process (the text run never calls it): one pool start.
        return sandbox_from_config(rl_config(args, out / "tool_rl", with_tools=True))

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        if side_by_side(args):
            results = _train_side_by_side(args, start, tokenizer, plan, out, make_sandbox)
        else:
            sandbox = make_sandbox()
            try:
                record_isolation(sandbox, out)
                results = {
                    name: train_run(name, args, start, tokenizer, plan.splits, sandbox, out, **plan.run_kwargs)
                    for name in RUNS
                }
            finally:
                sandbox.close()
    finally:
        torch.set_num_threads(threads)
    histories = {name: results[name].pop("log_history") for name in RUNS}
    if plan.summarize is not None:
        plan.summarize(results, histories)
    title = (
        f"quickstart, task {args.task}, format {args.call_format}: GRPO with the interpreter (tool_rl) vs text only "
        f"(text_rl) · model {Path(start).name} · seed {args.seed}"
    )
    footer = (
        f"retool-trl quickstart --task {args.task} --call-format {args.call_format} --max-steps {args.max_steps} "
        f"({args.prompts_per_step} problems x "
        f"{args.num_generations} samples per step; held-out: {args.num_eval} problems) on {hardware()}."
    )
    if plan.plot is not None:
        plot = plan.plot(histories, results, out / "quickstart.png", title, footer, args.seed)
    else:
        plot = plot_comparison(
            histories, out / "quickstart.png", evals=results, panels=plan.panels, title=title, footer=footer
        )
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
    from ..reporting.output_folder import check_output_dir

    class _Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, no usage block (the CLI prints it)
            raise UserError(f"{message} (see `retool-trl quickstart --help`)")

    parser = quickstart_parser(_Parser)
    # `--max_steps` as `retool-trl train` spells its options, and `--max-steps` as argparse's: both are accepted.
    names = {f"--{f.name}": f"--{f.name.replace('_', '-')}" for f in fields(QuickstartArguments)}
    argv = [names.get(a.split("=")[0], a.split("=")[0]) + a[len(a.split("=")[0]) :] for a in (argv or [])]
    options = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    seeds = options.pop("seeds", None)
    try:
        if seeds is not None:
            seeds = parse_seeds(seeds)
            options.pop("seed", None)
        defaults = PLANS.get(options.get("task", "arithmetic"), PLANS["arithmetic"])[1]
        defaults = {**defaults, **FORMAT_DEFAULTS.get(options.get("call_format", "tags"), {})}
        QuickstartArguments(**{**defaults, **options})  # bad values are reported before any work starts
    except ValueError as error:
        raise UserError(str(error)) from None
    if options.get("model") is not None and not (Path(options["model"]) / "config.json").is_file():
        raise UserError(f"--model {options['model']!r} is not a model folder (no config.json); pass a checkpoint.")
    check_output_dir(options.get("output_dir", "retool_quickstart"), "output-dir")  # before any training
    if seeds is not None:
        run_seeds(seeds, run_quickstart, **options)
    else:
        run_quickstart(**options)
    return 0
