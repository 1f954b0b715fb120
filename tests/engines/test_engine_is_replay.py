"""Sampling-mask replay on a real vLLM engine (vLLM's CPU build, colocated and served): with the same weights on both
sides (step 0), the importance-sampling ratio of truncated sampling is 1 with the replay, and the kept mass without.

Run by `bash scripts/test_engines.sh` in `.venv-engines/`; skipped where vLLM is not installed (the fast suite). The
measurement is the one `scripts/experiments/is_replay.py` records for docs/vllm.md.
"""

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "experiments"))
from is_replay import SETTINGS, build_trainer, measure  # noqa: E402

from helpers.engine_helpers import VLLMServer  # noqa: E402
from retool_trl.quickstart import model_path  # noqa: E402
from retool_trl.sandbox import LocalSandbox  # noqa: E402
from retool_trl.training.sampling_mask import replay_for  # noqa: E402


@pytest.fixture(scope="module")
def replay_trainer(tmp_path_factory):
    with LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox:
        yield build_trainer(tmp_path_factory.mktemp("is_replay"), sandbox)


@pytest.fixture(scope="module")
def served_replay_trainer(tmp_path_factory):
    from trl.generation.vllm_client import VLLMClient

    server = VLLMServer(model_path())
    try:
        with LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox, pytest.MonkeyPatch.context() as patch:
            # TRL's server-mode weight sync opens an NCCL group at init; NCCL needs CUDA. The server serves the
            # checkpoint the trainer starts from: the same weights at step 0.
            patch.setattr(VLLMClient, "init_communicator", lambda self, device=None: None)
            yield build_trainer(tmp_path_factory.mktemp("is_replay_server"), sandbox, server_url=server.base_url)
    finally:
        server.stop()


SETTING_PARAMS = pytest.mark.parametrize(
    ("top_k", "top_p"), [(k, p) for _, k, p in SETTINGS], ids=[n for n, _, _ in SETTINGS]
)


@SETTING_PARAMS
def test_step_zero_ratio_is_one_with_replay_and_the_kept_mass_without(replay_trainer, top_k, top_p):
    assert_replay_corrects(replay_trainer, top_k, top_p)


@SETTING_PARAMS
def test_step_zero_ratio_through_the_server(served_replay_trainer, top_k, top_p):
    """Server mode: the kept sets come from the server's top log-probs (`/v1/completions`, token ids as keys)."""
    assert_replay_corrects(served_replay_trainer, top_k, top_p)


@SETTING_PARAMS
@pytest.mark.parametrize("engine", ["colocate", "server"])
def test_step_zero_ratio_in_the_barrier_rollout(replay_trainer, served_replay_trainer, engine, top_k, top_p):
    """The barrier rollout: TRL's batched `generate` returns the top log-probs the kept sets are read from."""
    trainer_and_rows = replay_trainer if engine == "colocate" else served_replay_trainer
    assert_replay_corrects(trainer_and_rows, top_k, top_p, rollout_mode="barrier")


def assert_replay_corrects(trainer_and_rows, top_k, top_p, rollout_mode="async"):
    trainer, rows = trainer_and_rows
    with_replay = measure(trainer, rows, top_k, top_p, replay=True, rollout_mode=rollout_mode)
    without = measure(trainer, rows, top_k, top_p, replay=False, rollout_mode=rollout_mode)
    assert with_replay["kept_set_source"] in ("engine", "logprobs")
    assert with_replay["ratio_mean"] == pytest.approx(1.0, abs=0.05), with_replay
    # TRL's own ratio is the one the loss multiplies by: the same tokens, the same figure.
    assert with_replay["trl_ratio_mean"] == pytest.approx(with_replay["ratio_mean"], abs=1e-4)
    # Without replay the ratio is the kept mass: clearly below the replayed one (by 0.07-0.08 in these settings; the
    # margin asked is half that, so sampling noise cannot flip it), and off the band more often.
    assert without["ratio_mean"] < with_replay["ratio_mean"] - 0.035, (without, with_replay)
    assert without["outside_0.9_1.1"] > with_replay["outside_0.9_1.1"]


def test_a_training_step_logs_the_share_outside_the_band(replay_trainer):
    trainer, _ = replay_trainer
    # Back to the settings it was built with (the test above switched them): top_k=8, replay on.
    trainer.vllm_generation.top_k, trainer.vllm_generation.top_p = 8, 1.0
    trainer.args.top_k, trainer.args.top_p, trainer.args.rollout_mode = 8, 1.0, "async"
    trainer._replay = replay_for(trainer.args, trainer.vllm_generation)
    trainer._metrics["train"].clear()  # the measurements above logged into the same step's metrics
    trainer.train()
    [entry] = [h for h in trainer.state.log_history if "loss" in h]
    assert 0.0 <= entry["retool/is/outside_0.9_1.1"] < 0.1
    assert entry["retool/is/ratio_mean"] == pytest.approx(1.0, abs=0.05)
