"""The sandbox server's capacity figures in docs/performance.md, from `scripts/results/sandbox_capacity.jsonl`.

`scripts/bench_sandbox.py --server-capacity --json` appends one line per run: a row per load size for the server
(`capacity`) and for the subprocess-per-call service beside it (`baseline`), each a median over alternated runs with
min-max. The table, the per-node extrapolation under it and the plot (`sandbox_capacity.png`) use the newest line.
`scripts/render/render_figures.py` calls `blocks` and `draw`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # results_log: where every run is recorded
import results_log  # noqa: E402

BENCHMARK = "sandbox_capacity"
PLOT = "sandbox_capacity.png"
COMMAND = "python scripts/bench_sandbox.py --server-capacity --json"
# The extrapolation's example: a node's cores for cells, and one GRPO step's interpreter calls (512 completions,
# 3 calls each: a 64-prompt x 8-sample batch with the load's 2-4 calls per session).
NODE_CORES = (16, 64)
STEP_CALLS = 512 * 3


def _newest(directory: Path) -> tuple[int, dict] | None:
    lines = [
        (n, line) for n, line in enumerate(results_log.read(BENCHMARK, directory), start=1) if line.get("capacity")
    ]
    return lines[-1] if lines else None


def _spread(row: dict, key: str, fmt: str) -> str:
    return f"{row[key]:{fmt}} ({row[f'{key}_min']:{fmt}}-{row[f'{key}_max']:{fmt}})"


def _failures(row: dict) -> str:
    seen = {kind: count for kind, count in row.get("failures_by_kind", {}).items() if count}
    meant = row.get("intended_failures", {})
    if not seen:
        return "none"

    def one(kind: str, count: int) -> str:
        if kind not in meant:
            return f"{kind} {count} (**not meant**)"
        return (
            f"{kind} **{count}** (meant {meant[kind]})"
            if count > meant[kind]
            else f"{kind} {count} (meant {meant[kind]})"
        )

    return ", ".join(one(kind, count) for kind, count in sorted(seen.items()))


def _provenance(n: int, line: dict) -> str:
    run = line.get("run", {})
    load = run.get("load_avg_before")
    parts = [
        run.get("date", "date unknown")[:10],
        f"commit {run.get('commit') or 'unknown'}" + (" (with uncommitted changes)" if run.get("dirty") else ""),
        f"{line.get('cpu_count')} CPUs, {line.get('workers')} cell slots, isolation `{line.get('isolation')}`",
        f"load average before {load[0]:.1f}" if load else "load before not recorded",
    ]
    return f"Source: `scripts/results/{BENCHMARK}.jsonl`, line {n}: " + ", ".join(parts) + "."


def extrapolation(line: dict) -> str:
    """The per-node sentence: the measured calls per second per core times a node's cores, labelled as what it is."""
    # The busiest load the server carried with no failure the load did not mean (past it, calls failed waiting).
    clean = [
        (ours, theirs)
        for ours, theirs in zip(line["capacity"], line["baseline"], strict=True)
        if all(
            count <= ours.get("intended_failures", {}).get(kind, 0) for kind, count in ours["failures_by_kind"].items()
        )
    ]
    ours, theirs = (
        max(clean, key=lambda pair: pair[0]["calls_per_s_per_core"])
        if clean
        else (
            line["capacity"][-1],
            line["baseline"][-1],
        )
    )
    per_core, base = ours["calls_per_s_per_core"], theirs["calls_per_s_per_core"]
    nodes = "; ".join(
        f"{cores} cores: {cores} x {per_core:.1f} = {cores * per_core:,.0f} calls/s, a step's {STEP_CALLS:,} calls in "
        f"{STEP_CALLS / (cores * per_core):.1f} s (subprocess per call: {STEP_CALLS / (cores * base):.1f} s)"
        for cores in NODE_CORES
    )
    return (
        f"**Per node (an extrapolation, not a measurement).** At {ours['sessions']:,} sessions the server served "
        f"{per_core:.1f} calls per second per core of this machine. If a node's cores scale linearly (they share no "
        f"lock in the server beyond its process, and the clients here shared the same cores, so the figure is "
        f"conservative in that respect but it was measured on 2 cores only), then: {nodes}. A step's calls here means "
        f"{STEP_CALLS:,} = 512 completions x 3 calls, with this load's cells (most 1-10 ms, a few up to "
        f"{line.get('max_cell_ms', 1000):.0f} ms); longer cells scale these times up by their mean."
    )


def blocks(directory: Path) -> dict[str, str]:
    newest = _newest(directory)
    if newest is None:
        return {BENCHMARK: f"No run recorded yet: run `{COMMAND}` (it appends its line to `scripts/results/`)."}
    n, line = newest
    out = [
        "| sessions at once | service | calls/s per core | p50 ms | p99 ms | failures by kind |",
        "|---|---|---|---|---|---|",
    ]
    for ours, theirs in zip(line["capacity"], line["baseline"], strict=True):
        for name, row, bold in (("`retool-trl sandbox-server`", ours, True), ("subprocess per call", theirs, False)):
            rate = _spread(row, "calls_per_s_per_core", ".1f")
            out.append(
                f"| {row['sessions']:,} | {name} | {f'**{rate}**' if bold else rate} | "
                f"{_spread(row, 'p50_ms', '.0f')} | {_spread(row, 'p99_ms', '.0f')} | {_failures(row)} |"
            )
    runs = line["capacity"][0].get("runs")
    spread = (
        f"Medians of {runs} alternated runs per size (min-max); failures are counted over all {runs} runs together, "
        "as are the ones the load meant."
        if runs and runs > 1
        else ("One run per size, ours then the baseline: not yet a median of alternated runs.")
    )
    text = "\n".join(out) + f"\n\n{spread}\n\n"
    text += extrapolation(line) + "\n\n" + _provenance(n, line)
    return {BENCHMARK: text}


def draw(directory: Path) -> Path | None:
    """Redraws `PLOT` from the newest line: calls/s per core and p99 latency against sessions, both services."""
    newest = _newest(directory)
    if newest is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, line = newest
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, key, style in (("sandbox-server", "capacity", "o-"), ("subprocess per call", "baseline", "s--")):
        rows = line[key]
        sizes = [r["sessions"] for r in rows]
        for ax, metric, scale in ((axes[0], "calls_per_s_per_core", 1.0), (axes[1], "p99_ms", 1.0)):
            mid = [r[metric] * scale for r in rows]
            low = [r[metric] - r[f"{metric}_min"] for r in rows]
            high = [r[f"{metric}_max"] - r[metric] for r in rows]
            ax.errorbar(sizes, mid, yerr=[low, high], fmt=style, capsize=3, label=name)
    axes[0].set_ylabel("calls per second per core")
    axes[1].set_ylabel("p99 latency of a call (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks([r["sessions"] for r in line["capacity"]])
        ax.set_xticklabels([str(r["sessions"]) for r in line["capacity"]])
        ax.set_xlabel("sessions at once (2-4 calls each)")
        ax.grid(alpha=0.3)
        ax.legend()
    runs = line["capacity"][0].get("runs")
    fig.suptitle(
        f"sandbox capacity under a GRPO-shaped load, {line.get('cpu_count')} CPUs "
        + (f"(median of {runs} alternated runs, bars min-max)" if runs and runs > 1 else "(one run per size)"),
        fontsize=10,
    )
    fig.text(0.5, 0.005, COMMAND, ha="center", fontsize=8, family="monospace")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = directory / PLOT
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
