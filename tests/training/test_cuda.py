"""The GPU path (marker `gpu`: skipped, with the reason, where CUDA is missing): the same code trains,
evaluates and consolidates EWC on a CUDA device, picks bf16 there, and reports GPU memory."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_exp.base.cpu import resolve_precision
from grpo_exp.base.io import read_jsonl
from grpo_exp.core import models
from grpo_exp.training import shared_prefix
from tests.conftest import compose_cfg

pytestmark = pytest.mark.gpu


def test_precision_auto_is_bf16_on_cuda():
    assert resolve_precision("auto") == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")


def test_a_grpo_stage_trains_and_evaluates_on_cuda_and_reports_gpu_memory(tmp_path):
    from grpo_exp.training.stage import train

    cfg = compose_cfg(["debug=smoke", "logger=none", "train.max_steps=3", "eval.every_steps=1"], tmp_path)
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

    first = compose_cfg(["debug=smoke", "logger=none", "ewc.lambda=10", "ewc.fisher_samples=4",
                         "ewc.fisher_batch_size=2"], tmp_path / "basic")
    assert train(first)["fisher_params"] > 0
    second = compose_cfg(["debug=smoke", "logger=none", "stage=intermediate", "stage.num_train=16",
                          "stage.num_test=8", "ewc.lambda=10", "ewc.fisher_samples=4", "ewc.fisher_batch_size=2",
                          f"init_from={tmp_path / 'basic'}"], tmp_path / "intermediate")
    metrics = train(second)
    assert metrics["ewc_weighted_distance"] >= 0
    penalties = [r["ewc_penalty"] for r in read_jsonl(tmp_path / "intermediate" / "history.jsonl")]
    assert penalties and all(p >= 0 for p in penalties)


def test_shared_prefix_scoring_matches_trl_on_cuda(tmp_path):
    from trl.trainer.utils import add_fused_lm_head

    cfg = compose_cfg(["debug=smoke"], tmp_path)
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
