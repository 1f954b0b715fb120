"""A sandbox that cannot run code stops `retool-trl train`, `eval` and `quickstart` with its own reason on one line and
a non-zero exit, before anything is trained or scored; a run where only some calls fail goes on.

The commands run as a user runs them, in a subprocess: the failures are real (a code execution service that is not
there, reached through the real HTTP client; root in a process without `CAP_SYS_ADMIN`, where the kernel refuses
bubblewrap its namespaces, as in a default Docker container).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.failing_sandboxes import SCRIPTS, DownAfterProbe, closed_port
from helpers.testing_utils import (
    PROBLEMS_ARGS,
    make_char_tokenizer,
    record_rewards,
    save_tiny_model,
    trainer_for,
    write_problems,
)
from retool_trl.sandbox import ExecResult, LocalSandbox
from retool_trl.testing import FakeSandbox
from retool_trl.training.sandbox_health import SandboxUnavailableError

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
TORCHRUN_PATH = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("nosilent")
    save_tiny_model(root / "model", make_char_tokenizer())
    write_problems(root / "problems.jsonl")
    return root


def cli(*args, prefix=(), cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "retool_trl", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
        cwd=cwd,
    )


def assert_one_line_refusal(done: subprocess.CompletedProcess, command: str, *reason: str) -> str:
    """Exit status 2, no traceback, and exactly one `retool-trl COMMAND: error:` line that carries `reason`."""
    errors = [line for line in done.stderr.splitlines() if line.startswith(f"retool-trl {command}: error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(errors) == 1, done.stderr[-3000:]
    for words in reason:
        assert words in errors[0], errors[0]
    assert "All reward functions returned None" not in done.stderr  # no step ran on the failures
    return errors[0]


def train_args(work, out: Path, *extra) -> list[str]:
    return [
        "train",
        "--model_name_or_path",
        str(work / "model"),
        "--dataset_name",
        str(work / "problems.jsonl"),
        *PROBLEMS_ARGS,
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_completion_length",
        "12",
        "--max_steps",
        "2",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--use_cpu",
        "true",
        "--bf16",
        "false",
        *extra,
    ]


def test_train_stops_when_the_code_execution_service_is_down(work, tmp_path):
    """A user trains with `sandbox_backend: remote` and the service is not running (wrong port, not started yet):
    every call fails. Before, the run trained 2 steps on unscored completions and exited 0."""
    url = f"http://127.0.0.1:{closed_port()}"
    done = cli(*train_args(work, tmp_path / "out", "--sandbox_backend", "remote", "--sandbox_url", url))
    assert_one_line_refusal(done, "train", "the sandbox cannot run code", "the code execution service failed", url)
    assert not (tmp_path / "out" / "model.safetensors").exists()  # nothing trained, nothing saved


def test_eval_stops_when_the_code_execution_service_is_down(work, tmp_path):
    """`retool-trl eval` against a service that is down: before, it wrote 0.0% results and exited 0."""
    url = f"http://127.0.0.1:{closed_port()}"
    out = tmp_path / "eval"
    done = cli(
        *("eval", "--model", str(work / "model"), "--dataset", str(work / "problems.jsonl")),
        *PROBLEMS_ARGS,
        *("--max_samples", "2", "--max_completion_length", "12"),
        *("--sandbox_backend", "remote", "--sandbox_url", url, "--output_dir", str(out)),
    )
    assert_one_line_refusal(done, "eval", "evaluation stops", "the code execution service failed")
    assert not (out / "results.json").exists()  # nothing scored


WITHOUT_SYS_ADMIN = ("setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin")
STARTS = "from retool_trl.sandbox import LocalSandbox as L\nwith L(num_workers=1) as sb:\n    sb.session().run('1')"


def test_quickstart_in_a_container_without_namespaces_refuses_in_one_line(tmp_path):
    """Root in a default Docker/Kubernetes container (no CAP_SYS_ADMIN: bubblewrap cannot make namespaces), tried as a
    new user does: before, `retool-trl quickstart` exited 0 at 0.4% with `SandboxError: U ... [469 characters
    elided]` in the completions. Now it stops with the sandbox's refusal, whole, and its fix."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_SYS_ADMIN as a default container does")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    probe = subprocess.run(
        [*WITHOUT_SYS_ADMIN, sys.executable, "-c", STARTS], capture_output=True, text=True, timeout=300, env=env
    )
    if probe.returncode == 0:
        pytest.skip("the local sandbox starts without CAP_SYS_ADMIN on this build: no refusal to report here")
    assert "UnsafeSandboxError" in probe.stderr or "SandboxStartError" in probe.stderr, probe.stderr[-2000:]
    out = tmp_path / "qs"
    done = cli(
        *("quickstart", "--output-dir", str(out), "--max-steps", "1", "--num-eval", "8", "--num-train", "16"),
        prefix=WITHOUT_SYS_ADMIN,
    )
    # The refusal ends with its last fix: the whole message reached the user, not an elided interpreter block.
    line = assert_one_line_refusal(done, "quickstart", "LocalSandbox refuses", "allow_root_without_isolation=True")
    assert "elided" not in line
    assert not (out / "summary.json").exists() and not (out / "tool_rl" / "model").exists()


class HalfDown(FakeSandbox):
    """Fails the cells that print an odd number for its own reasons: some calls of every step are infra errors."""

    def run_many(self, pairs):
        results = super().run_many(pairs)
        return [
            ExecResult("SandboxError: session killed", False, False, 0.0, infra_error=True)
            if code.startswith("print(") and int(code[6:-1]) % 2
            else result
            for (_, code), result in zip(pairs, results)
        ]


