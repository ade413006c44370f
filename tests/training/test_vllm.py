"""speed.generation=vllm: TRL's vLLM in colocate mode samples, and grpo-exp's rollout engine stays out of its way.

On a CPU the trainer is built (not trained) with TRL's vLLM backend replaced by a stub that records how TRL set it
up, to check what the plan hands TRL and that the engine's stand-in for vLLM (trl_hook.enable_is_correction) never
replaces a real one. The `gpu` test trains two steps through a real colocated vLLM; it is skipped, with the reason,
where CUDA or the vllm package is missing (pip install 'grpo-exp[vllm]' on a CUDA machine).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from grpo_exp.config import speed
from grpo_exp.core import data, models, rewards
from grpo_exp.training.rollout import trl_hook
from grpo_exp.training.stage import StageParts
from grpo_exp.training.trainer import build_trainer
from tests.conftest import compose_cfg
from tests.training.briefly import train_briefly
from tests.training.test_cuda import MODEL

SMOKE = ["debug=smoke", "logger=none", "stage.num_train=16", "reward.funcs=[vowel_fraction]", "reward.weights=[1.0]",
         "train.save_steps=100"]


class StubVLLM:
    """Stands in for trl's VLLMGeneration: records TRL's settings; sampling is the gpu test's."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def sync_weights(self):
        raise AssertionError("the stub never samples, so TRL never syncs it")


@pytest.fixture
def stub_vllm(monkeypatch):
    from trl.trainer import grpo_trainer

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", StubVLLM)
    monkeypatch.setattr(speed, "vllm_installed", lambda: True)


def built(cfg, tmp_path, device: str):
    """The trainer build_trainer makes for cfg, its speed plan resolved as on `device`; not trained."""
    funcs, weights = rewards.build(list(cfg.reward.funcs), list(cfg.reward.weights))
    dataset = data.to_dataset(data.build_examples("basic", "train", size=16, seed=0), "")
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    parts = StageParts(model, tokenizer, [], dataset, funcs, weights, None, None, None)
    plan = speed.resolve(cfg.speed, cfg.train, device=device)
    return build_trainer(cfg, parts, output_dir=tmp_path, callbacks=[], plan=plan)


def test_speed_generation_vllm_hands_trl_a_colocated_vllm_and_builds_no_engine(tmp_path, stub_vllm, test_rewards):
    cfg = compose_cfg([*SMOKE, "speed.generation=vllm", "speed.vllm_memory=0.25"], tmp_path)
    trainer = built(cfg, tmp_path, device="cuda")
    assert trainer.rollout_engine is None and trainer.rollout_func is None  # TRL's own generation path
    assert trainer.use_vllm and trainer.vllm_mode == "colocate"
    assert isinstance(trainer.vllm_generation, StubVLLM)  # TRL's backend, not the engine's SimpleNamespace
    assert trainer.vllm_generation.kwargs["mode"] == "colocate"
    assert trainer.vllm_generation.kwargs["gpu_memory_utilization"] == 0.25
    # the speed config's correction, not TRL's defaults (sequence_mask)
    assert trainer.vllm_importance_sampling_correction and trainer.vllm_importance_sampling_mode == "token_truncate"
    assert (trainer.speed_plan.generation, trainer.speed_plan.vllm_memory) == ("vllm", 0.25)
    assert not trainer.old_logps.by_batch  # the deferred scoring is the engine's alone
    with pytest.raises(RuntimeError, match="cannot run beside TRL's own vLLM"):
        trl_hook.enable_is_correction(trainer)
    assert isinstance(trainer.vllm_generation, StubVLLM)


def test_an_engine_plan_with_trls_vllm_forced_on_records_vllm(tmp_path, stub_vllm, test_rewards):
    """train.extra.use_vllm=true (vLLM's server mode, say) under speed.generation=engine: TRL's vLLM samples, the
    engine is not built, and the plan (speed_plan.json) says vllm, not the engine or generate."""
    cfg = compose_cfg([*SMOKE, "speed.generation=engine", "+train.extra.use_vllm=true"], tmp_path)
    trainer = built(cfg, tmp_path, device="cpu")
    assert trainer.rollout_engine is None and isinstance(trainer.vllm_generation, StubVLLM)
    assert trainer.speed_plan.generation == "vllm" and trainer.speed_plan.old_logps is None


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="needs the vllm package (pip install 'grpo-exp[vllm]'); not installed here")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine")  # said first
def test_two_grpo_steps_sample_through_trls_colocated_vllm(tmp_path, test_rewards):
    # a 64-wide attention head, which every vLLM attention backend supports (debug=smoke's tiny model has 16)
    cfg = compose_cfg([*SMOKE, *MODEL, "model.tiny_hidden=256", "model.tiny_intermediate=512", "train.max_steps=2",
                       "train.learning_rate=1e-3", "speed.generation=vllm", *test_rewards.SPREAD_REWARD], tmp_path)
    trainer, seen, losses, moved = train_briefly(cfg)
    assert type(trainer.vllm_generation).__name__ == "VLLMGeneration" and trainer.vllm_mode == "colocate"
    assert trainer.rollout_engine is None and trainer.speed_plan.generation == "vllm"
    assert trainer.state.global_step == 2 and len(losses) == 2 and all(math.isfinite(x) for x in losses), losses
    assert moved, "no parameter changed: the steps did not update the policy"
    # TRL weighed the loss by its importance-sampling correction, with the speed config's mode
    assert all("importance_sampling_ratio" in batch for batch in seen)
    assert trainer.args.vllm_importance_sampling_mode == cfg.speed.is_mode
    assert all(batch["completion_ids"].shape[0] == cfg.train.per_device_train_batch_size for batch in seen)
