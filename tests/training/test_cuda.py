"""The GPU path (marker `gpu`: skipped, with the reason, where CUDA is missing): the same code trains,
evaluates and consolidates EWC on a CUDA device, picks bf16 there, and reports GPU memory; the rollout engine
and the autocast LM head run there too.

A GPU machine without the packaged SmolLM2 (whose tokenizer the tiny random model borrows) can point these tests
at a local model directory instead: GRPO_EXP_GPU_TEST_MODEL=<dir> runs them on `model=custom model.id=<dir>`,
for example the tiny random model's directory from the cache of a machine that has the package.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from grpo_exp.base.cpu import resolve_precision
from grpo_exp.base.io import read_jsonl
from grpo_exp.core import models
from grpo_exp.kernels import logprob_head
from grpo_exp.training import shared_prefix
from tests.conftest import compose_cfg
from tests.kernels.test_logprob_head import reference, relative_error  # the fp64 reference the CPU tests use
from tests.training.briefly import train_briefly

pytestmark = pytest.mark.gpu

# the model the tests run: debug=smoke's tiny random model, or the directory GRPO_EXP_GPU_TEST_MODEL names
MODEL = (["model=custom", f"model.id={os.environ['GRPO_EXP_GPU_TEST_MODEL']}"]
         if os.environ.get("GRPO_EXP_GPU_TEST_MODEL") else [])


def smoke(*overrides: str) -> list[str]:
    return ["debug=smoke", *MODEL, *overrides]


def test_precision_auto_is_bf16_on_cuda():
    assert resolve_precision("auto") == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")


def test_a_grpo_stage_trains_and_evaluates_on_cuda_and_reports_gpu_memory(tmp_path):
    from grpo_exp.training.stage import train

    cfg = compose_cfg(smoke("logger=none", "train.max_steps=3", "eval.every_steps=1"), tmp_path)
    metrics = train(cfg)
    assert metrics["status"] == "completed" and metrics["steps"] == 3
    assert metrics["precision"] == resolve_precision("auto")
    history = read_jsonl(tmp_path / "history.jsonl")
    assert all(r["gpu_peak_mem_mb"] > 0 for r in history)
    assert all("eval/basic/accuracy" in r for r in history)  # the held-out eval ran on the GPU model
    before_after = json.loads((tmp_path / "before_after.json").read_text())
    assert before_after["sets"]["basic"]["n"] == 8


def test_an_ewc_curriculum_step_on_cuda(tmp_path):
    from grpo_exp.training.stage import train

    first = compose_cfg(smoke("logger=none", "ewc.lambda=10", "ewc.fisher_samples=4", "ewc.fisher_batch_size=2"),
                        tmp_path / "basic")
    assert train(first)["fisher_params"] > 0
    second = compose_cfg(smoke("logger=none", "stage=intermediate", "stage.num_train=16", "stage.num_validation=8", "stage.num_test=8",
                               "ewc.lambda=10", "ewc.fisher_samples=4", "ewc.fisher_batch_size=2",
                               f"init_from={tmp_path / 'basic'}"), tmp_path / "intermediate")
    metrics = train(second)
    assert metrics["ewc_weighted_distance"] >= 0
    penalties = [r["ewc_penalty"] for r in read_jsonl(tmp_path / "intermediate" / "history.jsonl")]
    assert penalties and all(p >= 0 for p in penalties)


def test_shared_prefix_scoring_matches_trl_on_cuda(tmp_path):
    from trl.trainer.utils import add_fused_lm_head

    cfg = compose_cfg(smoke(), tmp_path)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    model = model.cuda()
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    tokenizer.padding_side = "left"
    enc = tokenizer(["What is 7 + 5?"] * 3 + ["Tom has 12 apples and eats 3. How many are left?"] * 3,
                    return_tensors="pt", padding=True)
    completions = torch.randint(0, len(tokenizer), (6, 8), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([enc.input_ids, completions], 1).cuda()
    mask = torch.cat([enc.attention_mask, torch.ones(6, 8, dtype=torch.long)], 1).cuda()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-8] = -100
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -8:]
        got, _ = shared_prefix.completion_logps(model, ids, mask, 8, 0.7, False)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_a_grpo_step_through_the_rollout_engine_and_the_autocast_head_on_cuda(tmp_path, test_rewards):
    """The engine's bf16 copy (its decoding step compiled, as `speed.rollout_compile=auto` does on CUDA) samples,
    TRL's importance correction weights the loss, and the autocast LM head's backward updates the policy."""
    cfg = compose_cfg(smoke("logger=none", "train.max_steps=2", "train.learning_rate=1e-3", "train.save_steps=100",
                            "speed.generation=engine", "speed.logprob_kernel=autocast", *test_rewards.SPREAD_REWARD),
                      tmp_path)
    trainer, seen, losses, moved = train_briefly(cfg)
    engine = trainer.rollout_engine
    assert engine is not None and engine.device.type == "cuda" and engine.dtype == torch.bfloat16
    assert trainer.speed_plan.logprob_kernel == "autocast"
    assert losses and all(math.isfinite(x) for x in losses), losses
    assert moved, "no parameter changed: the step did not update the policy"
    assert "importance_sampling_ratio" in seen[0]
    row = trainer.state.log_history[0]
    assert math.isfinite(row["rollout/kl"]) and row["rollout/kl"] >= 0


def test_the_autocast_head_on_cuda_is_as_close_to_fp64_as_trls():
    gen = torch.Generator().manual_seed(0)
    n, h, v = 300, 64, 5000
    hidden, weight = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen) * 0.3
    targets, grad_logps = torch.randint(0, v, (n,), generator=gen), torch.randn(n, generator=gen)
    ref_h, ref_w, _, ref, _ = reference(hidden, weight, None, targets, 0.7, round_to=torch.bfloat16)
    (ref * grad_logps.double()).sum().backward()

    def run(kernel):
        hc, wc = hidden.clone().cuda().requires_grad_(), weight.clone().cuda().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logps, _ = logprob_head.logprobs(hc, wc, None, targets.cuda(), 0.7, False, kernel)
        (logps * grad_logps.cuda()).sum().backward()
        return logps.detach().cpu(), hc.grad.cpu(), wc.grad.cpu()

    ours, trls = run("autocast"), run("trl")
    # log-probs too: both kernels round the logits GEMM's output to bf16, so neither equals fp64 exactly
    for i, r in ((0, ref.detach()), (1, ref_h.grad), (2, ref_w.grad)):
        assert relative_error(ours[i], r) < 2 * relative_error(trls[i], r) + 1e-3
        assert relative_error(ours[i], r) < 1e-2
