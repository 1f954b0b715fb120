"""The `retool-trl` command line (also `python -m retool_trl`), one module per command as in `trl/cli`.

    retool-trl train --config configs/retool_qwen2.5-1.5b_lora.yaml [--key value ...]   GRPO with the interpreter
    retool-trl sft --config configs/sft_cold_start.yaml [--key value ...]       cold-start SFT, interpreter masked
    retool-trl eval --model PATH --dataset aime_2024 --num-samples 8            pass@1 / avg@k with the interpreter
    retool-trl quickstart [--task multiturn] [--output-dir DIR]                 the CPU quickstart(s)
    retool-trl plot --run DIR                                                   PNG of a run's (or runs') logs

`train` and `sft` parse with TRL's `TrlParser` (see `retool_trl.cli.parser`), so every `GRPOConfig`/`SFTConfig`
field, LoRA (`use_peft`, `lora_r`, ...) and `--config` YAML files work as in TRL's own scripts; command-line values
override the YAML. `eval` takes only the model, data, sampling and interpreter options.

Mistakes in the input (unknown keys, wrong types, missing columns, a tokenizer that cannot be used) end the command
with exit status 2 and one line on stderr naming the problem and the fix, before any model is loaded where possible.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import sys
from collections.abc import Sequence

from ..errors import UserError, one_line
from .common import PROG

# name -> (module under retool_trl.cli with a `main(argv) -> int`, one-line description). Imported on use, so that
# `retool-trl plot` does not pay for TRL and `--help` of one command does not import the others.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "GRPO with the code interpreter in the rollout (ReToolTrainer)."),
    "sft": ("sft", "Cold-start SFT on code-integrated traces; interpreter output is masked from the loss."),
    "eval": ("eval", "pass@1 / avg@k, code ratio, calls per answer, mean length, with the interpreter."),
    "quickstart": ("quickstart", "The CPU quickstart: tiny model, synthetic arithmetic, plots and summary.json."),
    "plot": ("plot", "PNG of a run's training curves (or of a quickstart folder's two runs)."),
    "sandbox-server": (
        "sandbox_server",
        "Serve jailed, stateful Python sessions over HTTP (SandboxFusion's /run_code too).",
    ),
}


def quiet_openmp_waits() -> None:
    """OpenMP threads (torch's CPU threads) that wait for each other sleep instead of spinning, unless the user set
    `OMP_WAIT_POLICY`. Must run before torch loads. Spinning waiters burn the cores the thread they wait for needs: on
    a loaded 2-core machine the quickstart took 90 s of user CPU and 455 s of wall time with spinning waits, 15 s and
    93 s with passive ones (`scripts/bench/cpu_under_load.py`); on a quiet one, about the same either way."""
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _usage() -> str:
    lines = [
        f"usage: {PROG} <command> [options]   (`{PROG} <command> --help` for a command's options)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


class _StderrHandler(logging.StreamHandler):
    """Writes to the `sys.stderr` of the moment (which tests and notebooks replace), not the one at creation."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _show_info_logs() -> None:
    # The commands report choices they make for the user (e.g. `prompt_format: auto`) at INFO level.
    logger = logging.getLogger("retool_trl")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[retool-trl] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `retool-trl` and `python -m retool_trl`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"{PROG} {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(
            f"{PROG}: error: unknown command {name!r}: {hint}expected one of {', '.join(COMMANDS)}.", file=sys.stderr
        )
        return 2
    _show_info_logs()
    quiet_openmp_waits()
    try:
        command = importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")
        return command.main(rest) or 0
    except UserError as error:
        print(f"{PROG} {name}: error: {one_line(error)}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG} {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `retool-trl train --help | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush does not fail again
        return 0


__all__ = ["COMMANDS", "UserError", "main"]
