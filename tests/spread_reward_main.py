"""`python -m tests.spread_reward_main <overrides>`: the real train entrypoint plus test rewards.

The tiny random model scores 0 on math rewards, so GRPO advantages, gradients and optimizer
state would all be zero. These rewards have spread on random-token text (and one turns NaN on
request), so subprocess tests can check that training state survives kills and resumes.
"""

from __future__ import annotations

import math
import os

from grpo_exp.apps.train import main
from grpo_exp.core import rewards

_calls = {"n": 0}


def vowel_fraction(completions, **kwargs):
    texts = [rewards.completion_text(c) for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def nan_after(completions, **kwargs):
    """NaN from the call number given in GRPO_EXP_TEST_NAN_AFTER on (0-based)."""
    _calls["n"] += 1
    bad = _calls["n"] > int(os.environ.get("GRPO_EXP_TEST_NAN_AFTER", "1000000"))
    return [math.nan if bad else 0.0 for _ in completions]


def reset_calls() -> None:
    """nan_after counts from 0 again (a test that relies on the count starts with this)."""
    _calls["n"] = 0


TEST_REWARDS = {"vowel_fraction": vowel_fraction, "nan_after": nan_after}
# Math rewards score 0 on random tokens (no advantages, no updates); vowel_fraction has spread.
SPREAD_REWARD = ["reward.funcs=[vowel_fraction]", "reward.weights=[1.0]"]


def kill_at_publish_step() -> None:
    """GRPO_EXP_TEST_KILL_AT=<step>:<dir name>: die like SIGKILL (no clean-up) at that step of a publish."""
    spec = os.environ.get("GRPO_EXP_TEST_KILL_AT")
    if not spec:
        return
    from grpo_exp.base import io

    step, name = spec.split(":", 1)

    def hook(at, final):
        if at == step and final.name == name:
            os._exit(137)

    io.publish_fault_hook = hook


def row_seeded_rollouts() -> None:
    """GRPO_EXP_TEST_ROW_SEEDED=1: each rollout completion is sampled (at TRL's temperature, top-k 0, top-p 1)
    with a generator seeded by its prompt and its place among that prompt's copies in the batch, not by the
    process's RNG stream.

    TRL seeds each rank differently (set_seed(seed, device_specific=True)), so N processes sample other
    completions than one process would. With this, a run's completions do not depend on how the generation
    batch is split across processes or on a resume, and a 2-process run can be compared with a 1-process
    one (tests/training/test_ddp.py). Only TRL's rollouts (the `generate` calls that pass a
    generation_config) are affected; the Fisher's samples and evaluations are not."""
    if os.environ.get("GRPO_EXP_TEST_ROW_SEEDED") != "1":
        return
    import hashlib
    from collections import Counter

    import torch
    from transformers import LogitsProcessor, LogitsProcessorList
    from transformers.generation.utils import GenerationMixin

    class RowSeeded(LogitsProcessor):
        def __init__(self, seeds: list[int], temperature: float):
            self.generators = [torch.Generator().manual_seed(s) for s in seeds]
            self.temperature = temperature

        def __call__(self, input_ids, scores):
            probs = torch.softmax(scores.float() / self.temperature, dim=-1).cpu()
            chosen = torch.full_like(scores, -math.inf)
            for i, generator in enumerate(self.generators):
                chosen[i, torch.multinomial(probs[i], 1, generator=generator)] = 0.0
            return chosen  # one finite logit per row: the sampler that follows can only pick it

    original = GenerationMixin.generate

    def generate(self, *args, **kwargs):
        config = kwargs.get("generation_config")
        if config is None or not getattr(config, "do_sample", False):
            return original(self, *args, **kwargs)
        seen: Counter = Counter()
        seeds = []
        for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"]):
            key = tuple(ids[mask.bool()].tolist())
            digest = hashlib.sha256(repr((key, seen[key])).encode()).digest()
            seeds.append(int.from_bytes(digest[:8], "little") >> 1)
            seen[key] += 1
        kwargs["logits_processor"] = LogitsProcessorList([RowSeeded(seeds, config.temperature or 1.0)])
        return original(self, *args, **kwargs)

    GenerationMixin.generate = generate


def dump_parameters() -> None:
    """GRPO_EXP_TEST_PARAM_DUMP=<dir>: after training, every process saves the parameters it holds to
    <dir>/rank<r>.pt, so a test can check that the ranks of a data-parallel run agree."""
    target = os.environ.get("GRPO_EXP_TEST_PARAM_DUMP")
    if not target:
        return
    import torch

    from grpo_exp.base import dist
    from grpo_exp.training.stage import StageRun

    original = StageRun.train_and_save

    def train_and_save(self, trainer, *args, **kwargs):
        result = original(self, trainer, *args, **kwargs)
        os.makedirs(target, exist_ok=True)
        params = {name: p.detach().cpu().clone() for name, p in trainer.model.named_parameters()}
        torch.save(params, os.path.join(target, f"rank{dist.rank()}.pt"))
        return result

    StageRun.train_and_save = train_and_save


if __name__ == "__main__":
    rewards.REGISTRY.update(TEST_REWARDS)
    kill_at_publish_step()
    row_seeded_rollouts()
    dump_parameters()
    main()
