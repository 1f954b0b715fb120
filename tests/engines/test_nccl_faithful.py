"""Every collective the package makes gets a tensor on the process's device, as NCCL (any multi-GPU run) demands.

gloo, which the CPU tests use between processes, accepts host tensors; NCCL does not. `nccl_harness` remembers which
tensors a GPU run would hold on the host and refuses them in collectives, so these tests fail where a GPU run would
crash. The two-process version of the same check runs in the engine stage (tests/engines/test_engine_multiproc.py).
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist

from helpers.nccl_harness import HostTensorInCollective, check_collective_input, nccl_faithful
from helpers.testing_utils import trainer_for
from retool_trl.rollout import RolloutResult
from retool_trl.testing import FakeSandbox
from retool_trl.training.metrics import rollout_metrics

DEVICE = torch.device("cpu")  # the process's device; under CUDA it would be cuda:N


def test_the_harness_refuses_what_nccl_refuses():
    with nccl_faithful():
        host = torch.tensor([1.0, 2.0])
        on_device = torch.tensor([1.0, 2.0], device=DEVICE)
        for tensor in (host, host * 2, host.reshape(-1, 1), on_device.cpu(), torch.zeros(3)):
            with pytest.raises(HostTensorInCollective, match="Tensors must be CUDA"):
                check_collective_input("gather", tensor)
        for tensor in (on_device, on_device * 2, host.to(DEVICE), host.to(on_device), host * on_device, on_device[0]):
            check_collective_input("gather", tensor)
        # Only under the harness: outside it nothing is marked.
    check_collective_input("gather", torch.tensor([1.0]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_harness_guards_torch_distributed_itself():
    """accelerate's `gather` ends in `torch.distributed.all_gather`: the harness checks it there, on real gloo."""
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with nccl_faithful():
            out = [torch.empty(2, device=DEVICE)]
            dist.all_gather(out, torch.ones(2, device=DEVICE))
            assert out[0].tolist() == [1.0, 1.0]
            with pytest.raises(HostTensorInCollective):
                dist.all_gather(out, torch.ones(2))
            with pytest.raises(HostTensorInCollective):
                dist.all_reduce(torch.tensor([1.0]))
        dist.all_reduce(torch.tensor([1.0]))  # gloo itself accepts it: what the tests could not see before
    finally:
        dist.destroy_process_group()
        os.environ.pop("TORCHELASTIC_RUN_ID", None)


def _result(n: int = 2) -> RolloutResult:
    return RolloutResult(
        completion_ids=[[1, 2, 3]] * n,
        interpreter_mask=[[1, 0, 1]] * n,
        logprobs=None,
        model_text=["x"] * n,
        num_tool_calls=[1] * n,
        num_tool_errors=[0] * n,
        num_tool_timeouts=[0] * n,
        num_infra_errors=[0] * n,
        code_lines=[1] * n,
        num_turns=[2] * n,
        num_void_turns=[0] * n,
        infra_failed=[False] * n,
        exec_seconds=[0.01] * n,
        engine_calls=[2] * n,
    )


def strict_gather(tensor):
    check_collective_input("accelerator.gather", tensor)
    return tensor


def test_rollout_metrics_gather_tensors_on_the_process_device():
    with nccl_faithful():
        metrics = rollout_metrics(_result(), strict_gather, DEVICE)
    assert metrics["retool/calls_per_completion"] == 1.0


def test_every_gather_of_a_training_step_is_on_the_process_device(tmp_path):
    """The trainer's own gathers (loss normaliser, unscored rows, metrics), through a whole rollout and scoring."""
    scripts = ["<code>print(1)</code>\\boxed{1}", "\\boxed{42}", "<code>1/0</code>x", "\\boxed{4}"]
    trainer = trainer_for(tmp_path, scripts, FakeSandbox(), drop_infra_failures=True)
    gathered = []
    original = trainer.accelerator.gather

    def gather(tensor):
        check_collective_input("accelerator.gather", tensor)
        gathered.append(tensor)
        return original(tensor)

    trainer.accelerator.gather = gather
    with nccl_faithful():
        out = trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])
    assert torch.isfinite(out["advantages"]).all()
    assert len(gathered) >= 5  # TRL's and ours: every one of them checked
