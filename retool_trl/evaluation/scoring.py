r"""Evaluation with the interpreter: the same rollout as training, scored like the reward.

Each problem is sampled `k` times with [`~retool_trl.evaluation.inference.generate_with_interpreter`]; a completion
is correct when the last `\boxed{}` of the model's own prose is equivalent to the gold answer (math-verify, as
[`~retool_trl.rewards.boxed_accuracy`]). Metrics:

- `pass@1`: accuracy of the first sample of each problem;
- `avg@k`: accuracy over all `k` samples (the unbiased estimate of pass@1; equals `pass@1` for `k=1`);
- `pass@k`: share of problems with at least one correct sample;
- `code_ratio`: share of completions with at least one interpreter call;
- `calls_per_answer`: interpreter calls per completion;
- `mean_length`: completion tokens (interpreter tokens included), and `mean_model_tokens` (policy tokens only);
- `tool_error_rate`, `accuracy_with_code`, `accuracy_without_code`, `truncated_ratio` (no EOS within the budget);
- `infra_failed`: completions whose sandbox (or engine) failed for its own reasons even after a retry, and
  `infra_failed_ratio`, their share. Such a completion says nothing about the model: it is left out of every other
  metric (as training leaves it out of the loss), and a problem whose samples all failed so is left out of the
  per-problem ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..format.parsing import Tags
from ..format.registry import format_of
from ..rewards.functions import final_answer, is_equivalent


@dataclass
class EvalReport:
    """Results of [`evaluate`].

    Args:
        metrics (`dict[str, float | None]`): Aggregate metrics (see the module docstring); `None` where undefined.
        num_problems (`int`): Problems evaluated.
        num_samples (`int`): Completions per problem (`k`).
        records (`list[dict]`): One entry per completion: `problem`, `sample`, `answer`, `prediction`, `correct`,
            `num_tool_calls`, `num_tool_errors`, `length`, `model_tokens`, `truncated`, `infra_failed`,
            `completion`.
        meta (`dict`): Settings worth recording (model, dataset, sampling), filled by the caller.
    """

    metrics: dict[str, float | None]
    num_problems: int
    num_samples: int
    records: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        by_problem: dict[int, dict] = {}
        for r in self.records:
            entry = by_problem.setdefault(
                r["problem"],
                {
                    "index": r["problem"],
                    "answer": r["answer"],
                    "correct": [],
                    "predictions": [],
                    "num_tool_calls": [],
                    "infra_failed": [],
                },
            )
            entry["infra_failed"].append(bool(r.get("infra_failed", False)))
            entry["correct"].append(r["correct"])
            entry["predictions"].append(r["prediction"])
            entry["num_tool_calls"].append(r["num_tool_calls"])
        meta = {k: v for k, v in self.meta.items() if k != "settings"}
        return {
            **meta,
            "num_problems": self.num_problems,
            "num_samples": self.num_samples,
            "num_completions": len(self.records),
            "num_infra_failed": sum(bool(r.get("infra_failed", False)) for r in self.records),
            "metrics": self.metrics,
            "settings": self.meta.get("settings", {}),
            "problems": [by_problem[i] for i in sorted(by_problem)],
        }

    def markdown(self) -> str:
        """A Markdown table of the headline metrics."""
        k = self.num_samples
        m = self.metrics
        columns = [
            ("model", str(self.meta.get("model", "-"))),
            ("dataset", str(self.meta.get("dataset", "-"))),
            ("problems", str(self.num_problems)),
            ("k", str(k)),
            ("pass@1", _pct(m["pass@1"])),
            # With one sample per problem avg@1 and pass@1 are pass@1 again: one column, not three.
            *([(f"avg@{k}", _pct(m[f"avg@{k}"])), (f"pass@{k}", _pct(m[f"pass@{k}"]))] if k > 1 else []),
            ("code ratio", _pct(m["code_ratio"])),
            ("calls/answer", _number(m["calls_per_answer"], ".2f")),
            # Every completion token, the interpreter's included (`mean_model_tokens` in the JSON: the policy's).
            ("mean length (tokens, interpreter included)", _number(m["mean_length"], ".1f")),
            ("tool errors", _pct(m["tool_error_rate"])),
            # Sandbox failures are not the model's: shown beside the scores they are left out of, when there are any.
            *([("sandbox failures (unscored)", str(m["infra_failed"]))] if m.get("infra_failed") else []),
        ]
        head = "| " + " | ".join(c for c, _ in columns) + " |"
        rule = "|" + "|".join("---" for _ in columns) + "|"
        row = "| " + " | ".join(v for _, v in columns) + " |"
        return "\n".join([head, rule, row])


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def score_rollout(
    result, answers: Sequence[str], tags: Tags = Tags(), eos_token_ids: Sequence[int] = ()
) -> list[dict]:
    """Scores each completion of a `RolloutResult` against its gold answer.

    Args:
        result (`RolloutResult`): The rollout (one entry per completion).
        answers (`list[str]`): Gold answer of each completion.
        tags (`Tags`): Tags used to find the model's own prose.
        eos_token_ids (`list[int]`): A completion not ending with one of these was cut by the length budget.

    Returns:
        One dict per completion with `prediction`, `correct`, `num_tool_calls`, `num_tool_errors`, `length`,
        `model_tokens`, `truncated` and `infra_failed` (the sandbox failed for its own reasons: not scored).
    """
    records = []
    for i, answer in enumerate(answers):
        ids, mask = result.completion_ids[i], result.interpreter_mask[i]
        prediction = final_answer("", result.model_text[i], tags)
        records.append(
            {
                "answer": answer,
                "prediction": prediction,
                "correct": bool(is_equivalent(prediction, answer)),
                "num_tool_calls": int(result.num_tool_calls[i]),
                "num_tool_errors": int(result.num_tool_errors[i]),
                "length": len(ids),
                "model_tokens": int(sum(mask)),
                "truncated": not ids or ids[-1] not in set(eos_token_ids),
                "infra_failed": bool(result.infra_failed[i]) if result.infra_failed else False,
            }
        )
    return records


def compute_metrics(records: Sequence[dict], num_samples: int) -> dict[str, float | None]:
    """Aggregate metrics of scored completions (each with `problem` and `sample` indices); see the module docstring.

    Completions marked `infra_failed` are counted in `infra_failed` and left out of everything else: `pass@1` takes
    each problem's first scored sample."""
    k = num_samples
    failed = [r for r in records if r.get("infra_failed")]
    records = [r for r in records if not r.get("infra_failed")]
    problems: dict[int, list[dict]] = {}
    for r in records:
        problems.setdefault(r["problem"], []).append(r)
    firsts = [min(rs, key=lambda r: r["sample"])["correct"] for rs in problems.values()]
    calls = sum(r["num_tool_calls"] for r in records)
    with_code = [r["correct"] for r in records if r["num_tool_calls"] > 0]
    without_code = [r["correct"] for r in records if r["num_tool_calls"] == 0]
    return {
        "pass@1": _mean(firsts),
        f"avg@{k}": _mean([r["correct"] for r in records]),
        f"pass@{k}": _mean([any(r["correct"] for r in rs) for rs in problems.values()]),
        "code_ratio": _mean([r["num_tool_calls"] > 0 for r in records]),
        "calls_per_answer": _mean([r["num_tool_calls"] for r in records]),
        "mean_length": _mean([r["length"] for r in records]),
        "mean_model_tokens": _mean([r["model_tokens"] for r in records]),
        "tool_error_rate": sum(r["num_tool_errors"] for r in records) / calls if calls else 0.0,
        "accuracy_with_code": _mean(with_code),
        "accuracy_without_code": _mean(without_code),
        "truncated_ratio": _mean([r["truncated"] for r in records]),
        "infra_failed": len(failed),
        "infra_failed_ratio": len(failed) / (len(failed) + len(records)) if failed or records else 0.0,
    }


