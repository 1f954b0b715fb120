#!/usr/bin/env python
"""Renders the figure tables of README.md and the docs (performance, quickstart, training, vllm) from
`scripts/results/*.jsonl`.

Each table sits between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->` in its page; the prose around it stays
hand-written. Under each table a line names its source: the results file, the lines, the command and the date,
commit, cores and load they were measured at. A line measured with another command than the one the page shows
(other flags, or recorded before runs logged their conditions) says so in that line.

The emergence quickstart's table and plot come from `render_quickstart`, the sandbox server's capacity table and plot
from `render_capacity`, the dynamic-sampling ablation's from `render_ablation`; their plots are redrawn on a rewrite
(`--check` compares the tables only).

    python scripts/render/render_figures.py           # rewrite the tables in place
    python scripts/render/render_figures.py --check   # exit 1, naming each table that differs from its results (CI)
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_*, when imported by a test
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # results_log: where every run is recorded
import render_ablation  # noqa: E402
import render_capacity  # noqa: E402
import render_quickstart  # noqa: E402
import results_log  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/performance.md", "docs/quickstart.md", "docs/training.md", "docs/vllm.md")
IGNORED_FLAGS = {"--json", "--no-record"}  # change what is printed, not what is measured


# Scripts that moved into a purpose folder: lines recorded before the move name the old path, and still count.
MOVED = {
    "scripts/bench_stage_timings.py": "scripts/bench/bench_stage_timings.py",
    "scripts/cpu_under_load.py": "scripts/bench/cpu_under_load.py",
    "scripts/quickstart_seeds.py": "scripts/experiments/quickstart_seeds.py",
}


def command_key(command: str) -> tuple[str, ...]:
    """A command as it bears on the figures: the script and its flags, whatever interpreter path ran it."""
    argv = shlex.split(command)
    start = next((i for i, a in enumerate(argv) if a.endswith(".py")), 0)
    argv[start : start + 1] = [MOVED.get(argv[start], argv[start])] if argv[start:] else []
    return tuple(a for a in argv[start:] if a not in IGNORED_FLAGS)


def num(value, fmt: str = ".2f") -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        text = format(value, fmt)
        return text
    return str(value)


def fig(line: dict, key: str, fmt: str = ".2f", bold: bool = False) -> str:
    """`key`'s value, in bold if asked, with its min-max from the same line when the benchmark recorded one."""
    if line.get(key) is None:
        return "—"
    text = num(line[key], fmt)
    text = f"**{text}**" if bold else text
    lo, hi = line.get(f"{key}_min"), line.get(f"{key}_max")
    if lo is not None and hi is not None:
        text += f" ({num(lo, fmt)}-{num(hi, fmt)})"
    return text


def slashed(line: dict, keys, fmt: str) -> str:
    """The figures of `keys` in one cell, `a / b / c`; "—" when the first is not in the line."""
    values = [line.get(k) for k in keys]
    return "—" if values[0] is None else " / ".join(num(v, fmt) for v in values)


def walls(line: dict, prefix: str, keys=("barrier", "async", "floor")) -> str:
    values = [line.get(f"{prefix}{k}_seconds") for k in keys]
    return " / ".join(num(v) for v in values) if any(v is not None for v in values) else "—"


Cell = Callable[[dict], str]


@dataclass
class Table:
    """One table: rows of (label, cell), one column per results line of `command` (the newest `columns`)."""

    benchmark: str
    command: str
    rows: list[tuple[str, Cell]]
    columns: int = 1
    header: str = ""
    extra_commands: tuple[str, ...] = ()  # other commands whose lines are shown too, labelled with their flags
    targets: dict[str, str] = field(default_factory=dict)


def _lines(table: Table, directory: Path, main_only: bool = False) -> list[tuple[int, dict]]:
    numbered = list(enumerate(results_log.read(table.benchmark, directory), start=1))
    wanted = {command_key(table.command)}
    if not main_only:
        wanted |= {command_key(c) for c in table.extra_commands}
    same = [(n, line) for n, line in numbered if command_key(line.get("run", {}).get("command", "")) in wanted]
    chosen = same or numbered  # nothing with this command: the newest lines, each saying how it was measured
    return chosen[-table.columns :] if table.columns else chosen


