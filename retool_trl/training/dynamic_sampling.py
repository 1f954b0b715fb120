"""DAPO's dynamic sampling (arXiv 2503.14476), with SimpleTIR's accuracy band as an option.

A group whose rewards all match has zero advantage: it adds nothing to the policy gradient and only dilutes the
batch. With `ReToolConfig.dynamic_sampling` on, such groups (and, with `dynamic_sampling_min_accuracy` /
`dynamic_sampling_max_accuracy`, groups whose accuracy lies outside the band) are dropped after TRL has scored them,
and more prompts are rolled out and scored until every process has a full generation batch of kept rows, or
`dynamic_sampling_max_rounds` rounds have run. A capped step trains on what it has: the kept rows, then dropped rows
to fill the batch (zero advantage, as TRL would have trained them), and says so (`retool/dynamic_sampling/capped`,
a warning the first time).

Each round is one whole call of the trainer's scoring (`_generate_and_score_completions`: rollout, rewards, group
advantages, old/reference log-probs), so advantages are always those of whole groups, and the rollout mode, GRPO-RoC
and the loss masks of the void-turn filter act in every round as they do without dynamic sampling. Which groups to
keep is decided from the rewards TRL gathered over all processes, the same on every process; so is the number of
rounds (every process rolls out and scores until all of them are full), and every process ends with a batch of the
size it started with. The extra prompts come from a stream of the training set of their own, shuffled with its own
seed and cut into generation batches as TRL's sampler cuts them (each prompt `num_generations` times in a row, each
process its contiguous slice), so the main dataloader, and so the epochs, are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from trl.trainer.utils import nanstd

logger = logging.getLogger(__name__)

PREFIX = "retool/dynamic_sampling/"


def uniform_groups(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Per group, whether its rewards all match (zero advantage), as TRL's `frac_reward_zero_std` judges it.

    Args:
        rewards_per_func: Rewards over all processes, `(rows, functions)`; NaN where a function did not score a row.
        weights: The reward weights, `(functions,)`.
        num_generations: Group size (a group's rows are consecutive).
        aggregation: TRL's `multi_objective_aggregation`. With `"normalize_then_sum"` every function is normalised
            within the group first, so a group is uniform only when each function is.
    """
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[-1])
    if aggregation == "normalize_then_sum":
        std = nanstd(grouped, dim=1)  # (groups, functions)
        flat = ~torch.isfinite(std) | torch.isclose(std, torch.zeros_like(std))
        return flat.all(dim=1)
    unscorable = torch.isnan(grouped).all(dim=2)
    rewards = (grouped * weights.to(grouped.device)).nansum(dim=2)
    rewards[unscorable] = torch.nan
    std = nanstd(rewards, dim=1)
    # A group with fewer than two scored rows has no spread either (its std is NaN): nothing to learn from it.
    return ~torch.isfinite(std) | torch.isclose(std, torch.zeros_like(std))


def outside_band(
    correct: torch.Tensor, num_generations: int, min_accuracy: float | None, max_accuracy: float | None
) -> torch.Tensor:
    """Per group, whether its accuracy (the mean of `correct`, NaN rows left out) lies outside the band."""
    accuracy = torch.nanmean(correct.float().view(-1, num_generations), dim=1)
    outside = torch.isnan(accuracy)
    if min_accuracy is not None:
        outside |= accuracy < min_accuracy
    if max_accuracy is not None:
        outside |= accuracy > max_accuracy
    return outside


def concatenate(batches: Sequence[dict], pad_token_id: int) -> dict:
    """Joins scored batches (TRL's `_generate_and_score_completions` outputs) row-wise.

    Prompt tensors are left-padded, every other 2-D tensor right-padded, to the widest batch: ids with the pad token,
    masks and per-token values with 0 (they are multiplied by the masks). 0-d tensors (`num_items_in_batch`) are left
    out: the caller recounts them for the rows it keeps.
    """
    if len(batches) == 1:
        return {k: v for k, v in batches[0].items() if not (isinstance(v, torch.Tensor) and v.dim() == 0)}
    joined = {}
    for key, first in batches[0].items():
        if not isinstance(first, torch.Tensor):
            raise ValueError(
                f"ReToolConfig.dynamic_sampling cannot join the batch field {key!r} ({type(first).__name__}): "
                "image inputs are not supported with dynamic sampling; set dynamic_sampling=False."
            )
        if first.dim() == 0:
            continue
        parts = [batch[key] for batch in batches]
        if first.dim() >= 2:
            width = max(p.shape[1] for p in parts)
            value = pad_token_id if key.endswith("_ids") else 0
            left = key.startswith("prompt_")
            padded = []
            for p in parts:
                fill = p.new_full((p.shape[0], width - p.shape[1], *p.shape[2:]), value)
                padded.append(torch.cat([fill, p] if left else [p, fill], dim=1))
            parts = padded
        joined[key] = torch.cat(parts, dim=0)
    return joined


