"""Dynamic sampling (DAPO's filter_groups, `train.dynamic_sampling=true`): a generation round's groups whose
correctness rewards are all equal are dropped, and the batch is filled with groups of newly drawn prompts.

Why: a group whose completions all score the same has zero advantage, so it adds nothing to GRPO's policy
gradient but still counts in the batch (and with batch-std scaling a small format bonus becomes its whole
signal). On a stage the model rarely solves, that is nearly every group.

Which reward decides: the reward function named `correctness` where one is configured, else the weighted total
reward that TRL normalizes (reward=strict's stated_correctness, a test's reward).

How a round is filled. The round's groups are the batch's slots. While a slot holds an all-equal group, and at
most `train.dynamic_sampling_max_draws` times, another round is generated and scored as TRL does for the first:
as many prompts as the round holds, drawn from the training set by a generator seeded with (train.seed, optimizer
step, draw), so the draws do not depend on the global RNG state and a resumed or data-parallel run draws the same
prompts. A slot takes a kept group from a later round only where the two lie alike over the processes (the same
process for each completion; `layouts`), so no tensor moves between processes; every process decides alike from
the rewards TRL gathers. A slot still unfilled after the last draw keeps its all-equal group with its completion
mask zeroed: the step trains on the groups it has. With none on any process, the step is skipped (its update
dropped as training/guards.py drops a poisoned round's). The advantages are then computed over the final batch by
TRL's formula.

Logged each generation round, beside TRL's frac_reward_zero_std (which, like TRL's other round figures, is
averaged over every round generated): `dynamic_sampling/dropped_groups` (all-equal groups generated, every round,
every process), `dynamic_sampling/draws` (extra rounds) and `dynamic_sampling/kept_share` (share of the batch's
groups that train; 1 when the batch is full, 0 when the step is skipped).
"""

from __future__ import annotations

import numpy as np
import torch
from trl.trainer.utils import nanstd

from grpo_exp.base import log

logger = log.get_logger(__name__)

CORRECTNESS = "correctness"  # the reward function whose equality drops a group
DRAWS_KEY = "dynamic_sampling/draws"  # the logged figure of a step's extra rounds (base/monitor counts their tokens)
_TOLERANCE = 1e-6  # rewards closer than this count as equal

# how each tensor of TRL's round output is padded to a common width: prompts on the left, completions on the right
_LEFT = {"prompt_ids": None, "prompt_mask": 0}  # None: the tokenizer's pad token
_RIGHT = {"completion_ids": None, "completion_mask": 0, "old_per_token_logps": 0.0,
          "sampling_per_token_logps": 0.0, "ref_per_token_logps": 0.0, "importance_sampling_ratio": 1.0,
          "tool_mask": 1}
_RECOMPUTED = {"advantages", "num_items_in_batch"}


