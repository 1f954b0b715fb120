"""Rollout metrics logged under `retool/` through TRL's own metric dict (so every `report_to` receives them)."""

from __future__ import annotations

import torch

from ..rollout.spec import RolloutResult


def rollout_metrics(result: RolloutResult, gather, device: torch.device | str | None = None) -> dict[str, float]:
    """Batch-level ReTool metrics, aggregated over all processes with `gather` (e.g. `accelerator.gather`).

    Args:
        result: The rollout of this process.
        gather: Concatenates a tensor across processes (identity on one process).
        device: The process's device (`accelerator.device`). Every tensor handed to `gather` is built there: NCCL
            (any multi-GPU run) refuses a tensor on the host.
    """
    per_row = torch.tensor(
        [
            [
                calls,
                errors,
                timeouts,
                infra,
                lines,
                len(mask) - sum(mask),
                len(mask),
                turns,
                void > 0,
                failed,
            ]
            for calls, errors, timeouts, infra, lines, mask, turns, void, failed in zip(
                result.num_tool_calls,
                result.num_tool_errors,
                result.num_tool_timeouts,
                result.num_infra_errors,
                result.code_lines,
                result.interpreter_mask,
                result.num_turns,
                result.num_void_turns,
                result.infra_failed,
                strict=True,
            )
        ],
        dtype=torch.float64,
        device=device,
    ).reshape(-1, 10)
    rows = gather(per_row).cpu()
    # Fixed-size summaries: processes may run different numbers of snippets.
    exec_s = result.exec_seconds
    latency = torch.tensor([[sum(exec_s), max(exec_s, default=0.0), len(exec_s)]], dtype=torch.float64, device=device)
    latency_sum, latency_max, num_exec = gather(latency).cpu().reshape(-1, 3).T
    # One entry per process: the engine calls of its rollout (every row of a rollout carries the same count).
    calls_per_rollout = sum(result.engine_calls) / len(result.engine_calls) if result.engine_calls else 0.0
    engine_calls = gather(torch.tensor([calls_per_rollout], dtype=torch.float64, device=device)).cpu()
    calls, errors, timeouts, infra, lines, interp_tokens, tokens, turns, void, failed = rows.sum(dim=0).tolist()
    n = max(len(rows), 1)
    metrics = {
        "retool/code_ratio": (rows[:, 0] > 0).double().mean().item() if len(rows) else 0.0,
        "retool/calls_per_completion": calls / n,
        "retool/turns_per_completion": turns / n,
        "retool/error_rate": errors / calls if calls else 0.0,
        "retool/timeout_rate": timeouts / calls if calls else 0.0,
        "retool/infra_error_rate": infra / calls if calls else 0.0,
        "retool/interpreter_token_fraction": interp_tokens / tokens if tokens else 0.0,
        "retool/code_lines_per_call": lines / calls if calls else 0.0,
        "retool/void_turn_ratio": void / n,
        "retool/infra_failed_ratio": failed / n,
        "retool/engine_calls_per_rollout": engine_calls.mean().item(),
    }
    if num_exec.sum() > 0:
        metrics["retool/sandbox_latency_ms_mean"] = (latency_sum.sum() / num_exec.sum()).item() * 1000
        metrics["retool/sandbox_latency_ms_max"] = latency_max.max().item() * 1000
    # Every process's snippets, padded to the longest list (a collective call: every process makes it).
    longest = int(num_exec.max().item()) if len(num_exec) else 0
    padded = torch.full((1, max(longest, 1)), float("nan"), dtype=torch.float64, device=device)
    padded[0, : len(exec_s)] = torch.tensor(exec_s, dtype=torch.float64)
    everyone = gather(padded).cpu().flatten()
    everyone = everyone[~everyone.isnan()]
    if len(everyone):
        metrics["retool/sandbox_latency_ms_p50"] = everyone.quantile(0.5).item() * 1000
        metrics["retool/sandbox_latency_ms_p99"] = everyone.quantile(0.99).item() * 1000
    return metrics