def _provenance(table: Table, chosen: list[tuple[int, dict]]) -> str:
    """One note per group of lines measured alike: `lines 1-3: date, commit, CPUs, load; how measured`."""
    groups: dict[str, list[int]] = {}
    for n, line in chosen:
        run = line.get("run", {})
        load = run.get("load_avg_before")
        where = [run.get("date", "date unknown")[:10], f"commit {run.get('commit') or 'unknown'}"]
        if run.get("dirty"):
            where[-1] += " (with uncommitted changes)"
        if run.get("cpu_count"):
            where.append(f"{run['cpu_count']} CPUs")
        where.append(f"load average before {load[0]:.1f}" if load else "load before not recorded")
        note = ", ".join(where)
        if command_key(run.get("command", "")) != command_key(table.command):
            note += f"; measured as `{run.get('command', 'an unrecorded command')}`, not the command above"
        if run.get("seeded"):
            note += "; " + run["seeded"]
        groups.setdefault(note, []).append(n)
    parts = []
    for note, numbers in groups.items():
        span = f"line {numbers[0]}" if len(numbers) == 1 else f"lines {', '.join(map(str, numbers))}"
        parts.append(f"{span}: {note}")
    return f"Source: `scripts/results/{table.benchmark}.jsonl`, " + "; ".join(parts) + "."


def render_table(table: Table, directory: Path) -> str:
    chosen = _lines(table, directory)
    if not chosen:
        return f"No run recorded yet: run `{table.command}` (it appends its line to `scripts/results/`)."
    if len(chosen) == 1:
        heads = [table.header or "result"]
    else:
        heads = [f"run {i}" for i in range(1, len(chosen) + 1)]
        for i, (_, line) in enumerate(chosen):
            key = command_key(line["run"].get("command", ""))
            if key != command_key(table.command):
                heads[i] += " (`" + " ".join(key[1:]) + "`)"
    has_targets = bool(table.targets)
    out = ["| | " + " | ".join(heads) + (" | target |" if has_targets else " |")]
    out.append("|---|" + "---|" * (sum(h.count(" | ") + 1 for h in heads) + has_targets))
    for label, cell in table.rows:
        cells = [cell(line) for _, line in chosen]
        if all(c == "—" for c in cells):
            continue
        target = f" {table.targets.get(label, '')} |" if has_targets else ""
        out.append(f"| {label} | " + " | ".join(cells) + " |" + target)
    return "\n".join(out) + "\n\n" + _provenance(table, chosen)


def readme_cell(table: Table, directory: Path, cell: Cell) -> str:
    chosen = _lines(table, directory, main_only=True)
    if not chosen:
        return "not measured yet with this command"
    n, line = chosen[-1]
    text = cell(line)
    run = line.get("run", {})
    if command_key(run.get("command", "")) != command_key(table.command):
        text += f" (measured as `{run.get('command')}`)"
    return text + f" [{run.get('date', '')[:10]}, `{table.benchmark}.jsonl` line {n}]"


# ------------------------------------------------------------------------------------------------ the tables
ROLLOUT = Table(
    "rollout",
    "python scripts/bench_rollout.py --json",
    [
        ("TRL `GRPOTrainer` generation, no tools (the floor): wall s", lambda r: fig(r, "plain_generate_s")),
        ("`ReToolTrainer` interleaved rollout: wall s", lambda r: fig(r, "rollout_s")),
        ("interleaved rollout / plain generate", lambda r: fig(r, "rollout_vs_generate", bold=True)),
        ("seed-style loop (one forward per token, KV cache) / rollout", lambda r: fig(r, "seed_loop_vs_rollout")),
        ("`ReToolTrainer` step / `GRPOTrainer` step, no code", lambda r: fig(r, "step_vs_grpo_step")),
        (
            "batch, tokens (interpreter), code calls",
            lambda r: f"{r.get('batch')}, {r.get('tokens')} ({r.get('interpreter_tokens')}), {r.get('tool_calls')}",
        ),
    ],
)
VLLM_COMMAND = ".venv-engines/bin/python scripts/bench_rollout.py --backend vllm --repeats 11 --json"
VLLM_GPU_LIKE = VLLM_COMMAND + " --kv-block-size 32 --separate-cores"


