"""Dynamic sampling: groups with nothing to learn are dropped and more prompts are scored in their place."""

import logging

import pytest
import torch

from helpers.dynamic_sampling_worker import METRICS, ByPrompt, group, launch, rows, use_async_loop
from helpers.testing_utils import make_char_tokenizer, trainer_for
from retool_trl import ReToolConfig
from retool_trl.training.dynamic_sampling import concatenate, outside_band, take_rows, uniform_groups

TOKENIZER = make_char_tokenizer()


def sampling_trainer(tmp_path, dataset_kinds, **overrides):
    from datasets import Dataset

    values = dict(per_device_train_batch_size=8, dynamic_sampling=True)
    values.update(overrides)
    trainer = trainer_for(tmp_path, [], dataset=Dataset.from_list(rows(*dataset_kinds)), **values)
    trainer._make_generation_backend = lambda model: ByPrompt(TOKENIZER)
    return trainer


def trained_prompts(output) -> list[str]:
    return [TOKENIZER.decode(ids[mask.bool()]) for ids, mask in zip(output["prompt_ids"], output["prompt_mask"])]


def logged(trainer) -> dict:
    return {name: trainer._metrics["train"][f"retool/dynamic_sampling/{name}"] for name in METRICS}


# ------------------------------------------------------------------------------------------------ the trainer
@pytest.mark.parametrize("loop", ["barrier", "async"])
def test_uniform_groups_are_dropped_and_refilled_from_new_prompts(tmp_path, loop):
    trainer = sampling_trainer(tmp_path, ["hard 1", "hard 2", "hard 3"], rollout_mode=loop)
    if loop == "async":
        use_async_loop(trainer)
    output = trainer._generate_and_score_completions(group("easy") + group("hard 0"))
    prompts = trained_prompts(output)
    assert len(prompts) == 8 and output["completion_ids"].shape[0] == 8 and output["advantages"].shape == (8,)
    assert not any("easy" in p for p in prompts)  # the all-right group left the batch...
    assert sum("hard 0" in p for p in prompts) == 4  # ...the group worth learning from stayed...
    assert {p for p in prompts if "hard 0" not in p} <= {"hard 1:", "hard 2:", "hard 3:"}  # ...new prompts came in
    assert (output["advantages"].abs() > 0.5).all()  # no row of a zero-variance group
    assert logged(trainer) == {"groups_dropped": [1.0], "rounds": [2.0], "zero_std_ratio": [0.0], "capped": [0.0]}
    # The loss normaliser counts the rows trained on, not every row generated.
    kept = (output["completion_mask"] * output["tool_mask"]).sum()
    assert output["num_items_in_batch"].item() == kept.item()


def test_beside_roc_and_the_void_turn_filter(tmp_path):
    """RoC picks each group's rows from twice the samples, the void-turn filter masks void completions out of the
    loss; dynamic sampling then judges the groups RoC kept, and leaves the masks as the filter set them."""
    trainer = sampling_trainer(tmp_path, ["void 1", "void 2"], roc_oversample=2, filter_void_turns=True)
    output = trainer._generate_and_score_completions(group("easy") + group("void 0"))
    prompts = trained_prompts(output)
    assert len(prompts) == 8 and not any("easy" in p for p in prompts)
    assert logged(trainer)["groups_dropped"] == [1.0] and logged(trainer)["capped"] == [0.0]
    texts = [TOKENIZER.decode(ids[m.bool()]) for ids, m in zip(output["completion_ids"], output["completion_mask"])]
    void = torch.tensor(["no idea" in t for t in texts])
    assert void.sum() == 4  # RoC kept half right, half wrong, as sampled
    assert (output["tool_mask"][void] == 0).all() and (output["tool_mask"][~void].sum(dim=1) > 0).all()
    kept = (output["completion_mask"] * output["tool_mask"]).sum()
    assert output["num_items_in_batch"].item() == kept.item()


def test_without_dynamic_sampling_uniform_groups_stay(tmp_path):
    trainer = sampling_trainer(tmp_path, ["hard 1"], dynamic_sampling=False)
    output = trainer._generate_and_score_completions(group("easy") + group("hard 0"))
    assert sum("easy" in p for p in trained_prompts(output)) == 4
    assert not any(k.startswith("retool/dynamic_sampling/") for k in trainer._metrics["train"])


def test_cap_trains_on_what_it_has_and_says_so(tmp_path, caplog):
    trainer = sampling_trainer(tmp_path, ["easy 1", "easy 2"], dynamic_sampling_max_rounds=2)
    with caplog.at_level(logging.WARNING, logger="retool_trl.training.dynamic_sampling"):
        output = trainer._generate_and_score_completions(group("easy 0") + group("easy 1"))
        trainer._generate_and_score_completions(group("easy 0") + group("easy 1"))
    assert output["completion_ids"].shape[0] == 8  # a full batch all the same: nothing better was found
    assert logged(trainer) == {
        "groups_dropped": [4.0, 4.0],
        "rounds": [2.0, 2.0],
        "zero_std_ratio": [1.0, 1.0],
        "capped": [1.0, 1.0],
    }
    warnings = [r for r in caplog.records if "dynamic_sampling_max_rounds" in r.getMessage()]
    assert len(warnings) == 1  # the first capped step only


