"""What a new user meets first: `--help`, name typos, the Python API on a CPU machine, and the packaging."""

import dataclasses
import json
import re
import subprocess
import sys
import warnings
from importlib.metadata import metadata
from pathlib import Path

import pytest
import tomllib
import yaml

from retool_trl.cli import main
from retool_trl.options import OPTION_GROUPS, ReToolOptions

REPO = Path(__file__).resolve().parents[2]


def option_blocks(text: str) -> dict[str, str]:
    """`--option` -> its help text, from argparse's layout (an option starts a line indented by two spaces)."""
    blocks, current = {}, None
    for line in text.splitlines():
        match = re.match(r"^  (-\w, )?(--[\w-]+)", line)
        if match:
            current = match.group(2)
            blocks[current] = line
        elif current and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


# ----------------------------------------------------------------------------------------------------- --help
def test_train_help_is_short_grouped_and_config_first(capsys):
    """A person reading `retool-trl train --help` in a terminal: --config first, ReTool's options by topic, each
    with one default, and a pointer to the full list (TRL's parser prints ~1,500 lines)."""
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) < 150, len(lines)
    blocks = option_blocks(out)
    assert next(iter(blocks)) == "--config"
    headings = [line[:-1] for line in lines if re.match(r"^[a-z].*:$", line)]
    order = ["config", "model and data", "rollout", "sandbox", "rewards"]
    assert [h for h in headings if h in order] == order and headings[5].startswith("stability"), headings
    for name in (f.name for f in dataclasses.fields(ReToolOptions)):
        assert len(re.findall(rf"^  --{name}\b", out, re.MULTILINE)) == 1, name
    for option, text in blocks.items():
        assert text.lower().count("default") <= 1, (option, text)
    assert "(default: 8)" in blocks["--max_tool_calls"] and "(default: None)" not in out
    assert "--help-all" in lines[-5] + lines[-4] and "--learning_rate" in out


def test_every_retool_option_is_in_a_help_group():
    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(ReToolOptions))


@pytest.mark.parametrize("command", ["train", "sft"])
def test_short_help_does_not_load_the_training_stack(command):
    """`--help` should answer at once: it must not import torch or TRL's trainers (seconds and ~450 MB)."""
    heavy = ("torch", "transformers.training_args", "trl.trainer.grpo_config", "trl.trainer.sft_config")
    code = (
        f"import sys; from retool_trl.cli import main; rc = main([{command!r}, '--help']); "
        f"print(rc, sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 []"


def test_help_all_lists_every_option_config_first_one_default(capsys):
    assert main(["train", "--help-all"]) == 0
    out = capsys.readouterr().out
    blocks = option_blocks(out[out.index("\noptions:") :])
    assert list(blocks)[:2] == ["--help", "--config"]
    for option in ("--adam_beta1", "--lora_r", "--num_generations", "--max_tool_calls", "--roc_oversample"):
        assert option in blocks, option
    twice = {o: t for o, t in blocks.items() if len(re.findall(r"\(default", t)) > 1}
    assert not twice, twice


# ----------------------------------------------------------------------------------------------------- names
@pytest.fixture
def no_hub(monkeypatch):
    """Stands for a machine without network access: any hub or tokenizer load fails the test."""
    import datasets
    import huggingface_hub
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the hub (or a model/tokenizer load) was reached before the name was checked")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets, "load_dataset", refuse)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def quickstart_yaml(tmp_path, **overrides) -> str:
    values = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    values.update(output_dir=str(tmp_path / "out"), **overrides)
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def one_error_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "override, fragments",
    [
        ({"dataset_name": "gsm8kk"}, ["unknown dataset 'gsm8kk'", "did you mean 'gsm8k'?"]),
        ({"dataset_name": "dapo-mat"}, ["did you mean 'dapo_math'?"]),
        ({"dataset_name": "./no/problems.jsonl"}, ["'./no/problems.jsonl' does not exist"]),
        ({"model_name_or_path": "quickstrt"}, ["unknown model 'quickstrt'", "did you mean 'quickstart'?"]),
        (
            {"model_name_or_path": "no such model"},
            ["'no such model' is not a local file or folder", "./no such model"],
        ),
        ({"model_name_or_path": "runs/x/model"}, ["model folder 'runs/x/model' does not exist"]),
    ],
)
def test_names_are_checked_offline_before_any_hub_call(override, fragments, tmp_path, capsys, no_hub):
    """Typos in a model or dataset name fail in one line at once, with a hint, instead of after a minute of hub
    retries (the real condition: a machine without network access, or a slow hub)."""
    err = one_error_line(capsys, ["train", "--config", quickstart_yaml(tmp_path), *_cli(override)])
    for fragment in fragments:
        assert fragment in err, err


def _cli(override: dict) -> list[str]:
    return [item for key, value in override.items() for item in (f"--{key}", value)]