def _regime(r: dict) -> str:
    if "separate_cores" not in r:
        return "—"
    cores = "engine and sandbox on separate cores" if r["separate_cores"] else "engine and sandbox share the cores"
    return f"{r.get('kv_block_size')}-token KV blocks, {cores}"


VLLM = Table(
    "vllm_rollout",
    VLLM_GPU_LIKE,
    [
        ("regime", _regime),
        (
            "rollout (async, the default) / plain generate, same tokens",
            lambda r: fig(r, "vllm_rollout_vs_generate", bold=True),
        ),
        ("rollout (barrier) / plain generate, same tokens", lambda r: fig(r, "vllm_barrier_vs_generate")),
        (
            "... over plain generate of the sampled tokens only: async / barrier",
            lambda r: slashed(r, ("vllm_rollout_vs_generate_sampled", "vllm_barrier_vs_generate_sampled"), ".2f"),
        ),
        (
            "time in engine steps / plain's (sampled tokens): async",
            lambda r: fig(r, "vllm_rollout_engine_vs_generate"),
        ),
        (
            "time in engine steps / plain's (sampled tokens): barrier",
            lambda r: fig(r, "vllm_barrier_engine_vs_generate"),
        ),
        (
            "wall s: plain (same tokens) / async / barrier",
            lambda r: slashed(r, ("plain_generate_s", "rollout_s", "barrier_rollout_s"), ".3f"),
        ),
        (
            "barrier: in engine calls / sandbox / the rest, s",
            lambda r: slashed(r, ("engine_calls_s", "sandbox_s", "other_s"), ".3f"),
        ),
        (
            "engine steps: async / barrier / plain (sampled tokens)",
            lambda r: slashed(r, ("rollout_engine_steps", "barrier_engine_steps", "plain_sampled_engine_steps"), "d"),
        ),
        (
            "ms per engine step: async / barrier / plain (sampled tokens)",
            lambda r: slashed(r, ("rollout_step_ms", "barrier_step_ms", "plain_sampled_step_ms"), ".2f"),
        ),
        (
            "sequences per engine step: async / barrier / plain (sampled tokens)",
            lambda r: slashed(
                r,
                ("rollout_sequences_per_step", "barrier_sequences_per_step", "plain_sampled_sequences_per_step"),
                ".1f",
            ),
        ),
        (
            "engine steps that prefilled: async / barrier / plain (sampled tokens)",
            lambda r: slashed(
                r, ("rollout_prefill_steps", "barrier_prefill_steps", "plain_sampled_prefill_steps"), "d"
            ),
        ),
        (
            "prompt tokens prefilled (from the prefix cache): barrier",
            lambda r: f"{num(r.get('barrier_prefill_tokens'), 'd')} ({num(r.get('barrier_cached_tokens'), 'd')})",
        ),
        ("prompt tokens prefilled: plain (sampled tokens)", lambda r: num(r.get("plain_sampled_prefill_tokens"), "d")),
        ("engine start (once per training run), s", lambda r: num(r.get("engine_start_s"), ".1f")),
    ],
    columns=3,
    extra_commands=(VLLM_COMMAND, VLLM_COMMAND + " --kv-block-size 32"),
)
ASYNC = Table(
    "async_rollout",
    ".venv-engines/bin/python scripts/bench_async_rollout.py --engine both --runs 3 --json",
    [
        ("colocated: `async_vs_barrier`", lambda r: fig(r, "colocate_async_vs_barrier", bold=True)),
        ("colocated: `barrier_vs_floor` (upper bound)", lambda r: fig(r, "colocate_barrier_vs_floor")),
        ("colocated: `async_vs_floor`", lambda r: fig(r, "colocate_async_vs_floor")),
        ("colocated: barrier / async / floor wall, s", lambda r: walls(r, "colocate_")),
        ("server: `async_vs_barrier`", lambda r: fig(r, "async_vs_barrier", bold=True)),
        ("server: `barrier_vs_floor` (upper bound)", lambda r: fig(r, "barrier_vs_floor")),
        ("server: barrier / async / floor wall, s", lambda r: walls(r, "")),
        (
            "TRL `GRPOTrainer(tools=[work])._generate` wall over ours (`trl_tools_vs_retool`), server",
            lambda r: fig(r, "trl_tools_vs_retool", bold=True),
        ),
        ("`same_outputs` (token ids, masks, reward kwargs)", lambda r: num(r.get("same_outputs"))),
    ],
    columns=4,
    extra_commands=(
        ".venv-engines/bin/python scripts/bench_async_rollout.py --engine colocate --turns even --runs 3",
    ),
)
GPU_MODEL = Table(
    "async_rollout_gpu_model",
    "python scripts/bench_async_rollout.py --engine gpu-model --json",
    [
        ("model (`gpu_model`)", lambda r: num(r.get("gpu_model"))),
        ("`gpu_model_async_vs_barrier`", lambda r: fig(r, "gpu_model_async_vs_barrier", bold=True)),
        ("ideal async / ideal barrier", lambda r: fig(r, "gpu_model_ideal_async_vs_barrier")),
        ("`gpu_model_async_vs_ideal` (1.0 is the ideal)", lambda r: fig(r, "gpu_model_async_vs_ideal", bold=True)),
        ("`gpu_model_barrier_vs_ideal`", lambda r: fig(r, "gpu_model_barrier_vs_ideal")),
        ("async / barrier wall, s", lambda r: walls(r, "gpu_model_", ("async", "barrier"))),
        ("ideal async / ideal barrier, s", lambda r: walls(r, "gpu_model_ideal_", ("async", "barrier"))),
        (
            "engine sleep overshoot: async / barrier, s",
            lambda r: walls(r, "gpu_model_sleep_overshoot_", ("async_s", "barrier_s")).replace("_s", ""),
        ),
        ("snippet seconds in all (long-tailed)", lambda r: num(r.get("gpu_model_snippet_seconds_total"))),
    ],
    columns=2,
    extra_commands=("python scripts/bench_async_rollout.py --engine gpu-model --gpu-model qwen2.5-7b-h200 --json",),
)
SANDBOX = Table(
    "sandbox",
    "python scripts/bench_sandbox.py --json",
    [
        ("pool, first calls: p50 ms", lambda r: fig(r, "first_call_p50_ms")),
        ("pool, follow-up calls: p50 ms", lambda r: fig(r, "followup_p50_ms")),
        ("one session, back to back: p50 ms", lambda r: fig(r, "steady_p50_ms")),
        ("pool, all calls: p50 / p99 ms", lambda r: f"**{num(r.get('p50_ms'))}** / {num(r.get('p99_ms'))}"),
        ("pool, all calls: snippets/s", lambda r: num(r.get("throughput_per_s"), ",.0f")),
        ("subprocess per call: p50 ms", lambda r: fig(r, "baseline_p50_ms")),
        ("p50 ratio (subprocess / pool)", lambda r: f"**{num(r.get('speedup_p50'), '.1f')}x**"),
    ],
    columns=6,
)
SCALE = Table(
    "sandbox_scale",
    "python scripts/bench_sandbox.py --scale --json",
    [
        ("burst after `reserve`, first call p50 / p99 / max, ms", lambda r: _trio(r, "burst")),
        ("burst after `reserve`, sessions closing, p50 / p99 / max, ms", lambda r: _trio(r, "burst_close")),
        ("burst without `reserve`, first call p50 / p99, ms", lambda r: _trio(r, "burst_noreserve", max_=False)),
        ("fresh sessions per second without `reserve`", lambda r: num(r.get("fresh_per_s"), ".0f")),
        ("floor: jails prepared per second", lambda r: num(r.get("fresh_floor_per_s"), ".0f")),
        (
            "1,024 live sessions, follow-up p50 / p99, ms",
            lambda r: f"{num(r.get('live_follow_p50_ms'), '.0f')} / {num(r.get('live_follow_p99_ms'), '.0f')}",
        ),
        ("unique memory per live session, MB", lambda r: num(r.get("live_mb_per_session"), ".1f")),
        (
            "churn of 5,000: trainer RSS growth MB, cgroups and fds left",
            lambda r: (
                f"+{num(r.get('churn_rss_growth_mb'), '.1f')}, {r.get('churn_cgroups_left')}, "
                f"{r.get('churn_fds_left')}"
            ),
        ),
    ],
    columns=3,
    targets={
        "burst after `reserve`, first call p50 / p99 / max, ms": "p99 <= 100, max <= 500",
        "burst after `reserve`, sessions closing, p50 / p99 / max, ms": "p99 <= 100",
        "fresh sessions per second without `reserve`": ">= 100, within 1.5x of the floor",
        "1,024 live sessions, follow-up p50 / p99, ms": "p99 <= 100",
        "unique memory per live session, MB": "<= 5",
        "churn of 5,000: trainer RSS growth MB, cgroups and fds left": "<= 20, 0, 0",
    },
)


