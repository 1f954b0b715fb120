"""`retool-trl plot`: a PNG of a training run's logged metrics (its `trainer_state.json`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UserError, one_line
from .common import PROG
from .parser import OneLineParser


def main(argv: Sequence[str]) -> int:
    """`retool-trl plot --run DIR [--output PNG] [--metrics KEY ...]`."""
    parser = OneLineParser(prog=f"{PROG} plot", description="Plot a training run's logs (trainer_state.json) as PNG.")
    parser.add_argument(
        "--run",
        required=True,
        help="A training output_dir (or a checkpoint, or a trainer_state.json), or a folder of runs such as a "
        "quickstart's (its tool_rl/ and text_rl/ are plotted together).",
    )
    parser.add_argument("--output", default=None, help="PNG path (default: RUN/training_curves.png).")
    parser.add_argument(
        "--metrics",
        nargs="+",
        default=None,
        help="Logged keys to plot, one panel each (default: the ReTool panels: reward, accuracy, code ratio, calls, "
        "errors, recovery, length, KL, entropy, those that were logged and changed).",
    )
    args = parser.parse_args(list(argv))
    from ..reporting.plotting import plot_run

    try:
        path = plot_run(args.run, output=args.output, metrics=args.metrics)
    except (FileNotFoundError, ValueError) as error:
        raise UserError(one_line(error)) from None
    print(path)
    return 0
