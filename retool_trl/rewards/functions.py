"""Reward functions with TRL's signature (`prompts`, `completions`, dataset columns and rollout facts as kwargs).

The rollout hands every reward function these per-completion kwargs, and nothing else of its own (see
`retool_trl.rollout.ROLLOUT_FIELDS`): `model_text` (the text the policy wrote, interpreter output removed),
`num_tool_calls`, `num_tool_errors`, `num_tool_timeouts`, `num_infra_errors`, `infra_failed` and `num_void_turns`.
The built-in rewards take their settings (reward values, tags, ...) from `ReToolConfig` through `bind_config`, not
from kwargs, so a user reward with a parameter of the same name never receives ReTool's value.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence

from math_verify import LatexExtractionConfig, parse, verify

from ..format.parsing import Tags, last_boxed, model_prose
from ..format.registry import format_of


def _completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    # Conversational completion: a list of messages; the assistant's content is what the model wrote.
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def is_equivalent(prediction: str | None, gold: str) -> bool:
    """Whether `prediction` (contents of a `\\boxed{}`) equals `gold` according to math-verify."""
    if prediction is None or gold is None:
        return False
    # math-verify's timeout uses SIGALRM, which only exists in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    if not gold_parsed:
        gold_parsed = parse(str(gold), parsing_timeout=timeout)
    pred_parsed = parse(f"\\boxed{{{prediction}}}", [LatexExtractionConfig()], parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return prediction.strip() == str(gold).strip()
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def final_answer(completion, model_text: str | None = None, tags: Tags = Tags()) -> str | None:
    """The last `\\boxed{}` in the model's own prose (outside code and interpreter blocks).

    `model_text` (from the rollout) holds only the policy's tokens. Without it the completion as TRL decoded it is
    read, interpreter output included: the rollout defangs any tag that output prints, so the blocks still parse.
    """
    text = model_text if model_text is not None else _completion_text(completion)
    return last_boxed(model_prose(text, tags))


def is_correct(completion, answer: str, model_text: str | None = None, tags: Tags = Tags()) -> bool:
    """Whether the model's own final `\\boxed{}` answer is equivalent to `answer`."""
    return is_equivalent(final_answer(completion, model_text, tags), answer)


def boxed_accuracy(
    completions: Sequence,
    answer: Sequence[str],
    model_text: Sequence[str] | None = None,
    num_tool_calls: Sequence[int] | None = None,
    infra_failed: Sequence[bool] | None = None,
    log_metric=None,
    *,
    correct_reward: float = 1.0,
    incorrect_reward: float = -1.0,
    drop_infra_failures: bool = True,
    tags: Tags = Tags(),
    **kwargs,
) -> list[float | None]:
    r"""ReTool's outcome reward: `correct_reward` (+1) if the last `\boxed{}` the model wrote is equivalent to the
    gold `answer` (math-verify), else `incorrect_reward` (-1).

    Only model-written prose counts: interpreter output and code blocks are removed first, so an answer printed by
    code earns nothing until the model states it.

    Args:
        completions: Completions as TRL passes them (strings, or lists of messages).
        answer: Gold answers, one per completion (the dataset's `answer` column).
        model_text: Text written by the policy (from the rollout); if absent it is recovered from `completions`.
        num_tool_calls: Executions per completion (from the rollout), used to log accuracy with vs without code.
        infra_failed: Per completion, whether a sandbox failure (not the model's fault) survived a retry; such
            completions get `None` (unscored: TRL gives them zero advantage) instead of `incorrect_reward`, unless
            `drop_infra_failures` is False.
        log_metric: TRL's metric logger, passed by the trainer.
        correct_reward, incorrect_reward, drop_infra_failures, tags: Settings; `ReToolTrainer` binds
            `ReToolConfig`'s (see `bind_config`).
    """
    correct = []
    for i, completion in enumerate(completions):
        text = model_text[i] if model_text is not None else None
        correct.append(is_correct(completion, answer[i], text, tags))
    unscored = [bool(infra_failed and drop_infra_failures and infra_failed[i]) for i in range(len(correct))]
    if log_metric is not None and num_tool_calls is not None:
        # Over the scored completions only: one whose sandbox failed (not the model's fault) is left unscored.
        scored = [(c, n) for c, n, skip in zip(correct, num_tool_calls, unscored) if not skip]
        with_code = [c for c, n in scored if n > 0]
        without_code = [c for c, n in scored if n == 0]
        if infra_failed is not None:  # the rollout says which completions the sandbox failed
            log_metric("retool/unscored", float(sum(unscored)))
        if scored:  # the fraction correct, whatever the reward values (the progress line and plots show it)
            log_metric("retool/accuracy", sum(c for c, _ in scored) / len(scored))
        if with_code:
            log_metric("retool/accuracy_with_code", sum(with_code) / len(with_code))
        if without_code:
            log_metric("retool/accuracy_without_code", sum(without_code) / len(without_code))
    rewards = [float(correct_reward) if c else float(incorrect_reward) for c in correct]
    return [None if skip else r for r, skip in zip(rewards, unscored)]