def _cpu(condition: str, policy: str) -> Cell:
    def cell(r: dict) -> str:
        user = r.get(f"{condition}_{policy}_user_s_per_step")
        if user is None:
            return "—"
        return (
            f"{num(user)} s user CPU per step, {num(r.get(f'{condition}_{policy}_involuntary_switches'), ',d')} "
            f"involuntary switches, {num(r.get(f'{condition}_{policy}_wall_s'), '.0f')} s wall"
        )

    return cell


CPU_LOAD = Table(
    "cpu_under_load",
    "python scripts/bench/cpu_under_load.py --json",
    [
        ("quiet, as the command runs (passive OpenMP waits)", _cpu("quiet", "default")),
        ("loaded, as the command runs (passive OpenMP waits)", _cpu("loaded", "default")),
        ("quiet, `OMP_WAIT_POLICY=ACTIVE` (spinning waits)", _cpu("quiet", "active")),
        ("loaded, `OMP_WAIT_POLICY=ACTIVE` (spinning waits)", _cpu("loaded", "active")),
    ],
)


def _trio(r: dict, prefix: str, max_: bool = True) -> str:
    keys = ["p50_ms", "p99_ms"] + (["max_ms"] if max_ else [])
    return slashed(r, [f"{prefix}_{k}" for k in keys], ".0f")