def test_a_rollout_where_every_call_failed_stops_training(tmp_path):
    """The sandbox starts, then fails every call of a step (the service went down mid-run): training stops with the
    sandbox's reason before TRL scores the step."""
    trainer = trainer_for(tmp_path, SCRIPTS, DownAfterProbe())
    with pytest.raises(SandboxUnavailableError, match="all 6 sandbox calls of a rollout.*worker pool lost"):
        trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])


@pytest.mark.parametrize("odd", [1, 2])
def test_a_rollout_where_some_calls_failed_still_trains(tmp_path, caplog, odd):
    """Some calls fail for the sandbox's reasons (a session killed by the kernel): the step goes on, those rows are
    unscored, the others scored, and a warning names the reason once more than half of the calls failed."""
    scripts = [f"<code>print({2 * k + 1 if k < odd else 2 * k})</code>\\boxed{{1}}" for k in range(3)] + ["x"]
    trainer = trainer_for(tmp_path, scripts, HalfDown())
    seen = record_rewards(trainer)
    with caplog.at_level("WARNING", logger="retool_trl.training.sandbox_health"):
        trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])
    rewards = seen["rewards"][:, 0].tolist()
    assert [r != r for r in rewards] == [k < odd for k in range(3)] + [False]  # NaN: unscored
    warned = "sandbox calls of a rollout (retries included) failed" in caplog.text
    assert warned == (odd == 2) and (not warned or "session killed" in caplog.text)


def test_a_local_sandbox_that_cannot_start_stops_before_the_first_rollout(tmp_path, monkeypatch):
    """`LocalSandbox` with `isolation="bwrap"` on a host where bubblewrap cannot make its namespaces (a real bwrap
    run without CAP_SYS_ADMIN): the trainer stops before generating, with the sandbox's own words."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run bubblewrap without CAP_SYS_ADMIN")
    import retool_trl.sandbox.isolation.bubblewrap as bubblewrap

    real = bubblewrap.bwrap_usable

    def without_sys_admin(bwrap, network):
        # The same check, run as a process that lacks CAP_SYS_ADMIN (bwrap fails as it does in a container).
        fake = tmp_path / "bwrap"
        fake.write_text(f'#!/bin/sh\nexec {" ".join(WITHOUT_SYS_ADMIN)} {bwrap} "$@"\n')
        fake.chmod(0o755)
        return real(str(fake), network)

    monkeypatch.setattr(bubblewrap, "bwrap_usable", without_sys_admin)
    sandbox = LocalSandbox(num_workers=1, isolation="bwrap")
    trainer = trainer_for(tmp_path, SCRIPTS, sandbox)
    try:
        with pytest.raises(SandboxUnavailableError, match="before its first rollout.*Operation not permitted"):
            trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])
    finally:
        sandbox.close()


RANKS = """
import json, os, sys
import torch.distributed as dist
from datasets import Dataset
from retool_trl import ReToolConfig, ReToolTrainer
from retool_trl.sandbox import ExecResult
from retool_trl.testing import FakeSandbox
from retool_trl.training.sandbox_health import SandboxUnavailableError
from helpers.testing_utils import make_char_tokenizer, save_tiny_model

class Down(FakeSandbox):
    def run_many(self, pairs):
        return [ExecResult("SandboxError: zygote lost on rank 1", False, False, 0.0, infra_error=True) for _ in pairs]

out, rank = sys.argv[1], int(os.environ["RANK"])
tokenizer = make_char_tokenizer()
if rank == 0:
    save_tiny_model(os.path.join(out, "model"), tokenizer)
args = ReToolConfig(
    output_dir=os.path.join(out, "run"), max_steps=2, per_device_train_batch_size=2, num_generations=2,
    max_completion_length=8, report_to="none", bf16=False, use_cpu=True, beta=0.0, save_strategy="no",
    disable_tqdm=True, system_prompt="none",
)
if not dist.is_initialized():  # as TRL's Trainer will: the launcher's env, gloo on CPU
    dist.init_process_group("gloo")
dist.barrier()  # the model is saved
dataset = Dataset.from_list([{"prompt": f"Q{i}:", "answer": "1"} for i in range(4)])
trainer = ReToolTrainer(
    os.path.join(out, "model"), args=args, train_dataset=dataset, processing_class=tokenizer,
    sandbox=Down() if rank == 1 else FakeSandbox(),
)
try:
    trainer.train()
    message = None
except SandboxUnavailableError as error:
    message = str(error)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"message": message, "steps": trainer.state.global_step}, f)
# As PyTorch asks of a script before it exits: left to the interpreter's exit, gloo's threads can abort it (SIGABRT,
# "terminate called without an active exception"), and torchrun reports the run failed after both ranks stopped.
# Both ranks tear down together (a rank that destroyed its group while the other was still in it aborted that one in
# a container run), and the results are written: nothing is left for the interpreter's own teardown to do.
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def test_every_rank_stops_when_one_ranks_sandbox_cannot_run_code(tmp_path):
    """Two trainers on one node (`torchrun --nproc-per-node 2`, gloo), and one rank's sandbox fails every call:
    both stop at the same point, before the first step, the failing rank with its sandbox's reason (no rank is
    left waiting in a collective for the other)."""
    if not TORCHRUN_PATH.exists():
        pytest.skip("torchrun (torch's launcher) is not installed next to this interpreter")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=f"{REPO}:{REPO / 'tests'}", OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    done = subprocess.run(
        [str(TORCHRUN_PATH), "--standalone", "--nproc-per-node=2", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["steps"] for r in ranks] == [0, 0]
    assert "zygote lost on rank 1" in ranks[1]["message"]
    assert "another process's sandbox failed" in ranks[0]["message"]
