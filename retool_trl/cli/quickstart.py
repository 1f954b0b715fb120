"""`retool-trl quickstart`: the CPU quickstart (tiny model, synthetic arithmetic, plots and summary.json)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from ..errors import UserError, one_line
from .common import PROG
from .help import OneLineParser, wants_help


def main(argv: Sequence[str]) -> int:
    """Hands the arguments to `retool_trl.quickstart.main` (which parses its own options)."""
    if wants_help(argv):  # from the plan alone: the task modules import torch, TRL and datasets
        from ..quickstart.plan import quickstart_parser

        print(quickstart_parser(OneLineParser).format_help().rstrip("\n"))
        return 0
    # Imported lazily: the quickstart module is optional for the other commands.
    try:
        quickstart = importlib.import_module("retool_trl.quickstart")
    except ImportError as error:
        raise UserError(f"the quickstart is not available in this installation ({one_line(error)}).") from None
    if callable(getattr(quickstart, "main", None)):
        return quickstart.main(list(argv)) or 0
    if callable(getattr(quickstart, "run_quickstart", None)):
        parser = OneLineParser(prog=f"{PROG} quickstart", description="Run the CPU quickstart.")
        parser.add_argument("--output-dir", default="retool_quickstart", help="Where the run is written.")
        args = parser.parse_args(list(argv))
        quickstart.run_quickstart(output_dir=args.output_dir)
        return 0
    raise UserError("the quickstart runner (retool_trl.quickstart.run_quickstart) is missing from this installation.")