def readme_table(directory: Path) -> str:
    rows = [
        (
            "[interleaved rollout](docs/performance.md#rollout-transformers) / plain batched `generate` of the same "
            "tokens (B=32, 64 code calls)",
            ROLLOUT,
            lambda r: (
                fig(r, "rollout_vs_generate", bold=True)
                + f"x (a per-sample loop: {num(r.get('seed_loop_vs_rollout'))}x the rollout)"
            ),
        ),
        (
            "[rollout through vLLM](docs/performance.md#rollout-through-vllm) / plain vLLM generate of the same "
            "tokens (CPU build; 32-token KV blocks, engine and sandbox on separate cores, as on a GPU node)",
            VLLM,
            lambda r: (
                fig(r, "vllm_rollout_vs_generate", bold=True)
                + f"x; time in engine steps / plain's: {fig(r, 'vllm_barrier_engine_vs_generate')}x (barrier), "
                + f"{fig(r, 'vllm_rollout_engine_vs_generate')}x (async)"
            ),
        ),
        (
            "[async vs barrier rollout](docs/performance.md#async-vs-barrier-rollout-on-vllm) on vLLM (CPU build), "
            "long-tailed turns and snippets: barrier wall / async wall",
            ASYNC,
            lambda r: (
                f"colocated {fig(r, 'colocate_async_vs_barrier', bold=True)}x, server "
                f"{fig(r, 'async_vs_barrier')}x; TRL's `tools=` loop / ours {fig(r, 'trl_tools_vs_retool')}x"
            ),
        ),
        (
            "[async vs barrier on a *model* of a GPU engine](docs/performance.md#async-vs-barrier-on-a-gpu-cost-model)"
            " (a cost model, not a GPU)",
            GPU_MODEL,
            lambda r: (
                f"{fig(r, 'gpu_model_async_vs_barrier', bold=True)}x ({r.get('gpu_model')}); async "
                f"{fig(r, 'gpu_model_async_vs_ideal')}x its ideal schedule"
            ),
        ),
        (
            "[sandbox call](docs/performance.md#sandbox), p50 over 64 jailed sessions x 3 calls vs a subprocess per "
            "call",
            SANDBOX,
            lambda r: (
                f"**{num(r.get('p50_ms'))} ms** vs {num(r.get('baseline_p50_ms'))} ms "
                f"({num(r.get('speedup_p50'), '.1f')}x)"
            ),
        ),
    ]
    out = ["| measurement | command | result |", "|---|---|---|"]
    for label, table, cell in rows:
        out.append(f"| {label} | `{table.command}` | {readme_cell(table, directory, cell)} |")
    return "\n".join(out)