def test_kept_rows_come_first_on_a_capped_step(tmp_path):
    trainer = sampling_trainer(tmp_path, ["easy 1"], dynamic_sampling_max_rounds=2)
    output = trainer._generate_and_score_completions(group("easy 0") + group("hard 0"))
    prompts = trained_prompts(output)
    assert prompts[:4] == ["hard 0:"] * 4 and logged(trainer)["capped"] == [1.0]
    assert logged(trainer)["zero_std_ratio"] == [0.5]


def test_accuracy_band_drops_groups_outside_it(tmp_path):
    trainer = sampling_trainer(
        tmp_path, ["hard 1", "hard 2"], dynamic_sampling_min_accuracy=0.2, dynamic_sampling_max_accuracy=0.6
    )
    output = trainer._generate_and_score_completions(group("most") + group("hard 0"))
    prompts = trained_prompts(output)
    assert not any("most" in p for p in prompts)  # 3/4 right: varied rewards, but above the band
    assert logged(trainer)["groups_dropped"] == [1.0] and logged(trainer)["rounds"] == [2.0]


def test_training_run_with_steps_per_generation(tmp_path):
    """A short run: two optimizer steps per generation batch, half of the prompts all-right."""
    trainer = sampling_trainer(
        tmp_path,
        ["easy 1", "easy 2", "hard 1", "hard 2"],
        per_device_train_batch_size=4,
        steps_per_generation=2,
        max_steps=4,
        logging_steps=1,
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "retool/dynamic_sampling/rounds" in entry]
    assert len(logs) == 2  # one generation batch per two steps
    assert all(all(f"retool/dynamic_sampling/{name}" in entry for name in METRICS) for entry in logs)
    assert sum(entry["retool/dynamic_sampling/groups_dropped"] for entry in logs) > 0
    for entry in logs:
        if entry["retool/dynamic_sampling/capped"] == 0:
            assert entry["retool/dynamic_sampling/zero_std_ratio"] == 0


@pytest.mark.engine  # several processes: the engine stage runs it (`-m engine`), ~30 s on 2 CPU cores
@pytest.mark.timeout(600)
def test_two_processes_agree(tmp_path):
    """Rank 0 starts from an all-right group, rank 1 from a useful one: the same rounds and metrics on both, a full
    batch of kept rows on each, one loss normaliser; then a short training run with two steps per generation."""
    ranks = launch(tmp_path, 2)
    assert ranks[0]["metrics"] == ranks[1]["metrics"]
    # Round 1 dropped rank 0's two groups; round 2 drew two new groups for each rank.
    assert ranks[0]["metrics"]["groups_dropped"][0] >= 2 and ranks[0]["metrics"]["rounds"][0] >= 2
    assert ranks[0]["metrics"]["zero_std_ratio"] == [0.0] and ranks[0]["metrics"]["capped"] == [0.0]
    for rank in ranks:
        assert len(rank["prompts"]) == 8 and not any("easy" in p for p in rank["prompts"])
        assert all(abs(a) > 0.5 for a in rank["advantages"])
    assert ranks[1]["prompts"][:8].count("hard 0:") == 8  # rank 1's own groups stayed
    total = ranks[0]["kept_tokens"] + ranks[1]["kept_tokens"]
    assert ranks[0]["num_items_in_batch"] == ranks[1]["num_items_in_batch"] == total
    prefix = "retool/dynamic_sampling/"
    logs = [[{k: v for k, v in e.items() if k.startswith(prefix)} for e in rank["logs"]] for rank in ranks]
    assert logs[0] == logs[1] and len(logs[0]) == 1  # one generation batch for the two steps, the same on both


# ------------------------------------------------------------------------------------------------ the parts
def test_uniform_groups_judged_like_trl():
    nan = float("nan")
    rewards = torch.tensor([[1.0, 1, 1, 1], [1, 0, 1, 1], [nan, nan, nan, nan], [nan, 1, nan, nan]]).view(-1, 1)
    assert uniform_groups(rewards, torch.ones(1), 4).tolist() == [True, False, True, True]
    # Two functions that offset each other: the summed reward is flat...
    two = torch.tensor([[1.0, 0], [0, 1], [1, 0], [0, 1]])
    assert uniform_groups(two, torch.ones(2), 4).tolist() == [True]
    # ...but normalised one by one (TRL's normalize_then_sum) each carries signal.
    assert uniform_groups(two, torch.ones(2), 4, "normalize_then_sum").tolist() == [False]