def group_signal(rewards_per_func: torch.Tensor, names: list[str], weights: torch.Tensor) -> torch.Tensor:
    """Per completion, the reward that decides: `correctness` where configured, else the weighted total (NaN where
    every function returned None, as TRL marks an unscorable completion)."""
    if CORRECTNESS in names:
        return rewards_per_func[:, names.index(CORRECTNESS)]
    total = (rewards_per_func * weights.to(rewards_per_func.device)[None]).nansum(dim=1)
    return total.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def all_equal(signal: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per group (consecutive `num_generations` completions), whether its scorable rewards are all equal."""
    grouped = signal.view(-1, num_generations)
    valid = ~torch.isnan(grouped)
    high = grouped.masked_fill(~valid, -float("inf")).max(dim=1).values
    low = grouped.masked_fill(~valid, float("inf")).min(dim=1).values
    return ~(high - low > _TOLERANCE)  # fewer than two scorable rewards: equal


def layouts(groups: int, num_generations: int, local: int) -> list[tuple[int, ...]]:
    """Per group of a round, the process holding each of its completions (TRL lays a round out over processes in
    order, `local` completions each): groups of the same layout can stand in for each other without moving data."""
    return [tuple((g * num_generations + j) // local for j in range(num_generations)) for g in range(groups)]


def assign(sources: list, kept: list[bool], layout: list[tuple[int, ...]], round_index: int) -> list:
    """Slots still unfilled take the kept groups of round `round_index` of their own layout, in order (round 0: a
    kept group keeps its own slot). sources[s] is (round, group) or None."""
    sources = list(sources)
    if round_index == 0:
        return [(0, g) if ok else None for g, ok in enumerate(kept)]
    free = [g for g, ok in enumerate(kept) if ok]
    for slot, source in enumerate(sources):
        if source is None:
            match = next((g for g in free if layout[g] == layout[slot]), None)
            if match is not None:
                free.remove(match)
                sources[slot] = (round_index, match)
    return sources


def draw_prompts(dataset_size: int, groups: int, seed: int, step: int, draw: int) -> list[int]:
    """`groups` dataset indices for extra round `draw` at optimizer step `step`: a permutation seeded by (seed,
    step, draw) alone, never by the global RNG, so a resumed run and every process draw the same."""
    if dataset_size < 1:
        raise ValueError("dynamic sampling needs a training set to draw prompts from; it is empty")
    order = np.random.default_rng([seed & 0xFFFFFFFF, step, draw]).permutation(dataset_size)
    return [int(order[i % dataset_size]) for i in range(groups)]


def advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int, scale_rewards: str,
               aggregation: str) -> torch.Tensor:
    """GRPO's advantages of a batch's gathered rewards, by TRL 1.16's formula (GRPOTrainer.
    _generate_and_score_completions, reproduced here since TRL computes them inline): NaN rows (unscorable, or a
    slot left unfilled) stay out of every mean and std and get advantage 0."""
    weights = weights.to(rewards_per_func.device)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights[None]).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        if scale_rewards in ("group", "none"):
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        elif scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            raise ValueError(f"scale_rewards={scale_rewards!r} is not one of batch, group, none")
        result = rewards - mean
        if scale_rewards != "none":
            result = result / (std + 1e-4)
    elif aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True)
        rewards = (((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.size(1)) * weights[None])
        rewards = rewards.nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        result = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    else:
        raise ValueError(f"multi_objective_aggregation={aggregation!r} is not sum_then_normalize or "
                         f"normalize_then_sum")
    return torch.nan_to_num(result, nan=0.0)


def _pad(tensor: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    if tensor.dim() < 2 or tensor.size(1) == width:
        return tensor
    filler = tensor.new_full((tensor.size(0), width - tensor.size(1), *tensor.shape[2:]), value)
    return torch.cat([filler, tensor] if left else [tensor, filler], dim=1)


def splice(outputs: list[dict], rows: list[tuple[int, int]], pad_token_id: int) -> dict:
    """A batch of TRL round outputs' rows: rows[i] = (round, that round's local row); each tensor padded to the
    widest round's width as TRL pads it. Advantages and the item count are left to the caller."""
    batch = {}
    for key in outputs[0]:
        if key in _RECOMPUTED:
            continue
        if key not in _LEFT and key not in _RIGHT:
            raise ValueError(f"dynamic sampling cannot combine rounds holding {key!r} (a vision-language or "
                             f"multimodal batch); set train.dynamic_sampling=false")
        value = (_LEFT | _RIGHT)[key]
        value = pad_token_id if value is None else value
        tensors = [out[key] for out in outputs]
        width = max(t.size(1) for t in tensors) if tensors[0].dim() >= 2 else None
        stacked = torch.cat([_pad(t, width, value, key in _LEFT) for t in tensors])
        starts = np.cumsum([0] + [t.size(0) for t in tensors])
        index = torch.tensor([int(starts[r]) + i for r, i in rows], device=stacked.device)
        batch[key] = stacked.index_select(0, index)
    return batch


