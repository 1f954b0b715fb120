"""A Hugging Face Hub model without Hub access: the command fails in seconds and says so, online or offline."""

import time

import pytest

from helpers.cli_runs import one_error_line, run_cli

pytestmark = pytest.mark.timeout(300)


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
