"""Collectives checked the way NCCL checks them, on a machine whose only device is the CPU.

On a GPU run (`accelerate launch`: DDP, ZeRO-3, FSDP) the process's device is `cuda:N` and a tensor built without
`device=` lives on the host. NCCL refuses such an input ("Tensors must be CUDA and dense"); gloo, which the CPU tests
use, accepts it. So a CPU test of a collective cannot tell `torch.tensor(x)` from `torch.tensor(x, device=device)`
unless something remembers where each tensor would have lived on a GPU. This module does:

- `HostTensor` marks a tensor that would be on the host under CUDA: one made by a factory (`torch.tensor`,
  `torch.zeros`, ...) without a device, one from `torch.from_numpy`, one moved with `.cpu()`, and whatever is
  computed from host tensors only. Moving it with `.to(device)` or `.to(other_tensor)` makes it an ordinary tensor
  again, as it would land on the process's GPU. (What it cannot see: an explicit `device="cpu"`, which is the
  process's device here; a GPU run would also refuse that one.)
- `nccl_faithful()` marks such tensors while it is active, and makes every tensor collective of `torch.distributed`
  (and `check_collective_input`, for code that calls a gather in one process) raise NCCL's error for a host input.

Use it around the part of a run whose collectives are under test (after the model is built: parameters made under it
would be marked too, as if the model had never been moved to the GPU).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

# Functions that allocate a new tensor and take `device=`; without it the tensor is made on the host.
_FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
}
# Tensor collectives of torch.distributed: every tensor argument must be on the process's device under NCCL.
_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
)


class HostTensor(torch.Tensor):
    """A tensor that a CUDA run would hold on the host (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch.Tensor.cpu:
            return _as(out, host=True)
        if func is torch.Tensor.to and _moves_to_device(args[1:], kwargs):
            return _as(out, host=False)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        # Host only if every input was: a GPU op mixing a host tensor with a device tensor runs on the device.
        return _as(out, host=all(isinstance(t, HostTensor) for t in tensors))


def _moves_to_device(args, kwargs) -> bool:
    if "device" in kwargs or isinstance(kwargs.get("other"), torch.Tensor):
        return True
    return any(isinstance(a, (torch.device, str, int, torch.Tensor)) for a in args)


def _as(out, host: bool):
    def convert(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
            return t
        if host:
            return t if isinstance(t, HostTensor) else t.as_subclass(HostTensor)
        return t.as_subclass(torch.Tensor) if isinstance(t, HostTensor) else t

    return tree_map(convert, out)


class _MarkHostTensors(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (func in _FACTORIES and kwargs.get("device") is None) or func in (torch.from_numpy, torch.Tensor.cpu):
            return _as(out, host=True)
        return out


class HostTensorInCollective(RuntimeError):
    """What NCCL raises for a host tensor (the message names the fix as well)."""


def check_collective_input(name: str, value) -> None:
    """Raises `HostTensorInCollective` if any tensor in `value` would be on the host under CUDA."""
    for t in tree_flatten(value)[0]:
        if isinstance(t, HostTensor):
            raise HostTensorInCollective(
                f"{name}: Tensors must be CUDA and dense (NCCL would refuse this input: a tensor of shape "
                f"{tuple(t.shape)} was built on the host; create it with device=accelerator.device)"
            )


def _strict(name, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        check_collective_input(f"torch.distributed.{name}", (args, kwargs))
        return original(*args, **kwargs)

    return collective


@contextlib.contextmanager
def nccl_faithful():
    """Marks host tensors and makes `torch.distributed`'s tensor collectives refuse them, as NCCL does."""
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name, original in saved.items():
        setattr(dist, name, _strict(name, original))
    try:
        with _MarkHostTensors():
            yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