def fill_batch(trainer, inputs: list[dict], generate, sampling: "DynamicSampling", guard) -> dict:
    """A round for `trainer` (a training GrpoExpTrainer) with all-equal groups replaced, generated by
    `generate(inputs)` (GRPOTrainer's _generate_and_score_completions), whose gathered rewards `sampling.rewards`
    holds after each call; a batch left with no group asks `guard` (guards.RoundGuard) to skip its round."""
    n, local = trainer.num_generations, len(inputs)
    processes, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
    groups = local * processes // n
    layout = layouts(groups, n, local)
    names, weights = list(trainer.reward_func_names), trainer.reward_weights
    dataset, step = trainer.train_dataset, trainer.state.global_step

    outputs, rewards, sources, dropped = [], [], [None] * groups, 0
    while len(outputs) <= sampling.draws and None in sources:
        draw = len(outputs)
        if draw:
            indices = draw_prompts(len(dataset), groups, seed=trainer.args.seed, step=step, draw=draw)
            rows = [i for i in indices for _ in range(n)][rank * local:(rank + 1) * local]
            inputs = [dataset[i] for i in rows]
        outputs.append(generate(inputs))
        rewards.append(sampling.rewards)
        equal = all_equal(group_signal(rewards[-1], names, weights), n)
        dropped += int(equal.sum())
        sources = assign(sources, (~equal).tolist(), layout, draw)
    draws, filled = len(outputs) - 1, sum(s is not None for s in sources)
    metrics = trainer._metrics["train"]
    metrics["dynamic_sampling/dropped_groups"].append(float(dropped))
    metrics[DRAWS_KEY].append(float(draws))
    metrics["dynamic_sampling/kept_share"].append(filled / groups)
    if draws == 0:
        return outputs[0]  # nothing dropped: TRL's round as it is

    # the final batch, globally (every process computes the same) and this process's rows of it
    final_rewards = torch.full_like(rewards[0], float("nan"))
    rows, trained = [], []
    for slot, source in enumerate(sources):
        round_index, group = source if source is not None else (0, slot)
        for j in range(n):
            at, row = slot * n + j, group * n + j
            if source is not None:
                final_rewards[at] = rewards[round_index][row]
            if at // local == rank:
                rows.append((round_index, row - rank * local))
                trained.append(source is not None)
    batch = splice(outputs, rows, trainer._tokenizer.pad_token_id)
    batch["completion_mask"] = batch["completion_mask"] * torch.tensor(
        trained, dtype=batch["completion_mask"].dtype, device=batch["completion_mask"].device)[:, None]
    batch["advantages"] = advantages(final_rewards, trainer.reward_weights, n, trainer.scale_rewards,
                                     trainer.multi_objective_aggregation)[rank * local:(rank + 1) * local]
    loss_mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
    batch["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()
    if 0 < filled < groups:  # none filled: the round guard drops the step and says so
        logger.info("step %d: dynamic sampling filled %d of %d groups after %d extra rounds", step + 1, filled,
                    groups, draws)
    if filled == 0:
        # every process saw the same rewards: each drops the update
        guard.skip_round(f"dynamic sampling: every group's {CORRECTNESS if CORRECTNESS in names else 'reward'} "
                         f"was all equal after {draws} extra rounds")
    return batch


class DynamicSampling:
    """GrpoExpTrainer's dynamic sampling (the module's docstring), one per trainer where
    train.dynamic_sampling is on: the trainer hands it each round's gathered rewards (`observe`, from TRL's
    `_calculate_rewards`) and runs its training rounds through `fill` (TRL's `_generate_and_score_completions` once
    per round drawn). `fill_batch` reads TRL's `_metrics`, `_tokenizer`, `reward_func_names`, `reward_weights`,
    `scale_rewards` and `multi_objective_aggregation`, and `advantages` restates TRL 1.16's formula
    (tests/training/test_dynamic_sampling.py checks it against TRL's), all of which a TRL upgrade may change."""

    def __init__(self, draws: int):
        self.draws = draws  # extra rounds a batch may draw (train.dynamic_sampling_max_draws)
        self.rewards: torch.Tensor | None = None  # the last round's rewards, [completions of every process, funcs]

    def observe(self, rewards: torch.Tensor) -> None:
        self.rewards = rewards

    def fill(self, trainer, inputs: list[dict], generate, guard) -> dict:
        return fill_batch(trainer, inputs, generate, self, guard)
