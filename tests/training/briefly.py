"""Short real GRPO training for tests: one helper that builds a trainer around a composed config, trains it and
reports what its steps saw and did. The reward with spread on the tiny model's random text that such a run needs
is the test_rewards fixture's (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import os

import torch

from grpo_exp.base import cpu
from grpo_exp.config.checks import validate
from grpo_exp.config.speed import plan_for
from grpo_exp.core import data, models, rewards
from grpo_exp.training.stage import StageParts
from grpo_exp.training.trainer import build_trainer


def train_briefly(cfg, **plan_changes):
    """Train cfg's model on 16 basic problems for cfg.train.max_steps through build_trainer; `plan_changes`
    replace fields of the speed plan cfg.speed resolves to (one exact shortcut off, say).

    Returns (trainer, every batch compute_loss saw, the logged losses, whether any parameter moved). The
    process's thread settings are restored afterwards, so later tests are not left on cfg's."""
    validate(cfg)
    threads, env = torch.get_num_threads(), {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    cpu.apply(cfg.cpu)
    try:
        funcs, weights = rewards.build(list(cfg.reward.funcs), list(cfg.reward.weights))
        dataset = data.to_dataset(data.build_examples("basic", "train", size=16, seed=0), "")
        model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        parts = StageParts(model, tokenizer, [], dataset, funcs, weights, None, None, None)
        plan = dataclasses.replace(plan_for(cfg), **plan_changes)
        trainer = build_trainer(cfg, parts, output_dir=cfg.paths.output_dir, callbacks=[], plan=plan)
        seen = []
        compute_loss = trainer.compute_loss

        def recording(model, inputs, *a, **kw):
            loss = compute_loss(model, inputs, *a, **kw)
            # after the loss: what it used, including what the training forward added (old log-probs by batch)
            seen.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
            return loss

        trainer.compute_loss = recording
        trainer.train()
    finally:
        torch.set_num_threads(threads)
        for key, value in env.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    moved = any(not torch.equal(before[n], p.detach().cpu()) for n, p in trainer.model.named_parameters())
    return trainer, seen, losses, moved
