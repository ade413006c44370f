"""The policy-loss options (train.importance_sampling_level, epsilon_high, entropy_coef, top_entropy_quantile,
mask_truncated_completions) give the same loss and gradients on grpo-exp's path as on TRL's plain one.

TRL implements each option; grpo-exp replaces code that feeds them. On grpo-exp's path (speed=auto, here with an
fp32 rollout copy, so that PPO's old log-probs are the sampler's) the completions come from the rollout engine,
the old log-probs that the clip and the sequence-level ratio divide by are the engine's sampling log-probs, the
training forward is the shared-prefix scoring (grouped attention, grpo-exp's LM-head kernel), whose entropies are
what top_entropy_quantile ranks and entropy_coef rewards, and the truncated completions that
mask_truncated_completions drops are the engine's. On TRL's (speed=trl) every one of those is TRL's own.

How the table is measured: one generation round of 4 prompts x 4 completions, drawn under the same seed on each
path (TRL's `generate` and the engine's multinomial sampler draw the same tokens, which the tests check), scored by
each path as it scores a round. Both policies then move by the same fixed perturbation, standing in for the
optimizer steps between sampling a round and training on its later batches: without it the ratio is exactly 1
and neither the clip nor the sequence-level ratio does anything. Each option's trainers are built from the composed
config (train.<option>=... through build_trainer), so the config's way into GRPOConfig is on the path too.

Tolerances (fp32): the paths add in other orders (grouped attention against sdpa, the prompt's keys once from a
cache against every row's forward, grpo-exp's LM-head kernel against TRL's chunked one, the engine's decoding
against TRL's scoring forward for the old log-probs), so they differ by float rounding only: measured up to 1e-7 in
the loss and 1.6e-6 of a parameter's gradient norm (2 cores, AVX512). LOSS_ATOL and GRAD_RTOL sit about 10 times
above that. Each option moves this batch's loss by at least SHIFT (100 x LOSS_ATOL) from the default's on both
paths, so a path that ignored an option, or a wrong entropy or old log-prob feeding it, would be caught, not hidden
in the tolerance (test_each_option_changes_the_loss_far_beyond_the_tolerance).
"""

from __future__ import annotations

import copy
import functools
import logging
import zlib

import pytest
import torch

from grpo_exp.config.checks import validate
from grpo_exp.core import data, rewards
from grpo_exp.training import shared_prefix
from grpo_exp.training.stage import StageParts
from grpo_exp.training.trainer import build_trainer
from tests.conftest import compose_cfg

logger = logging.getLogger(__name__)
# slow: the table builds 16 trainers (8 options x 2 paths) and trains a batch on each
pytestmark = [pytest.mark.usefixtures("test_rewards"), pytest.mark.slow]

PROMPTS, GROUP, LENGTH = 4, 4, 8
BATCH = 8  # per_device_train_batch_size: the round feeds two batches; the table trains on the first
BASE = ["debug=smoke", "stage.num_train=16", "logger=none", f"train.max_completion_length={LENGTH}",
        "reward.funcs=[vowel_fraction]", "reward.weights=[1.0]", "train.save_steps=100", "train.max_steps=1",
        "speed.rollout_compile=false", "train.precision=fp32", f"train.per_device_train_batch_size={BATCH}",
        f"train.num_generations={GROUP}", "train.steps_per_generation=2"]
# the two paths: TRL's plain one, and grpo-exp's (speed=auto: the engine, shared-prefix scoring, grpo-exp's kernels)
# with an fp32 copy (its log-probs are the old ones) drawing as `generate` draws
PATHS = {"trl": ["speed=trl"],
         "grpo_exp": ["speed=auto", "speed.rollout_dtype=fp32", "speed.rollout_sampler=multinomial"]}
# option -> (overrides, whether it acts where a round is generated and scored, so each path draws its own round)
OPTIONS = {
    "default": ([], False),
    "importance_sampling_level=sequence": (["train.importance_sampling_level=sequence"], False),
    "epsilon_high=0.28": (["train.epsilon_high=0.28"], False),
    "entropy_coef=0.01": (["train.entropy_coef=0.01"], False),
    "top_entropy_quantile=0.2": (["train.top_entropy_quantile=0.2"], False),
    "mask_truncated_completions=true": (["train.mask_truncated_completions=true"], True),
    "gspo+clip_higher": (["train.importance_sampling_level=sequence", "train.loss_type=grpo",
                          "train.epsilon_high=0.28"], False),
    "ablation=gspo": (["ablation=gspo"], False),  # the file as it is: GSPO's 3e-4 / 4e-4 clip
}
LOSS_ATOL = 1e-6
GRAD_RTOL = 2e-5
SHIFT = 100 * LOSS_ATOL
# the policy's move between sampling and training, in units of each weight tensor's own spread: it puts the first
# batch's token ratios between 0.71 and 1.36, 18% of them above the clip's 1.2 and 10% above clip-higher's 1.28
MOVE = 0.5