def evaluate(
    model,
    tokenizer,
    dataset,
    args,
    num_samples: int = 1,
    batch_size: int = 16,
    sandbox=None,
    progress: bool = True,
    desc: str = "Evaluating",
) -> EvalReport:
    """Samples `num_samples` completions per problem with the interpreter and scores them.

    Args:
        model: Causal LM (in eval mode).
        tokenizer: Its tokenizer (with a pad token).
        dataset: Rows with `prompt` and `answer` (e.g. from [`~retool_trl.data.load_math_dataset`]).
        args (`ReToolConfig`): Sampling settings, tags, limits and sandbox.
        num_samples (`int`): Completions per problem.
        batch_size (`int`): Completions generated together.
        sandbox (*optional*): Sandbox to reuse; by default one is built from `args` and closed at the end.
        progress (`bool`): Show a tqdm progress bar.
        desc (`str`): The bar's label: what is evaluated (e.g. `"tool_rl before"`).
    """
    import torch
    from tqdm.auto import tqdm

    from ..sandbox.factory import sandbox_from_config
    from ..training.sandbox_health import SandboxHealth
    from .inference import eos_token_ids_of, generate_with_interpreter

    prompts, answers = list(dataset["prompt"]), [str(a) for a in dataset["answer"]]
    jobs = [(p, s) for p in range(len(prompts)) for s in range(num_samples)]
    tags = format_of(args).prose_for(args)  # the model's own prose, in the call format it writes
    own_sandbox = sandbox is None
    sandbox = sandbox_from_config(args) if own_sandbox else sandbox
    records: list[dict] = []
    health = SandboxHealth("evaluation")  # one for all chunks: the sandbox is probed once
    bar = tqdm(total=len(jobs), desc=desc, unit="completion", disable=not progress)
    try:
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start : start + batch_size]
            with torch.no_grad():
                result = generate_with_interpreter(
                    model,
                    tokenizer,
                    [prompts[p] for p, _ in chunk],
                    args,
                    sandbox=sandbox,
                    batch_size=batch_size,
                    health=health,
                )
            scored = score_rollout(result, [answers[p] for p, _ in chunk], tags, eos_token_ids_of(model, tokenizer))
            for (p, s), record, ids in zip(chunk, scored, result.completion_ids):
                # As written, special tokens included: a chat template's turn markers (`<|im_end|>`, ...) show
                # where the model's turns end and the interpreter's answers begin.
                record.update(problem=p, sample=s, completion=tokenizer.decode(ids, skip_special_tokens=False))
                records.append(record)
            bar.update(len(chunk))
    finally:
        bar.close()
        if own_sandbox:
            sandbox.close()
    meta = {
        "settings": {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "max_completion_length": args.max_completion_length,
            "max_tool_calls": args.max_tool_calls,
            "call_format": args.call_format,
            "interpreter_errors": args.interpreter_errors,
            "max_cell_chars": args.max_cell_chars,
            "max_interpreter_output_chars": args.max_interpreter_output_chars,
            "system_prompt": args.system_prompt,
            "seed": args.seed,
        }
    }
    return EvalReport(compute_metrics(records, num_samples), len(prompts), num_samples, records, meta)


def write_report(report: EvalReport, output_dir: str | Path, name: str = "results") -> dict[str, Path]:
    """Writes `NAME.json` (metrics and per-problem results), `NAME.md` (the table) and `NAME_samples.jsonl` (every
    completion) under `output_dir`; returns their paths by kind (`json`, `markdown`, `samples`)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "markdown": out / f"{name}.md", "samples": out / f"{name}_samples.jsonl"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    paths["markdown"].write_text(report.markdown() + "\n")
    with paths["samples"].open("w") as handle:
        for record in report.records:
            handle.write(json.dumps(record) + "\n")
    return paths


__all__ = ["EvalReport", "compute_metrics", "evaluate", "score_rollout", "write_report"]
