"""Folders a command reads or writes: a missing model says where it should be, an unwritable output folder stops the
command before any work, and a finished evaluation is kept when its folder stops taking writes."""

import errno
import json
import re
import shutil
from pathlib import Path

import pytest

from helpers.cli_runs import REPO, one_error_line, run_cli
from retool_trl.cli import main

pytestmark = pytest.mark.timeout(300)


# A folder no one may write, root included: sysfs refuses new entries (EPERM on a host, EROFS in a container, EACCES
# for a normal user), as a read-only mount or another user's folder does.
UNWRITABLE = "/sys/retool-new-user-test"


def test_a_folder_without_a_model_says_where_the_model_should_be(tmp_path):
    """`--model` naming a folder that holds no model (a run folder that did not finish, a typo one level up): one
    line saying what the folder lacks, before anything is loaded."""
    (tmp_path / "run").mkdir()
    line = one_error_line(run_cli("eval", "--model", str(tmp_path / "run"), "--dataset", "synthetic"), "eval")
    assert "without a model" in line and "config.json" in line and "model/" in line


# ------------------------------------------------------------------------------------------ unwritable output folder
@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", "configs/quickstart.yaml", "--output_dir", UNWRITABLE],
        ["sft", "--model_name_or_path", "quickstart", "--dataset_name", "x.jsonl", "--output_dir", UNWRITABLE]
        + ["--bf16", "false", "--use_cpu", "true"],
        ["eval", "--model", "quickstart", "--dataset", "synthetic", "--output_dir", UNWRITABLE],
        ["quickstart", "--output-dir", UNWRITABLE],
    ],
    ids=lambda argv: argv[0],
)
def test_an_unwritable_output_folder_stops_the_command_before_any_work(argv, monkeypatch, capsys):
    """An output folder on a read-only mount or in another user's home: `train` and `eval` ended with a traceback
    (`OSError: [Errno 30]`, `PermissionError`), `eval` only after the whole evaluation. Now one line names the folder
    and the fix, before a tokenizer, a model or a run is loaded."""
    import retool_trl.models.tokenizers as tokenizers
    import retool_trl.quickstart.runner as runner

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the output folder was checked")

    monkeypatch.setattr(tokenizers, "load_tokenizer", no_work)
    monkeypatch.setattr(runner, "run_quickstart", no_work)
    monkeypatch.chdir(REPO)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"retool-trl {argv[0]}: error:"), err
    assert f"'{UNWRITABLE}' cannot be written" in err[0] and "give a folder you can write to" in err[0], err[0]


def test_a_finished_evaluation_is_kept_when_its_folder_stops_taking_writes(tmp_path, monkeypatch, capsys):
    """The output folder was writable when `eval` started and is not when the evaluation ends (a mount gone read-only,
    a full disk): the results are written to a new folder, the one line says where, and the exit status is 2."""
    import retool_trl.evaluation.scoring as scoring

    real = scoring.write_report
    wanted = tmp_path / "out"

    def read_only_there(report, output_dir, name="results"):
        if Path(output_dir) == wanted:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(report, output_dir, name)

    monkeypatch.setattr(scoring, "write_report", read_only_there)
    argv = ["eval", "--model", "quickstart", "--dataset", "synthetic", "--max_samples", "2"]
    assert main([*argv, "--max_completion_length", "24", "--output_dir", str(wanted)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("retool-trl eval: error:")]
    assert len(err) == 1 and "Read-only file system" in err[0], err
    kept = Path(re.search(r"evaluation is in (\S+\.json)", err[0]).group(1))
    assert json.loads(kept.read_text())["num_problems"] == 2
    shutil.rmtree(kept.parent)
