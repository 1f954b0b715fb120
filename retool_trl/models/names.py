"""Model and dataset names, resolved offline before anything asks the Hugging Face Hub.

A name is one of: an alias shipped with the package (`quickstart`, `dapo_math`, `gsm8k`, ...), a local path, or a
hub id (`org/name`, or a legacy one without an organisation such as `gpt2`). What cannot be any of those fails at
once with one line, instead of after a minute of hub retries (`huggingface_hub` retries an unreachable hub 5 times):
a near miss of an alias gets "did you mean", and a path that does not exist is named.

A leaf module (no torch, no TRL): the command line checks every name here before it loads anything.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

from ..errors import UserError

logger = logging.getLogger("retool_trl.models")

ASSETS = Path(__file__).parents[1] / "assets"
# Checkpoints shipped with the package, by the alias `model_name_or_path` / `--model` accept.
MODEL_ALIASES = {
    "quickstart": "quickstart_model",
    "quickstart_multiturn": "multiturn_model",
    "quickstart_emerge": "emerge_model",
    "quickstart_markdown": "markdown_model",
    "quickstart_tool_call": "tool_call_model",
}
# The commands (under scripts/build/, run in order) that rebuild each shipped model. The `tool_call` model's cold
# start ran in stages, each continuing the last on new traces (`build_info.json` records them): its copying of digits
# across the template's long system turn came only after the first stage had been judged too short.
_TOOL_CALL_STAGE = "build_quickstart_model.py --call-format tool_call --init-from retool_trl/assets/tool_call_model"
MODEL_BUILDS = {
    "quickstart": ("build_quickstart_model.py",),
    "quickstart_multiturn": ("build_multiturn_model.py",),
    "quickstart_emerge": ("build_emerge_model.py",),
    "quickstart_markdown": ("build_quickstart_model.py --call-format markdown",),
    "quickstart_tool_call": (
        "build_quickstart_model.py --call-format tool_call --num-traces 9600 --max-steps 600 --learning-rate 2e-3",
        f"{_TOOL_CALL_STAGE} --seed 1 --num-traces 22400 --max-steps 1400 --learning-rate 1e-3",
        f"{_TOOL_CALL_STAGE} --seed 2 --num-traces 16000 --max-steps 1000 --learning-rate 5e-4",
    ),
}
# `org/name` with the characters the Hub allows (a legacy id without `org/` is refused: see `check_hub_id`).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".safetensors", ".bin", ".yaml", ".yml")


def quickstart_model_path(name: str = "quickstart") -> str:
    """Folder of a checkpoint shipped with the package: `quickstart` (the CPU quickstart's tiny model),
    `quickstart_multiturn`, `quickstart_emerge`, `quickstart_markdown` or `quickstart_tool_call`. The same aliases
    work as `model_name_or_path` on the command line
    and as the `model` of [`~retool_trl.ReToolTrainer`].

    Raises:
        UserError: an unknown alias, or a shipped checkpoint missing from this installation.
    """
    if name not in MODEL_ALIASES:
        raise UserError(f"unknown shipped model {name!r}: expected one of {', '.join(MODEL_ALIASES)}.")
    folder = ASSETS / MODEL_ALIASES[name]
    if not (folder / "config.json").is_file():
        raise UserError(
            f"the {name} model is missing from {folder}; rebuild it with "
            + ", then ".join(f"`python scripts/build/{command}`" for command in MODEL_BUILDS[name])
            + "."
        )
    return str(folder)


def looks_local(name: str) -> bool:
    """Whether `name` is written as a path (`./x`, `/x`, `~/x`, `a/b/c`, `x.jsonl`) rather than a hub id or alias."""
    return (
        name.startswith((".", "/", "~"))
        or os.path.isabs(name)
        or name.count("/") > 1
        or "\\" in name
        or name.lower().endswith(_LOCAL_SUFFIXES)
    )


def _near(name: str, known: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(name.strip().lower().replace("-", "_"), list(known), n=1, cutoff=0.75)
    return close[0] if close else None


def check_hub_id(
    name: str, what: str, option: str, known: Iterable[str] = (), path_noun: str | None = None, error=UserError
) -> None:
    """Fails at once on a `name` that is neither a local path nor a plausible hub id, before any hub call.

    Args:
        name (`str`): The model or dataset as given.
        what (`str`): `"model"` or `"dataset"`, for messages.
        option (`str`): The option that set it, for messages.
        known (`Iterable[str]`): The aliases of that kind, for "did you mean".
        path_noun (`str`, *optional*): What a local path is called in messages (default: `what`).
        error (`type`): The `UserError` subclass to raise.

    Raises:
        UserError: a near miss of an alias, a local-looking path that does not exist, or a bare word.
    """
    known = list(known)
    listed = f" ({', '.join(known)})" if known else ""
    if os.path.exists(os.path.expanduser(name)):
        return
    if looks_local(name):
        raise error(f"{path_noun or what} {name!r} does not exist; check {option}.")
    if _HUB_ID.match(name):
        return
    close = _near(name, known)
    if close:
        raise error(f"unknown {what} {name!r}: did you mean {close!r}? Check {option}.")
    if not re.match(r"^[A-Za-z0-9][\w.-]*$", name):
        raise error(
            f"{what} {name!r} is not a local file or folder, a known name{listed}, or a hub id; check {option} "
            f"(write a local folder as ./{name})."
        )
    # A bare word: a hub id without an organisation (`gpt2`, `distilgpt2`), which transformers and TRL accept.


def resolve_model(name: str | None, option: str = "model_name_or_path") -> str:
    """A model folder or hub id for `name`: a shipped alias becomes its folder, `~` is expanded, and names that
    cannot be a model fail here (see [`check_hub_id`]).

    Raises:
        UserError: no name, or one that cannot be a model.
    """
    if not name:
        raise UserError(f"no model given: set `{option}` in the config or pass --{option}.")
    if name in MODEL_ALIASES:
        return quickstart_model_path(name)
    check_hub_id(name, "model", option, MODEL_ALIASES, path_noun="model folder")
    path = os.path.expanduser(name)
    return _model_folder(path, option) if os.path.isdir(path) else path


def _model_folder(path: str, option: str) -> str:
    """`path`, or the `model/` inside a run folder (`retool-trl train`'s and the quickstart's runs keep it there)."""
    if any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        return path
    inner = os.path.join(path, "model")
    if os.path.isfile(os.path.join(inner, "config.json")) or os.path.isfile(
        os.path.join(inner, "adapter_config.json")
    ):
        logger.info("%s %s is a run folder: using its model, %s", option, path, inner)
        return inner
    raise UserError(
        f"{option} {path!r} is a folder without a model (no config.json, and no model/ folder with one); pass the "
        "folder that holds config.json (a run folder's model/, or a checkpoint-N/ inside it)."
    )


# Seconds to wait for the hub before saying it cannot be reached (huggingface_hub itself retries for about a minute).
HUB_PROBE_TIMEOUT_S = 5.0


def check_hub_reachable(repo_id: str, option: str) -> None:
    """A hub model that is not in the local cache needs the hub: when the hub cannot be reached (offline, a firewall,
    `HF_HUB_OFFLINE=1`), fails in seconds with one line instead of after a minute of retries."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        return
    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # cached: transformers loads it from there even when the hub is down
    if constants.HF_HUB_OFFLINE:
        raise UserError(
            f"{option} {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it "
            "where the hub is reachable, or pass a local model folder."
        )
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S)
    except urllib.error.HTTPError:
        return  # the hub answered (any status): it is reachable
    except (OSError, ValueError) as error:
        why = " ".join(str(getattr(error, "reason", error)).split())
        raise UserError(
            f"{option} {repo_id!r} is not in the local Hugging Face cache and the hub ({constants.ENDPOINT}) cannot "
            f"be reached ({why}); connect to it, set HF_ENDPOINT to a mirror, or pass a local model folder."
        ) from None


__all__ = [
    "MODEL_ALIASES",
    "check_hub_id",
    "check_hub_reachable",
    "looks_local",
    "quickstart_model_path",
    "resolve_model",
]