def build(tiny_model, path: str, overrides: list[str], run_dir):
    """A trainer for one path and option, on its own copy of the session's tiny model, widened EOS (below)."""
    cfg = compose_cfg([*BASE, *PATHS[path], *overrides], run_dir)
    validate(cfg)
    funcs, weights = rewards.build(list(cfg.reward.funcs), list(cfg.reward.weights))
    dataset = data.to_dataset(data.build_examples("basic", "train", size=16, seed=0), "")
    model, tokenizer = copy.deepcopy(tiny_model)  # build_trainer sets its attention and embedding gradient
    parts = StageParts(model, tokenizer, [], dataset, funcs, weights, None, None, None)
    trainer = build_trainer(cfg, parts, output_dir=run_dir, callbacks=[])
    assert (trainer.rollout_engine is not None) == trainer.speed_plan.shared_prefix == (path == "grpo_exp")
    assert trainer.speed_plan.old_logps == ("sampler" if path == "grpo_exp" else None)
    # The random model almost never draws its one EOS token in 8 steps, so every completion would be truncated and
    # mask_truncated_completions would drop the whole batch. Every 12th token id ends a completion here (about
    # half the completions end before the limit), on both paths alike: TRL's generate and masking read
    # eos_token_ids and its generation config, the engine its own copy.
    wide = sorted(set(trainer.eos_token_ids) | set(range(3, len(tokenizer), 12)))
    trainer.eos_token_ids = wide
    if trainer.rollout_engine is not None:
        trainer.rollout_engine.eos = torch.tensor(wide)
    else:
        trainer.generation_config.eos_token_id = wide
        trainer.generation_kwargs["eos_token_id"] = wide
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # as HF's loop sets it before a step's first batch
    return trainer, dataset


def generate(trainer, dataset) -> dict:
    """One generation round, scored as the trainer's path scores it (TRL's _generate_and_score_completions, which
    the engine serves on grpo-exp's path), drawn under a fixed seed. The prompts are the questions as plain text:
    the tiny model's chat template adds a default system message that makes a prompt five times longer, and on a
    CPU TRL's scoring forward takes every prompt position through the 49k-token LM head."""
    torch.manual_seed(7)
    return trainer._generate_and_score_completions([{"prompt": dataset[i]["question"]}
                                                    for i in range(PROMPTS) for _ in range(GROUP)])


def move(model) -> None:
    """The same fixed perturbation of every weight tensor on either path (norm weights, all 1, have no spread)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            spread = param.std() if param.numel() > 1 else param.new_zeros(())
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
            param.add_(noise * MOVE * spread)


def loss_and_grads(trainer, round_: dict) -> dict:
    """The loss of the round's first batch and every parameter's gradient; with what the path ran: shared-prefix
    forwards that had a gradient, and the high-entropy masks TRL made from the forward's entropies."""
    batch = {k: v[:BATCH] if torch.is_tensor(v) and v.dim() else v for k, v in round_.items()}
    masks, shared = [], []
    scoring, high_entropy = shared_prefix.completion_logps, trainer.get_high_entropy_mask

    def counting(*args, **kwargs):
        scored = scoring(*args, **kwargs)
        shared.append(scored is not None and torch.is_grad_enabled())
        return scored

    def recording(*args, **kwargs):
        masks.append(high_entropy(*args, **kwargs))
        return masks[-1]

    shared_prefix.completion_logps, trainer.get_high_entropy_mask = counting, recording
    try:
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
    finally:
        shared_prefix.completion_logps = scoring
        del trainer.get_high_entropy_mask
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {"loss": loss.item(), "grads": grads, "shared_prefix": any(shared), "entropy_masks": masks,
            "batch": batch}


@pytest.fixture(scope="module")
def rounds(tiny_model, tmp_path_factory) -> dict:
    """Each path's round with the default options: the batch every option's loss is taken on."""
    out = {}
    for path in PATHS:
        trainer, dataset = build(tiny_model, path, [], tmp_path_factory.mktemp(f"round_{path}"))
        out[path] = generate(trainer, dataset)
    return out


@pytest.fixture(scope="module")
def measured(tiny_model, tmp_path_factory, rounds):
    """option -> {path: loss_and_grads(...)}, each measured once for the module's tests."""

    @functools.cache
    def measure(option: str) -> dict:
        overrides, regenerate = OPTIONS[option]
        results = {}
        for path in PATHS:
            trainer, dataset = build(tiny_model, path, overrides, tmp_path_factory.mktemp(f"{path}"))
            round_ = generate(trainer, dataset) if regenerate else rounds[path]
            move(trainer.model)
            results[path] = {**loss_and_grads(trainer, round_), "round": round_, "eos": trainer.eos_token_ids}
        return results

    return measure