def test_drawn_prompts_are_laid_out_as_trls_sampler_lays_them_out():
    """Each process gets its contiguous slice of whole groups; together they cover each drawn prompt once per
    generation, and every process draws from the same order."""
    from types import SimpleNamespace

    from retool_trl.training.dynamic_sampling import DynamicSampling

    args = SimpleNamespace(
        dynamic_sampling_max_rounds=3, dynamic_sampling_min_accuracy=None, dynamic_sampling_max_accuracy=None, seed=0
    )
    dataset = [{"prompt": f"p{i}"} for i in range(6)]
    drawn = []
    for rank in range(2):
        accelerator = SimpleNamespace(num_processes=2, process_index=rank)
        trainer = SimpleNamespace(
            args=args, num_generations=4, accelerator=accelerator, train_dataset=dataset, shuffle_dataset=True
        )
        sampler = DynamicSampling(trainer)
        drawn.append([[row["prompt"] for row in sampler.draw(6)] for _ in range(4)])  # 3 groups per round
    for batch0, batch1 in zip(*drawn, strict=True):
        rows = batch0 + batch1
        assert [rows[g : g + 4].count(rows[g]) for g in range(0, 12, 4)] == [4, 4, 4]  # whole groups of 4
        assert len({rows[g] for g in range(0, 12, 4)}) == 3  # three prompts
    for first in (0, 2):  # two rounds (6 prompts) make an epoch: each prompt once
        epoch = [row for r in (first, first + 1) for rank in (0, 1) for row in drawn[rank][r]]
        assert sorted(set(epoch)) == [f"p{i}" for i in range(6)] and len(epoch) == 24


def test_outside_band():
    correct = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0], dtype=torch.float32)
    assert outside_band(correct, 4, 0.2, 0.8).tolist() == [True, False, False]
    assert outside_band(correct, 4, None, 0.4).tolist() == [True, False, True]


def test_batches_join_with_each_side_padded():
    first = {
        "prompt_ids": torch.tensor([[5, 6]]),
        "prompt_mask": torch.tensor([[1, 1]]),
        "completion_ids": torch.tensor([[7]]),
        "completion_mask": torch.tensor([[1]]),
        "advantages": torch.tensor([1.0]),
        "num_items_in_batch": torch.tensor(1),
    }
    second = {
        "prompt_ids": torch.tensor([[4, 5, 6]]),
        "prompt_mask": torch.tensor([[1, 1, 1]]),
        "completion_ids": torch.tensor([[7, 8, 9]]),
        "completion_mask": torch.tensor([[1, 1, 1]]),
        "advantages": torch.tensor([-1.0]),
        "num_items_in_batch": torch.tensor(3),
    }
    joined = concatenate([first, second], pad_token_id=0)
    assert joined["prompt_ids"].tolist() == [[0, 5, 6], [4, 5, 6]]  # left
    assert joined["completion_ids"].tolist() == [[7, 0, 0], [7, 8, 9]]  # right
    assert "num_items_in_batch" not in joined
    picked = take_rows(joined, [0])  # padding only the other row needed is cut away
    assert picked["prompt_ids"].tolist() == [[5, 6]] and picked["completion_ids"].tolist() == [[7]]


# ------------------------------------------------------------------------------------------------ the config
@pytest.mark.parametrize(
    "fields, words",
    [
        ({"dynamic_sampling": True, "dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds"),
        ({"dynamic_sampling": True, "dynamic_sampling_min_accuracy": 1.5}, "in [0, 1]"),
        (
            {"dynamic_sampling": True, "dynamic_sampling_min_accuracy": 0.8, "dynamic_sampling_max_accuracy": 0.2},
            "must not be above",
        ),
        ({"dynamic_sampling_max_accuracy": 0.9}, "only with dynamic_sampling=True"),
    ],
)
def test_bad_settings_are_refused_in_one_line(tmp_path, fields, words):
    with pytest.raises(ValueError, match=r"[^\n]*" + words.replace("[", r"\[").replace("]", r"\]")) as error:
        ReToolConfig(str(tmp_path), use_cpu=True, **fields)
    assert "\n" not in str(error.value)


def test_band_needs_an_answer_column(tmp_path):
    from datasets import Dataset

    with pytest.raises(ValueError, match="`answer` column"):
        trainer_for(
            tmp_path,
            [],
            dataset=Dataset.from_list([{"prompt": "Q:"}] * 4),
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
            dynamic_sampling=True,
            dynamic_sampling_max_accuracy=0.9,
        )


def test_a_streamed_training_set_is_refused(tmp_path):
    from datasets import Dataset

    streamed = Dataset.from_list(rows("hard 1", "hard 2")).to_iterable_dataset()
    with pytest.raises(ValueError, match="map-style training dataset"):
        trainer_for(tmp_path, [], dataset=streamed, dynamic_sampling=True, max_steps=1)
