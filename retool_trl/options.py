"""ReTool's own training options, as a dataclass that imports neither torch nor TRL.

[`~retool_trl.ReToolConfig`] is `GRPOConfig` plus these fields (it inherits them from `ReToolOptions`), so the
command line can list and explain them (`retool-trl train --help`) in a fraction of a second, without loading the
training stack. The checks of their values live in `ReToolConfig.__post_init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .format.prompts import SHIPPED_PROMPTS, Tags
from .format.registry import FORMAT_NAMES, formats_help
from .sandbox.cell_limits import ERROR_FORMATS

TRUNCATION_SIDES = ("head", "tail", "middle")
SANDBOX_BACKENDS = ("local", "remote")


@dataclass
class ReToolOptions:
    """The fields [`~retool_trl.ReToolConfig`] adds to `GRPOConfig` (documented there), with defaults and help."""

    call_format: str = field(
        default="tags",
        metadata={
            "help": f"How the model calls the interpreter: {formats_help()}.",
            "choices": FORMAT_NAMES,
        },
    )
    code_start: str = field(
        default=Tags.code_start, metadata={"help": "Tag that opens a code block written by the model."}
    )
    code_end: str = field(
        default=Tags.code_end, metadata={"help": "Tag that closes a code block; generation stops right after it."}
    )
    interpreter_start: str = field(
        default=Tags.interpreter_start,
        metadata={"help": "Tag that opens the interpreter output inserted by the rollout."},
    )
    interpreter_end: str = field(
        default=Tags.interpreter_end,
        metadata={"help": "Tag that closes the interpreter output inserted by the rollout."},
    )
    max_tool_calls: int = field(
        default=8,
        metadata={
            "help": "Maximum interpreter calls per completion; later calls are not run. 0 disables the "
            "interpreter (text-only RL)."
        },
    )
    max_interpreter_output_chars: int = field(
        default=1024,
        metadata={"help": "Interpreter output is truncated to this many characters before tokenization."},
    )
    interpreter_truncation: str = field(
        default="middle",
        metadata={
            "help": "Part of a long interpreter output that is kept: 'head', 'tail' or 'middle' (elide the middle).",
            "choices": list(TRUNCATION_SIDES),
        },
    )
    interpreter_errors: str = field(
        default="traceback",
        metadata={
            "help": "How a failing cell is reported: 'traceback' (the whole error) or 'last_line' (only the exception "
            "line, e.g. `NameError: name 'a' is not defined`; keeps interpreter blocks short for small budgets).",
            "choices": list(ERROR_FORMATS),
        },
    )
    max_cell_chars: int | None = field(
        default=None,
        metadata={
            "help": "Longest cell (characters) the interpreter runs; a longer one is refused with `CellTooLong: over "
            "N chars` and does not run. None: no limit."
        },
    )
    rollout_mode: str = field(
        default="async",
        metadata={
            "help": "'async': each completion runs its own generate/execute loop and continues as soon as its own "
            "snippet returns (with vLLM, server or colocate mode; transformers generation and colocate tensor "
            "parallelism use the barrier loop). 'barrier': every turn waits for all sequences and snippets of the "
            "batch.",
            "choices": ["async", "barrier"],
        },
    )
    rollout_concurrency: int = field(
        default=256,
        metadata={"help": "Async rollout: completions in flight at once on each process."},
    )
    vllm_request_timeout_s: float | None = field(
        default=None,
        metadata={
            "help": "Async rollout in vLLM server mode: longest wait, in seconds, for one turn's reply (None: as "
            "long as it takes); a turn past it ends its completion as an engine failure "
            "(`retool/engine_timeout_ratio`)."
        },
    )
    sandbox_backend: str = field(
        default="local",
        metadata={
            "help": "Code execution backend: 'local' (worker pool) or 'remote' (SandboxFusion HTTP API).",
            "choices": list(SANDBOX_BACKENDS),
        },
    )
    sandbox_workers: int | None = field(
        default=None,
        metadata={
            "help": "Local sandbox pool size (default: the CPUs this process may use, divided among the ranks on "
            "this node)."
        },
    )
    sandbox_timeout_s: float = field(default=5.0, metadata={"help": "Wall-clock limit of one code execution."})
    sandbox_memory_mb: int = field(default=1024, metadata={"help": "Address-space limit of a sandbox session."})
    sandbox_allow_root_without_isolation: bool = field(
        default=False,
        metadata={
            "help": "Local sandbox: as root, run code even when bubblewrap does not work (cells then see the "
            "host file system). Off by default: the sandbox refuses and says how to fix it."
        },
    )
    sandbox_url: str | None = field(
        default=None,
        metadata={
            "help": "Base URL of the sandbox service (sandbox_backend='remote'): `retool-trl sandbox-server` or "
            "SandboxFusion; several as a list (YAML) or comma-separated, each session pinned to one."
        },
    )
    sandbox_max_concurrency: int = field(
        default=32, metadata={"help": "Concurrent requests to the remote sandbox service."}
    )
    sandbox_memory_wait_s: float = field(default=600.0, metadata={"help": "Wait for sandbox-server memory, s."})
    system_prompt: str | None = field(
        default="retool",
        metadata={
            "help": "System prompt added to conversational prompts that have none: a shipped name "
            f"({', '.join(SHIPPED_PROMPTS)}), a literal prompt, or 'none'."
        },
    )
    correct_reward: float = field(default=1.0, metadata={"help": "Reward of a correct final \\boxed{} answer."})
    incorrect_reward: float = field(
        default=-1.0, metadata={"help": "Reward of a wrong or missing final \\boxed{} answer."}
    )

    # Stability options (off by default = the ReTool paper's behaviour, except `drop_infra_failures`).
    filter_void_turns: bool = field(
        default=False,
        metadata={
            "help": "SimpleTIR: drop from the loss every completion with a 'void' turn (a finished turn with neither "
            "a complete code block nor a \\boxed{} answer)."
        },
    )
    roc_oversample: int = field(
        default=1,
        metadata={
            "help": "rStar2-Agent's GRPO-RoC: sample this many times num_generations per prompt, then keep "
            "num_generations: correct ones with the fewest tool errors / format problems, wrong ones at random, in "
            "the sampled proportion. 1 disables it. Needs whole groups on each process and an `answer` column."
        },
    )
    dynamic_sampling: bool = field(
        default=False,
        metadata={"help": "DAPO: drop equal-reward groups, sample more."},
    )
    dynamic_sampling_max_rounds: int = field(
        default=3,
        metadata={"help": "Most rollout rounds per batch (dynamic sampling)."},
    )
    dynamic_sampling_min_accuracy: float | None = field(
        default=None,
        metadata={"help": "Dynamic sampling: also drop groups less often right than this."},
    )
    dynamic_sampling_max_accuracy: float | None = field(
        default=None,
        metadata={"help": "Dynamic sampling: also drop groups more often right than this."},
    )
    tool_use_bonus: float = field(
        default=0.0,
        metadata={
            "help": "Reward shaping (verl/slime ReTool recipes): a wrong answer that called code gets this much more "
            "than a wrong answer that did not (adds `retool_trl.rewards.tool_use_shaping`). 0 disables it."
        },
    )
    drop_infra_failures: bool = field(
        default=True,
        metadata={
            "help": "A sandbox failure that is not the snippet's fault (worker lost, service down) is retried once; "
            "if it fails again, drop that completion from the loss and leave it unscored instead of scoring it -1."
        },
    )


# ReTool's options by topic, in the order `retool-trl train --help` lists them.
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "rollout": (
        "max_tool_calls",
        "max_interpreter_output_chars",
        "interpreter_truncation",
        "interpreter_errors",
        "system_prompt",
        "call_format",
        "code_start",
        "code_end",
        "interpreter_start",
        "interpreter_end",
        "rollout_mode",
        "rollout_concurrency",
        "vllm_request_timeout_s",
    ),
    "sandbox": (
        "sandbox_backend",
        "sandbox_workers",
        "sandbox_timeout_s",
        "sandbox_memory_mb",
        "max_cell_chars",
        "sandbox_url",
        "sandbox_max_concurrency",
        "sandbox_memory_wait_s",
        "sandbox_allow_root_without_isolation",
    ),
    "rewards": ("correct_reward", "incorrect_reward", "tool_use_bonus"),
    "stability": (
        "filter_void_turns",
        "roc_oversample",
        "dynamic_sampling",
        "dynamic_sampling_max_rounds",
        "dynamic_sampling_min_accuracy",
        "dynamic_sampling_max_accuracy",
        "drop_infra_failures",
    ),
}

__all__ = ["OPTION_GROUPS", "SANDBOX_BACKENDS", "TRUNCATION_SIDES", "ReToolOptions"]