def test_both_paths_draw_and_score_the_same_round(rounds):
    """The table's premise: the same tokens, masks and advantages on both paths, and on grpo-exp's the old
    log-probs are the engine's sampling log-probs (no scoring forward), equal to TRL's scoring to rounding."""
    trl, ours = rounds["trl"], rounds["grpo_exp"]
    for key in ("prompt_ids", "completion_ids", "completion_mask"):
        assert torch.equal(trl[key], ours[key]), key
    torch.testing.assert_close(ours["advantages"], trl["advantages"], atol=1e-6, rtol=0)
    mask = trl["completion_mask"].bool()
    assert torch.equal(ours["old_per_token_logps"][mask], ours["sampling_per_token_logps"][mask])
    assert "sampling_per_token_logps" not in trl
    torch.testing.assert_close(ours["old_per_token_logps"][mask], trl["old_per_token_logps"][mask],
                               atol=1e-5, rtol=0)
    lengths = mask.sum(1)
    assert 0 < int((lengths == LENGTH).sum()) < len(lengths)  # some completions end before the limit, some do not


def grad_error(got: dict, reference: dict) -> tuple[float, float]:
    """(the largest |difference| of a gradient entry, the largest relative error of a parameter's gradient norm)."""
    assert got.keys() == reference.keys()
    absolute = max((got[n] - g).abs().max().item() for n, g in reference.items())
    relative = max(((got[n].double() - g.double()).norm() / g.double().norm().clamp(min=1e-30)).item()
                   for n, g in reference.items())
    return absolute, relative


@pytest.mark.parametrize("option", OPTIONS)
def test_grpo_exps_path_gives_trls_loss_and_gradients(measured, option):
    """One row of the table: the option's loss and gradients on grpo-exp's path against TRL's plain path."""
    result = measured(option)
    trl, ours = result["trl"], result["grpo_exp"]
    assert ours["shared_prefix"] and not trl["shared_prefix"]  # the training forward was the shared-prefix one
    loss_diff = abs(ours["loss"] - trl["loss"])
    grad_abs, grad_rel = grad_error(ours["grads"], trl["grads"])
    logger.info("| %s | grpo_exp vs trl | loss %.6g | max loss diff %.1e | max grad diff %.1e (relative %.1e) |",
                option, trl["loss"], loss_diff, grad_abs, grad_rel)
    assert loss_diff <= LOSS_ATOL, (ours["loss"], trl["loss"])
    assert grad_rel <= GRAD_RTOL, grad_rel


@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "default"])
def test_each_option_changes_the_loss_far_beyond_the_tolerance(measured, option):
    """What makes the table able to fail: on this batch each option moves the loss from the default's by at least
    SHIFT on both paths, 100 times the tolerance, so a path that dropped the option, or fed it other entropies or
    old log-probs, would not pass as rounding. The gradients move too."""
    default, result = measured("default"), measured(option)
    for path in PATHS:
        assert abs(result[path]["loss"] - default[path]["loss"]) >= SHIFT, (path, result[path]["loss"])
        assert grad_error(result[path]["grads"], default[path]["grads"])[1] > 100 * GRAD_RTOL, path


def test_top_entropy_quantile_keeps_the_same_tokens_on_both_paths(measured):
    """The shared-prefix forward's entropies rank the tokens as TRL's forward's do: TRL's high-entropy mask (a
    fifth of the batch's tokens) is the same set on both paths. (The random model's entropies all sit within 7e-4 of
    log V, about 1e-5 apart from one to the next; the paths' entropies differ by float rounding, far less.)"""
    result = measured("top_entropy_quantile=0.2")
    (trl,), (ours,) = result["trl"]["entropy_masks"], result["grpo_exp"]["entropy_masks"]
    assert torch.equal(trl, ours)
    tokens = int(result["trl"]["batch"]["completion_mask"].sum())
    assert 0 < int(trl.sum()) < tokens and int(trl.sum()) == pytest.approx(0.2 * tokens, abs=2)
    assert measured("default")["trl"]["entropy_masks"] == []  # quantile 1: TRL makes no mask


def test_truncated_completions_from_the_engine_are_masked_as_trls(measured):
    """mask_truncated_completions on the engine's completions: the rows that reach the length limit without an EOS
    lose their whole completion mask, the others keep theirs, as on TRL's path with the same round."""
    result = measured("mask_truncated_completions=true")
    trl, ours = result["trl"]["round"], result["grpo_exp"]["round"]
    assert torch.equal(trl["completion_ids"], ours["completion_ids"])
    assert torch.equal(trl["completion_mask"], ours["completion_mask"])
    default = measured("default")["grpo_exp"]["round"]  # the same round drawn without the option
    assert torch.equal(ours["completion_ids"], default["completion_ids"])
    unmasked = default["completion_mask"]
    # TRL's definition: the completion's last token is neither an EOS nor padding (it ran into the length limit)
    ids = ours["completion_ids"]
    last = ids[torch.arange(ids.size(0)), unmasked.sum(1) - 1]
    truncated = ~torch.isin(last, torch.tensor(result["grpo_exp"]["eos"]))
    assert not truncated[unmasked.sum(1) < LENGTH].any()  # a completion that stopped early ended on its EOS
    full = unmasked.sum(1) == LENGTH
    assert 0 < int(truncated.sum()) < int(full.sum())  # some ran into the limit, some ended on the last position
    assert int(ours["completion_mask"][truncated].sum()) == 0
    assert torch.equal(ours["completion_mask"][~truncated], unmasked[~truncated])
    assert int(ours["num_items_in_batch"]) == int(unmasked[~truncated].sum())