def _spread(r: dict, key: str, fmt: str = ".1f") -> str:
    """A `{"median", "min", "max"}` figure of the server benchmark as `median (min-max)`."""
    v = r.get(key)
    if not isinstance(v, dict):
        return "—"
    return f"{num(v['median'], fmt)} ({num(v['min'], fmt)}-{num(v['max'], fmt)})"


def _ratio(r: dict, which: str) -> str:
    rng = r.get(f"{which}_call_cost_ratio_range") or []
    return f"{num(r.get(f'{which}_call_cost_ratio'))} ({'-'.join(num(x) for x in rng)})"


SERVER = Table(
    "sandbox_server",
    "python scripts/bench_sandbox.py --server --json",
    [
        *(
            (
                f"{c} concurrent: p50 / p99 ms, cells/s",
                lambda r, c=c: (
                    f"{_spread(r, f'server_p50_ms_c{c}')} / {_spread(r, f'server_p99_ms_c{c}')}, "
                    f"{_spread(r, f'server_cells_per_s_c{c}', '.0f')}"
                ),
            )
            for c in (1, 8, 32)
        ),
        (
            "8-call session, 8th call / 1st: ours (stateful) vs replayed on a stateless service",
            lambda r: f"**{_ratio(r, 'session')}** vs {_ratio(r, 'replay')}",
        ),
    ],
    columns=3,
)


STAGES = Table(
    "stage_timings",
    "python scripts/bench/bench_stage_timings.py --repeats 11 --json",
    [
        ("GRPO step with the timings (`retool/time/*`): s", lambda r: fig(r, "timed_step_s", ".3f")),
        ("the same step with them switched off: s", lambda r: fig(r, "untimed_step_s", ".3f")),
        ("with / without, runs paired in the same repeat", lambda r: fig(r, "timed_vs_untimed", bold=True)),
        ("pairs of runs, steps per run", lambda r: f"{r.get('repeats')}, {r.get('steps')}"),
    ],
)


def _versus(key: str, fmt: str = ".1f") -> Cell:
    """`key` of `--versus`: this checkout's median (min-max), the other commit's, and their ratio."""

    def cell(r: dict) -> str:
        if r.get(f"{key}_ratio") is None:
            return "—"
        new, old = (
            f"{num(r[f'{key}_{s}'], fmt)} ({num(r[f'{key}_{s}_min'], fmt)}-{num(r[f'{key}_{s}_max'], fmt)})"
            for s in ("new", "old")
        )
        return f"{new} | {old} | {num(r[f'{key}_ratio'], '.2f')}"

    return cell


