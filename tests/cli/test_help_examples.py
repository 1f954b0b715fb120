"""Each command's `--help` example runs (or parses) as written, and every command with an example is covered."""

import json
import re
import shlex
import shutil

import pytest

from helpers.cli_runs import REPO, run_cli
from retool_trl.cli import COMMANDS, main
from retool_trl.models.names import quickstart_model_path

pytestmark = pytest.mark.timeout(300)


# Keeps each example short: the examples train or evaluate for minutes, the test checks that they start and finish.
SHORTER = {
    "eval": ["--max_samples", "2", "--max_completion_length", "24"],
    "train": ["--max_steps", "1", "--max_train_samples", "8", "--per_device_train_batch_size", "8"],
}


def help_examples() -> list[tuple[str, list[str]]]:
    """`(command, argv)` of every `Example: retool-trl ...` in the commands' `--help`."""
    import contextlib
    import io

    found = []
    for name in COMMANDS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([name, "--help"]) == 0
        for match in re.finditer(r"Example: retool-trl (.+)$", out.getvalue(), re.MULTILINE):
            argv = shlex.split(match.group(1))
            assert argv[0] == name, match.group(0)
            found.append((name, argv[1:]))
    return found


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory):
    """`runs/quickstart/` as `retool-trl quickstart --output-dir runs/quickstart` leaves it (the trained models in
    `RUN/model/`), with the shipped model standing for the trained one."""
    work = tmp_path_factory.mktemp("user")
    for run in ("tool_rl", "text_rl"):
        shutil.copytree(quickstart_model_path(), work / "runs" / "quickstart" / run / "model")
    return work


def test_every_command_with_an_example_is_covered():
    """The examples below are those the helps show: a new example gets run here too."""
    examples = help_examples()
    assert {name for name, _ in examples} == {"eval", "train", "sft"}, examples


def test_eval_help_example_runs_as_written(quickstart_runs):
    """A new user after the quickstart types the example of `retool-trl eval --help`: `--model
    runs/quickstart/tool_rl` is the run folder, whose model is in `model/`. It failed with "cannot load the tokenizer"
    and did not say where the model was; the run folder's model is used now, and the run says so."""
    [argv] = [argv for name, argv in help_examples() if name == "eval"]
    done = run_cli("eval", *argv, *SHORTER["eval"], "--output_dir", "evaluated", cwd=quickstart_runs)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "is a run folder: using its model" in done.stderr and "tool_rl/model" in done.stderr
    results = json.loads((quickstart_runs / "evaluated" / "results.json").read_text())
    assert results["num_problems"] == 2 and results["num_samples"] == 4, results.keys()
    # The isolation the evaluation's code ran under: said once at its start, recorded next to the results.
    said = [line for line in done.stderr.splitlines() if "sandbox: isolation level" in line]
    assert len(said) == 1, done.stderr[-3000:]
    recorded = json.loads((quickstart_runs / "evaluated" / "isolation.json").read_text())
    assert said[0].split("sandbox: ", 1)[1].startswith(recorded["summary"]) and recorded["isolation"] in said[0]
    assert "isolation.json" in said[0]


def test_train_help_example_runs_as_written(tmp_path, monkeypatch):
    """`retool-trl train --help`'s example, from a clone's root, shortened to one step: the config is found, its
    model alias and dataset resolve, one GRPO step runs. The isolation is said once and recorded in the run folder."""
    [argv] = [argv for name, argv in help_examples() if name == "train"]
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    assert main(["train", *argv, *SHORTER["train"], "--output_dir", str(out), "--report_to", "none"]) == 0
    assert (out / "model" / "config.json").is_file() or (out / "config.json").is_file()
    recorded = json.loads((out / "isolation.json").read_text())
    assert recorded["isolation"] in ("bwrap", "landlock", "none") and recorded["summary"].startswith("isolation level")


def test_sft_help_example_parses_as_written(monkeypatch):
    """`retool-trl sft --help`'s example trains a 7B model on the hub's traces (a GPU's work): here, from a clone's
    root, its config file is found and every key in it is an option `sft` accepts (on a machine without a GPU with
    the two options the one-line error asks for there)."""
    import torch

    from retool_trl.cli.sft import parse_sft_args

    [argv] = [argv for name, argv in help_examples() if name == "sft"]
    monkeypatch.chdir(REPO)
    on_cpu = [] if torch.cuda.is_available() else ["--bf16", "false", "--use_cpu", "true"]
    script_args, sft_args, model_args = parse_sft_args([*argv, *on_cpu])
    assert model_args.model_name_or_path and script_args.dataset_name