def test_eval_checks_names_too(tmp_path, capsys, no_hub):
    err = one_error_line(capsys, ["eval", "--model", "quickstart", "--dataset", "aime2024"])
    assert "did you mean 'aime_2024'" in err


# ----------------------------------------------------------------------------------------------------- Python API
def test_retool_config_works_on_cpu_as_written(tmp_path):
    """The README's `ReToolConfig(output_dir=...)` on a machine without a bf16 GPU: TRL's bf16 default must not
    make transformers refuse it, and TRL's own defaults must not trigger deprecation warnings."""
    from retool_trl import ReToolConfig
    from retool_trl.config import _bf16_supported

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = ReToolConfig(output_dir=str(tmp_path), max_tool_calls=4)
    assert config.bf16 is _bf16_supported()
    assert ReToolConfig(str(tmp_path)).output_dir == str(tmp_path)  # positional output_dir, as TrainingArguments
    if not _bf16_supported():
        with pytest.raises(ValueError, match="bf16"):  # an explicit choice is still the user's
            ReToolConfig(output_dir=str(tmp_path), bf16=True)


def quickstart_rows(conversational: bool, n: int = 8):
    from datasets import Dataset

    question = "What is 12*34?\n"
    prompt = [{"role": "user", "content": question}] if conversational else question
    return Dataset.from_list([{"prompt": prompt, "answer": "408"}] * n)


def small_config(tmp_path):
    from retool_trl import ReToolConfig

    return ReToolConfig(
        output_dir=str(tmp_path),
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=16,
        system_prompt="none",
        report_to="none",
        sandbox_workers=1,
    )


def test_quickstart_alias_in_python(tmp_path):
    """`ReToolTrainer("quickstart", ...)` as the CLI's `model_name_or_path: quickstart`, with the model's own
    character-level tokenizer (TRL's AutoProcessor would swap in Qwen2's, which drops whitespace)."""
    from retool_trl import ReToolTrainer, quickstart_model_path

    trainer = ReToolTrainer("quickstart", args=small_config(tmp_path), train_dataset=quickstart_rows(False))
    assert trainer.model.config._name_or_path == quickstart_model_path()
    text = "x = 6 *  7\nprint(x)"
    tok = trainer.processing_class
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_conversations_without_chat_template_fail_when_the_trainer_is_built(tmp_path):
    """The quickstart model has no chat template; conversational prompts must fail at construction, naming
    prompt_format, not inside TRL at the first step."""
    from retool_trl import ReToolTrainer
    from retool_trl.errors import UserError

    with pytest.raises(UserError, match="no chat template.*prompt_format='plain'"):
        ReToolTrainer("quickstart", args=small_config(tmp_path), train_dataset=quickstart_rows(True))


# ----------------------------------------------------------------------------------------------------- packaging
def test_math_verify_extra_is_one_the_package_declares():
    """pip warns `math-verify 0.9.0 does not provide the extra 'antlr4_13_2'` when the requested spelling differs
    from the declared one: the requirement must name an extra exactly as math-verify's metadata spells it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirement = next(r for r in project["dependencies"] if r.startswith("math-verify"))
    extras = re.search(r"\[(.*?)\]", requirement).group(1).split(",")
    declared = set(metadata("math-verify").get_all("Provides-Extra"))
    assert {e.strip() for e in extras} <= declared, (extras, declared)


def test_run_outputs_of_shipped_configs_are_git_ignored():
    """Running a shipped config or command from a clone must not leave untracked run folders in `git status`."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    folders = [yaml.safe_load(p.read_text()).get("output_dir") for p in (REPO / "configs").glob("*.yaml")]
    folders += ["retool_quickstart", "eval_results"]  # `retool-trl quickstart` and `retool-trl eval` defaults
    paths = [f"{folder}/trainer_state.json" for folder in folders if folder]
    done = subprocess.run(["git", "check-ignore", *paths], capture_output=True, text=True, cwd=REPO)
    assert sorted(done.stdout.split()) == sorted(paths), json.dumps(paths)


def test_help_into_a_closed_pipe_is_quiet():
    """`retool-trl train --help | head -3`: the reader leaves early; no traceback on the terminal."""
    process = subprocess.Popen(
        [sys.executable, "-m", "retool_trl", "train", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    process.stdout.close()  # the reader is gone before the help is written: every write fails
    err = process.stderr.read()
    assert process.wait(timeout=120) == 0 and "Traceback" not in err, err


def test_legacy_hub_ids_without_an_organisation_are_accepted():
    """`gpt2`, `distilgpt2`: hub ids transformers and TRL accept; only near misses of shipped names are refused."""
    from retool_trl.errors import UserError
    from retool_trl.models.names import resolve_model

    assert resolve_model("gpt2") == "gpt2" and resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    with pytest.raises(UserError, match="did you mean 'quickstart'"):
        resolve_model("quickstrt")
