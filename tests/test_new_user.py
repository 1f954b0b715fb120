"""The product as a new user meets it after the quickstart: the examples of each command's `--help` run as written,
an output folder that cannot be written stops a command before any work (and never loses a finished evaluation), a
hub model without hub access fails in seconds, and every command that runs code says which isolation holds and
records it in its run folder."""

import errno
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from retool_trl.cli import COMMANDS, main
from retool_trl.models.names import quickstart_model_path

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
# A folder no one may write, root included: sysfs refuses new entries (EPERM on a host, EROFS in a container, EACCES
# for a normal user), as a read-only mount or another user's folder does.
UNWRITABLE = "/sys/retool-new-user-test"
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


def run_cli(*args, cwd=REPO, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "retool_trl", *args], capture_output=True, text=True, timeout=280, env=env, cwd=cwd
    )


def one_error_line(done: subprocess.CompletedProcess, command: str) -> str:
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"retool-trl {command}: error:")]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
    return errors[0]


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


def test_a_folder_without_a_model_says_where_the_model_should_be(tmp_path):
    """`--model` naming a folder that holds no model (a run folder that did not finish, a typo one level up): one
    line saying what the folder lacks, before anything is loaded."""
    (tmp_path / "run").mkdir()
    line = one_error_line(run_cli("eval", "--model", str(tmp_path / "run"), "--dataset", "synthetic"), "eval")
    assert "without a model" in line and "config.json" in line and "model/" in line


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


# ------------------------------------------------------------------------------------------------- no hub access
def test_a_hub_model_without_hub_access_fails_in_seconds(tmp_path):
    """A hub id on a machine that cannot reach the hub (offline, a firewall): `train` took 50 s and 22 retry lines
    before its error. Now, the model not being in the cache, one line says the hub cannot be reached, in seconds."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    started = time.monotonic()
    done = run_cli(
        *("train", "--config", "configs/quickstart.yaml", "--model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct"),
        *("--output_dir", str(tmp_path / "out")),
        env=env,
    )
    elapsed = time.monotonic() - started
    line = one_error_line(done, "train")
    assert "not in the local Hugging Face cache" in line and "cannot be reached" in line
    assert "http://127.0.0.1:9" in line
    assert elapsed < 30, elapsed  # the interpreter and TRL's imports included; the hub's retries took 50 s
    assert done.stderr.count("\n") <= 3, done.stderr


def test_offline_mode_with_an_uncached_hub_model_says_so(tmp_path):
    """`HF_HUB_OFFLINE=1` (a cluster's compute nodes) and a hub id that was never downloaded: one line naming both."""
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = run_cli("eval", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--dataset", "synthetic", env=env)
    assert "HF_HUB_OFFLINE is set" in one_error_line(done, "eval")


# ------------------------------------------------------------------------------------------------ isolation report
NETWORK_PROBE = """
import socket
reached = []
for host in {hosts!r}:
    try:
        socket.create_connection((host, {port}), timeout=2).close()
        reached.append(host)
    except OSError:
        pass
print(reached)
"""


def _host_addresses() -> list[str]:
    """127.0.0.1 and this machine's own outward address (a container's eth0), where there is one."""
    import socket

    hosts = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: picks the interface a route would use
            hosts.append(probe.getsockname()[0])
        except OSError:
            pass
    return hosts


@pytest.mark.parametrize("level", ["auto", "landlock"])
def test_the_isolation_report_has_a_summary_and_its_network_flag_is_true_to_the_cells(level):
    """`isolation_report()` on the level this machine gives (bubblewrap on a host's root, Landlock in a default
    container or for a normal user without user namespaces): one short summary line of what holds and what does not,
    and `network_isolated` says whether a cell can reach a TCP server of the trainer's, tried for real (on Landlock it
    said False although cells cannot open an IP socket)."""
    import socket

    from retool_trl.sandbox import LocalSandbox, UnsafeSandboxError
    from retool_trl.sandbox.host.zygote import SandboxStartError

    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    port, hosts = server.getsockname()[1], _host_addresses()
    try:
        with LocalSandbox(num_workers=1, isolation=level) as sandbox:
            report = sandbox.isolation_report()
            result = sandbox.session().run(NETWORK_PROBE.format(hosts=hosts, port=port))
    except (UnsafeSandboxError, SandboxStartError) as error:
        pytest.skip(f"isolation={level} does not run here ({type(error).__name__})")
    finally:
        server.close()
    summary = report["summary"]
    assert "\n" not in summary and len(summary) < 400, summary
    assert summary.startswith(f"isolation level {report['isolation']}: holds: ")
    assert ("no network" in summary.split("does not hold")[0]) == report["network_isolated"], summary
    assert result.ok, result.output
    reached = eval(result.output.strip())  # noqa: S307 - the cell printed a list literal
    assert report["network_isolated"] == (reached == []), (report["network_isolated"], reached, hosts)


def test_the_landlock_levels_words_for_a_normal_user(monkeypatch):
    """A normal user on the Landlock level (user namespaces blocked) read "sessions then run as uid 0", the words for
    a container's root: the level's list of what does not hold speaks of the user the trainer is."""
    from retool_trl.sandbox.isolation import common
    from retool_trl.sandbox.isolation import landlock as landlock_level

    if landlock_level.landlock_problem():
        pytest.skip("no Landlock on this kernel")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # what a normal user's process sees
    monkeypatch.setattr(common, "may_watch_other_uids", lambda: False)
    worker = str(REPO / "retool_trl" / "sandbox" / "jail" / "worker.py")
    missing = " ".join(landlock_level.launch(worker, False).missing)
    assert "own uid per session" in missing and "uid 0" not in missing and "normal user" in missing


def test_ci_runs_the_readmes_test_command_in_a_default_container():
    """CI's container stage ran only the sandbox's contract tests in a default rootful container, so the README's test
    command could be red there (where most GPU users train) without CI noticing. It now runs that command, the whole
    fast suite, in the container."""
    script = (REPO / "scripts" / "test_containers.sh").read_text().replace("\\\n", " ")
    pytest_args = shlex.split(re.search(r"^PYTEST=\((.*)\)$", script, re.MULTILINE).group(1))
    assert pytest_args[:3] == ["-m", "pytest", "-q"]  # `python -m pytest -q`, as the README says
    [run] = [line for line in script.splitlines() if line.strip().startswith("podman ") and " run " in line]
    after = shlex.split(run.split("--rootfs /:O", 1)[1])
    assert after[:2] == ['"$PY"', '"${PYTEST[@]}"'] or after[:2] == ["$PY", "${PYTEST[@]}"], after
    assert not any(arg.startswith(("tests/", '"${CONTRACT')) or "CONTRACT" in arg for arg in after[2:]), after
    readme = (REPO / "README.md").read_text()
    assert "python -m pytest -q" in readme


def test_a_skip_reason_is_one_short_line():
    """`pytest -rs` as a user reads it: skip reasons repeated the whole list of missing protections (up to 1.8 KB a
    line). A skip whose reason is not one short line now fails its test (`conftest.py`), so every skip names what is
    missing in a line; the level's own report stays where it belongs, in `isolation_report()`."""
    from conftest import skip_reason_problem

    from retool_trl.sandbox import LocalSandbox

    with LocalSandbox(num_workers=1) as sandbox:
        report = sandbox.isolation_report()
    assert skip_reason_problem(f"needs per-session jails; missing here: {report}")  # the old form, a whole report
    assert skip_reason_problem("needs a\nsecond line")
    assert skip_reason_problem(f"needs a pids cgroup (isolation level here: {report['isolation']})") is None
