"""The colocated barrier engine under tensor parallelism: padding rows decode one token, and a group whose rows are
done stops without waiting for the world."""

from __future__ import annotations

import types

from helpers.scripted_turns import EOS, TOKENIZER, ids_of


# --------------------------------------------------------------- colocated tensor-parallel barrier: padding
class FakeSamplingParams:
    """vLLM's `SamplingParams` as TRL builds it (keyword fields, `clone`)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def clone(self):
        return FakeSamplingParams(**self.__dict__)


class RecordingLLM:
    """A colocated engine that writes `ab` then EOS for every prompt, within each prompt's `max_tokens`, and
    records the tokens it decoded per prompt."""

    def __init__(self):
        self.decoded = []

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        outputs, script = [], ids_of("ab") + [EOS]
        for prompt, p in zip(prompts, params, strict=True):
            ids = script[: p.max_tokens] if prompt["prompt_token_ids"] != [EOS] else [7] * p.max_tokens
            self.decoded.append(len(ids))
            outputs.append(
                types.SimpleNamespace(
                    prompt_token_ids=prompt["prompt_token_ids"],
                    outputs=[types.SimpleNamespace(token_ids=ids, logprobs=None)],
                )
            )
        return outputs


def tp_backend(monkeypatch, partner_rows: int, own_rows_active: bool = True, peft: bool = False, world=None):
    """Rank 0 of a tensor-parallel group of 2 (ranks 0 and 1, of 4), through TRL's own colocate `generate`; the
    group's other rank has `partner_rows` rows; `world` is what the other group (ranks 2, 3) reports."""
    from trl.generation import vllm_generation as trl_vllm

    from retool_trl.rollout.engines.vllm_batched import VLLMBackend

    monkeypatch.setattr(trl_vllm, "SamplingParams", FakeSamplingParams, raising=False)
    partner = [ids_of("Q:")] * partner_rows

    def all_gather_object(out, obj, group=None):
        out[0], out[1] = obj, partner + [[EOS]] * (len(obj) - partner_rows)

    def all_gather(parts, tensor, group=None):  # the group's other rank: its plan, or whether it is active
        parts[0].copy_(tensor)
        plan = [partner_rows, 40 if partner_rows else 0, 0, 0] if tensor.numel() == 4 else [int(partner_rows > 0)]
        parts[1].copy_(torch.tensor(plan, dtype=tensor.dtype))

    import torch

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)

    def gather(tensor):  # the world: this group, then the other group's (still active) ranks
        other = world if world is not None else tensor
        return torch.cat([tensor, tensor, other, other])

    accelerator = types.SimpleNamespace(
        num_processes=4, process_index=0, local_process_index=0, device=torch.device("cpu"), gather=gather
    )
    helper = object.__new__(trl_vllm.VLLMGeneration)
    helper.__dict__.update(
        mode="colocate",
        accelerator=accelerator,
        llm=RecordingLLM(),
        tensor_parallel_size=2,
        tp_group="group 0",
        model=types.SimpleNamespace(peft_config={}) if peft else types.SimpleNamespace(),
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        max_completion_length=40,
        logprobs=None,
        structured_outputs_regex=None,
        generation_kwargs={},
        enable_sleep_mode=False,
    )
    monkeypatch.setattr(trl_vllm, "is_peft_model", lambda model: peft, raising=False)
    return VLLMBackend(helper, TOKENIZER, "</code>", accelerator=accelerator), helper


def test_tensor_parallel_padding_rows_decode_one_token_not_the_whole_budget(monkeypatch):
    """A colocated vLLM engine with `vllm_tensor_parallel_size: 2` in the barrier loop: this rank has 3 rows, the
    other rank of its group 1, so TRL's helper gets 2 padding prompts from it. Before, the padding prompts shared
    the group's `max_tokens` (40) and were decoded in full; now they decode one token, and the real rows are as
    they were."""
    import torch  # noqa: F401 - the fixture patches torch.distributed

    backend, helper = tp_backend(monkeypatch, partner_rows=1)
    outputs = backend.generate_turn([ids_of("Q:")] * 3, [40] * 3, [True] * 3)
    assert [out.token_ids for out in outputs] == [ids_of("ab") + [EOS]] * 3
    decoded = helper.llm.decoded
    assert decoded[:3] == [3, 3, 3] and decoded[3] == 3 and decoded[4:] == [1, 1], decoded


def test_a_tensor_parallel_group_whose_rows_are_done_stops_without_waiting_for_the_world(monkeypatch):
    """Several tensor-parallel groups (4 ranks, groups of 2): this group's rows are all done while the other group
    still generates. Before, "anyone still active" was agreed over the whole world, so this group kept calling
    the engine with padding until the slowest rank anywhere finished; now its own group decides. With PEFT, where
    TRL puts a barrier on every process in each call, the whole world still agrees."""
    import torch

    still = torch.tensor([1])
    backend, _ = tp_backend(monkeypatch, partner_rows=0, world=still)
    assert backend.any_active(False) is False
    backend, _ = tp_backend(monkeypatch, partner_rows=0, world=still, peft=True)
    assert backend.any_active(False) is True