def boxed_accuracy_and_recovery(
    completions: Sequence,
    answer: Sequence[str],
    model_text: Sequence[str] | None = None,
    num_tool_errors: Sequence[int] | None = None,
    log_metric=None,
    *,
    correct_reward: float = 1.0,
    incorrect_reward: float = -1.0,
    drop_infra_failures: bool = True,
    tags: Tags = Tags(),
    **kwargs,
) -> list[float | None]:
    """[`~retool_trl.rewards.boxed_accuracy`], also logging `retool/recovery_rate` (correct share of the step's
    completions that had a failing cell) and `retool/failing_cell_ratio` (share that had one).

    Recovery is what ReTool's multi-turn claim rests on: a model that reads an error and fixes its code. Correctness
    for the log is judged like the reward (`is_correct`), not read back from reward values, which depend on the
    configured `correct_reward`.

    Args:
        num_tool_errors: Failing cells per completion (from the rollout).
        Others: as for `boxed_accuracy`.
    """
    settings = dict(correct_reward=correct_reward, incorrect_reward=incorrect_reward, tags=tags)
    rewards = boxed_accuracy(
        completions,
        answer,
        model_text=model_text,
        log_metric=log_metric,
        drop_infra_failures=drop_infra_failures,
        **settings,
        **kwargs,
    )
    if log_metric is not None and num_tool_errors is not None:
        failing = [i for i, errors in enumerate(num_tool_errors) if errors]
        log_metric("retool/failing_cell_ratio", len(failing) / max(len(num_tool_errors), 1))
        if failing:
            recovered = [
                is_correct(completions[i], answer[i], model_text[i] if model_text is not None else None, tags)
                for i in failing
            ]
            log_metric("retool/recovery_rate", sum(recovered) / len(recovered))
    return rewards


def tool_use_shaping(
    completions: Sequence,
    answer: Sequence[str],
    num_tool_calls: Sequence[int],
    model_text: Sequence[str] | None = None,
    *,
    tool_use_bonus: float = 0.1,
    tags: Tags = Tags(),
    **kwargs,
) -> list[float]:
    r"""Reward shaping used by the verl and slime ReTool recipes: `tool_use_bonus` for a *wrong* answer that called
    code at least once, 0 otherwise. Added to `boxed_accuracy`, a wrong answer with code then scores a little above
    a wrong answer without, and never near a right one (`ReToolConfig` bounds the bonus).

    Args:
        completions, answer, model_text: As for `boxed_accuracy`.
        num_tool_calls: Executions per completion (from the rollout).
        tool_use_bonus, tags: Settings; `ReToolTrainer` binds `ReToolConfig`'s (see `bind_config`).
    """
    bonus = float(tool_use_bonus)
    shaped = []
    for i, completion in enumerate(completions):
        text = model_text[i] if model_text is not None else None
        wrong = not is_correct(completion, answer[i], text, tags)
        shaped.append(bonus if wrong and num_tool_calls[i] > 0 else 0.0)
    return shaped


BUILTIN_REWARDS = (boxed_accuracy, boxed_accuracy_and_recovery, tool_use_shaping)


def bind_config(func: Callable, args) -> Callable:
    """`func` with its settings taken from `args` (a `ReToolConfig`) when it is one of ReTool's built-in rewards.

    The settings are bound here rather than passed as kwargs, so they never reach other reward functions, and they
    win over a dataset column of the same name. Other reward functions are returned unchanged.
    """
    if func not in BUILTIN_REWARDS:
        return func
    settings = {
        "correct_reward": args.correct_reward,
        "incorrect_reward": args.incorrect_reward,
        "drop_infra_failures": args.drop_infra_failures,
        "tool_use_bonus": args.tool_use_bonus,
        "tags": format_of(args).prose_for(args),
    }
    accepted = inspect.signature(func).parameters
    settings = {name: value for name, value in settings.items() if name in accepted}

    @functools.wraps(func)  # keeps the name TRL logs the reward under
    def configured(*call_args, **kwargs):
        return func(*call_args, **{**kwargs, **settings})

    return configured