def take_rows(batch: dict, rows: Sequence[int]) -> dict:
    """The rows `rows` of a joined batch, with the padding no kept row needs cut away."""
    index = torch.tensor(list(rows), dtype=torch.long)
    picked = {k: v[index.to(v.device)] for k, v in batch.items()}
    if "completion_mask" in picked and picked["completion_mask"].numel():
        width = picked["completion_mask"].shape[1]
        used = picked["completion_mask"].any(dim=0).nonzero()
        keep = max(int(used.max()) + 1 if len(used) else 1, 1)
        if keep < width:
            for key, value in picked.items():
                if value.dim() >= 2 and value.shape[1] == width and not key.startswith("prompt_"):
                    picked[key] = value[:, :keep]
    if "prompt_mask" in picked and picked["prompt_mask"].numel():
        width = picked["prompt_mask"].shape[1]
        used = picked["prompt_mask"].any(dim=0).nonzero()
        start = int(used.min()) if len(used) else 0
        if start > 0:
            for key in ("prompt_ids", "prompt_mask"):
                if key in picked:
                    picked[key] = picked[key][:, start:]
    return picked


class DynamicSampling:
    """Fills each generation batch with rows of groups worth training on (see the module's docstring).

    Args:
        trainer: The `ReToolTrainer`. Read from it: `args`, `accelerator`, `num_generations`, `train_dataset`,
            `shuffle_dataset`, `reward_weights`, `multi_objective_aggregation`, `_tokenizer`, `_metrics`, and what
            its scoring left of the round: `_round_rewards` (rewards over all processes) and `_round_correct` (this
            process's correctness per row, when the accuracy band is set).
    """

    def __init__(self, trainer):
        self.trainer = trainer
        args = trainer.args
        self.max_rounds = args.dynamic_sampling_max_rounds
        self.band = (args.dynamic_sampling_min_accuracy, args.dynamic_sampling_max_accuracy)
        self.warned = False
        self._generator = torch.Generator().manual_seed(args.seed + 1)  # not the main sampler's order
        self._order: list[int] = []

    @property
    def uses_band(self) -> bool:
        return any(bound is not None for bound in self.band)

    # ------------------------------------------------------------------------------------------ extra prompts
    def draw(self, local_size: int) -> list[dict]:
        """This process's rows of the next generation batch of the extra stream (`local_size` rows, whole groups
        of `num_generations` over all processes, as TRL's sampler lays them out)."""
        trainer = self.trainer
        group, processes = trainer.num_generations, trainer.accelerator.num_processes
        dataset = trainer.train_dataset
        prompts = []
        for _ in range(local_size * processes // group):
            if not self._order:
                n = len(dataset)
                shuffled = trainer.shuffle_dataset
                order = torch.randperm(n, generator=self._generator).tolist() if shuffled else list(range(n))
                self._order = order[::-1]  # taken from the end
            prompts.append(self._order.pop())
        rows = [i for i in prompts for _ in range(group)]
        start = trainer.accelerator.process_index * local_size
        # A dict of its own per row, as a dataloader gives: TRL writes each row's rollout facts into it.
        return [dict(dataset[i]) for i in rows[start : start + local_size]]

    # ------------------------------------------------------------------------------------------- the rounds
    def _drop_decision(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per global row of the round just scored: (dropped, in a zero-variance group)."""
        trainer = self.trainer
        group = trainer.num_generations
        uniform = uniform_groups(
            trainer._round_rewards.float(),
            trainer.reward_weights.float(),
            group,
            getattr(trainer, "multi_objective_aggregation", "sum_then_normalize"),
        ).cpu()
        dropped = uniform.clone()
        if self.uses_band:
            device = trainer.accelerator.device
            correct = torch.tensor(trainer._round_correct, dtype=torch.float32, device=device)
            dropped |= outside_band(trainer.accelerator.gather(correct).cpu(), group, *self.band)
        return dropped.repeat_interleave(group), uniform.repeat_interleave(group)

    def fill(self, inputs: list[dict], score: Callable[[list[dict]], dict]) -> dict:
        """Scores `inputs` with `score`, then more drawn prompts until the batch is full or the cap is hit."""
        trainer = self.trainer
        accelerator = trainer.accelerator
        size, processes, rank = len(inputs), accelerator.num_processes, accelerator.process_index
        local = slice(rank * size, (rank + 1) * size)
        batches, kept, spare = [], [], []  # kept/spare: (row in the joined batch, zero-variance group)
        full = torch.zeros(processes, dtype=torch.long)
        groups_dropped = rounds = 0
        while True:
            offset = sum(len(b["advantages"]) for b in batches)
            batches.append(score(inputs))
            rounds += 1
            dropped, uniform = self._drop_decision()
            groups_dropped += int(dropped.sum()) // trainer.num_generations
            for i, (drop, flat) in enumerate(zip(dropped[local].tolist(), uniform[local].tolist(), strict=True)):
                (spare if drop else kept).append((offset + i, flat))
            # Every process knows every process's count: the decision is made from the gathered rewards.
            full += (~dropped).view(processes, size).sum(dim=1)
            if bool((full >= size).all()) or rounds >= self.max_rounds:
                break
            inputs = self.draw(size)
        capped = not bool((full >= size).all())
        chosen = (kept + spare)[:size]  # a capped step fills up with dropped rows: it trains on what it has
        output = take_rows(concatenate(batches, trainer._tokenizer.pad_token_id or 0), [row for row, _ in chosen])
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        device = accelerator.device
        output["num_items_in_batch"] = accelerator.gather(mask.sum().to(device)).sum()
        flat = torch.tensor([float(f) for _, f in chosen], device=device)
        metrics = trainer._metrics["train"]
        metrics[PREFIX + "groups_dropped"].append(float(groups_dropped))
        metrics[PREFIX + "rounds"].append(float(rounds))
        metrics[PREFIX + "zero_std_ratio"].append(accelerator.gather(flat).mean().item())
        metrics[PREFIX + "capped"].append(float(capped))
        if capped and not self.warned:
            self.warned = True
            logger.warning(
                "dynamic sampling reached its cap (dynamic_sampling_max_rounds=%d rollout rounds) with only %d of "
                "%d rows from groups worth training on on some process; this step trains on what it has, filled up "
                "with dropped rows (retool/dynamic_sampling/capped says which steps). Raise "
                "dynamic_sampling_max_rounds or widen the accuracy band if this happens often.",
                rounds,
                int(full.min()),
                size,
            )
        return output


def dynamic_sampler(trainer) -> DynamicSampling | None:
    """The dynamic sampler of `trainer` (`None` when `dynamic_sampling` is off); refuses training sets it cannot
    draw more prompts from."""
    args = trainer.args
    if not args.dynamic_sampling:
        return None
    data = trainer.train_dataset
    if data is None:
        return DynamicSampling(trainer)  # evaluation only: never used
    from datasets import IterableDataset

    if isinstance(data, (IterableDataset, torch.utils.data.IterableDataset)) or not hasattr(data, "__len__"):
        raise ValueError(
            "ReToolConfig.dynamic_sampling draws more prompts by index and needs a map-style training dataset; "
            "load it without streaming or set dynamic_sampling=False."
        )
    sampler = DynamicSampling(trainer)
    columns = getattr(data, "column_names", None)
    if sampler.uses_band and columns is not None and "answer" not in columns:
        raise ValueError(
            "ReToolConfig.dynamic_sampling_min_accuracy / dynamic_sampling_max_accuracy judge answers against an "
            f"`answer` column, but the training dataset has only {sorted(columns)}: add it or unset the band."
        )
    return sampler