SCALE_VERSUS = Table(
    "sandbox_scale_versus",
    "python scripts/bench/bench_sandbox.py --scale --versus 95cd8ab --versus-runs 5 --in-container --json",
    [
        ("1,024 live sessions: follow-up p50, ms", _versus("live_follow_p50_ms")),
        ("1,024 live sessions: follow-up p99, ms", _versus("live_follow_p99_ms")),
        ("churn of 5,000: sessions opened, run and closed per second", _versus("churn_per_s", ".0f")),
        ("1,024 parked sessions: the zygote's CPU, share of a core", _versus("live_zygote_idle_core", ".0%")),
    ],
    header="this checkout | 95cd8ab | ratio",
)


def _is_arms(setting: str, key: str, fmt: str) -> Cell:
    """`key` of one sampling setting, with the replay / without it."""

    def cell(r: dict) -> str:
        arms = r.get("settings", {}).get(setting)
        if not arms:
            return "—"
        return f"**{num(arms['replay'][key], fmt)}** / {num(arms['no_replay'][key], fmt)}"

    return cell


IS_SETTINGS = ("top_k=8", "top_p=0.8", "top_k=20,top_p=0.95")
IS_REPLAY = Table(
    "is_replay",
    ".venv-engines/bin/python scripts/experiments/is_replay.py --json",
    [
        row
        for setting in IS_SETTINGS
        for row in (
            (f"`{setting}`: mean IS ratio, with replay / without", _is_arms(setting, "ratio_mean", ".3f")),
            (f"`{setting}`: tokens outside [0.9, 1.1], with / without", _is_arms(setting, "outside_0.9_1.1", ".1%")),
        )
    ]
    + [
        (
            "engine, temperature, completions per setting",
            lambda r: f"{r.get('engine', 'colocate')}, {r.get('temperature')}, {r.get('completions')}",
        )
    ],
    columns=2,
    extra_commands=(".venv-engines/bin/python scripts/experiments/is_replay.py --engine server --json",),
)


def blocks(directory: Path) -> dict[str, str]:
    rendered = {"readme": readme_table(directory)}
    for table in (ROLLOUT, VLLM, ASYNC, GPU_MODEL, SANDBOX, SCALE, SCALE_VERSUS, SERVER, CPU_LOAD, STAGES, IS_REPLAY):
        rendered[table.benchmark] = render_table(table, directory)
    rendered.update(render_quickstart.blocks(directory))
    rendered.update(render_capacity.blocks(directory))
    rendered.update(render_ablation.blocks(directory))
    return rendered


MARKER = re.compile(r"<!-- figures:(?P<name>[\w-]+) -->.*?<!-- /figures:(?P=name) -->", re.S)


def render_page(text: str, rendered: dict[str, str]) -> tuple[str, list[str]]:
    unknown = []

    def sub(m):
        name = m.group("name")
        if name not in rendered:
            unknown.append(name)
            return m.group(0)
        return f"<!-- figures:{name} -->\n{rendered[name]}\n<!-- /figures:{name} -->"

    return MARKER.sub(sub, text), unknown


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page's tables differ from the results")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository whose pages and results to use")
    args = parser.parse_args(argv)
    rendered = blocks(args.root / "scripts" / "results")
    stale = []
    for page in PAGES:
        path = args.root / page
        text = path.read_text()
        new, unknown = render_page(text, rendered)
        if unknown:
            print(f"{page}: unknown figures block(s) {unknown}; known: {sorted(rendered)}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(page)
            if not args.check:
                path.write_text(new)
    if not args.check:
        render_quickstart.draw(args.root / "scripts" / "results")
        render_capacity.draw(args.root / "scripts" / "results")
        render_ablation.draw(args.root / "scripts" / "results")
    if args.check and stale:
        print(
            f"figures in {', '.join(stale)} differ from scripts/results/*.jsonl: "
            "run python scripts/render/render_figures.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
