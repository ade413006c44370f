"""EWC inside real GRPO training: accumulation-invariant scaling, a penalty that holds parameters
back, and a 3-stage curriculum with Fisher files and an accuracy matrix."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_exp.training import ewc
from grpo_exp.core import models
from grpo_exp.core import rewards
from grpo_exp.evaluation.stats import mcnemar_exact_p
from grpo_exp.evaluation.continual import format_gains, stage_gains, transfer_metrics
from grpo_exp.training.curriculum.sequential import run_curriculum
from grpo_exp.training.stage import StageParts, check_init_from, train
from grpo_exp.training.trainer import build_trainer
from tests.conftest import compose_cfg

FAST = ["debug=smoke", "stage.num_train=8", "ewc.fisher_samples=4", "ewc.fisher_batch_size=4"]




def test_accumulation_steps_do_not_change_the_penalty_or_its_gradient(tmp_path, tiny_model):
    cfg = compose_cfg(FAST, tmp_path)
    model, tokenizer = copy.deepcopy(tiny_model)
    fisher = {n: torch.rand_like(p.detach()) for n, p in ewc.fisher_parameters(model, False).items()}
    state = ewc.EwcState(fisher, ewc.current_parameters(model, fisher), ["basic"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in fisher:
                p.add_(0.01)
    from grpo_exp.core.data import build_examples, to_dataset

    dataset = to_dataset(build_examples("basic", "train", size=8, seed=0), "")
    parts = StageParts(model, tokenizer, [], dataset, [rewards.correctness], [1.0], None, state,
                       ewc.EwcPenalty(state, 3.0))
    trainer = build_trainer(cfg, parts, tmp_path, [])
    model.train()
    grads, logged = {}, {}
    for accumulation in (1, 2):
        model.zero_grad()
        trainer._metrics["train"].clear()
        trainer.current_gradient_accumulation_steps = accumulation
        for _ in range(accumulation):
            trainer.extra_loss_term(model).backward()
        grads[accumulation] = {n: p.grad.clone() for n, p in model.named_parameters() if n in fisher}
        values = trainer._metrics["train"]["ewc_penalty"]
        logged[accumulation] = sum(values) / len(values)
    assert logged[1] == pytest.approx(logged[2], rel=1e-6) and logged[1] > 0
    for name in fisher:
        torch.testing.assert_close(grads[1][name], grads[2][name], rtol=1e-5, atol=1e-9)


def _weighted_distance(state, model_dir) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return ewc.EwcPenalty(state, 1.0).weighted_distance(model)


@pytest.mark.slow
def test_large_lambda_keeps_parameters_closer_to_the_anchor(tmp_path, test_rewards):
    first = compose_cfg([*FAST, *test_rewards.SPREAD_REWARD, "train.max_steps=1", "ewc.lambda=1"], tmp_path / "a")
    train(first)
    state = ewc.EwcState.load(tmp_path / "a")
    assert (tmp_path / "a" / "fisher.safetensors").exists() and state.stages == ["basic"]

    distances = {}
    for lam in (0, 1e6):
        out = tmp_path / f"lam{lam:g}"
        cfg = compose_cfg([*FAST, *test_rewards.SPREAD_REWARD, "train.max_steps=4", "train.learning_rate=1e-3",
                           f"ewc.lambda={lam}", f"init_from={tmp_path / 'a'}"], out)
        metrics = train(cfg)
        assert metrics["steps"] == 4
        distances[lam] = _weighted_distance(state, out / "model")
    history = [json.loads(line) for line in (tmp_path / "lam1e+06" / "history.jsonl").read_text().splitlines()]
    assert all("ewc_penalty" in row for row in history)
    assert distances[0] > 0
    assert distances[1e6] < 0.5 * distances[0], distances


def test_init_from_without_ewc_state_is_refused(tmp_path):
    from grpo_exp.base.errors import ConfigError

    first = compose_cfg([*FAST, "train.max_steps=1"], tmp_path / "a")
    train(first)  # lambda 0: no Fisher is written
    assert not (tmp_path / "a" / "fisher.safetensors").exists()
    cfg = compose_cfg([*FAST, "ewc.lambda=1", f"init_from={tmp_path / 'a'}"], tmp_path / "b")
    with pytest.raises(ConfigError, match="fisher.safetensors"):
        check_init_from(cfg)  # the entrypoint's pre-check, before any model loads
    assert not (tmp_path / "b").exists()
    with pytest.raises(ConfigError, match="holds no model"):
        train(compose_cfg([*FAST, f"init_from={tmp_path}"], tmp_path / "c"))


@pytest.mark.slow
def test_init_from_without_ewc_state_gets_its_fisher_estimated(tmp_path, test_rewards):
    """A run trained without EWC can still be protected: its Fisher is estimated at the next stage's start
    with its own recorded stage and settings, equal to what ewc.lambda>0 would have saved at its end."""
    from omegaconf import OmegaConf

    from grpo_exp.core.data import stage_split
    from grpo_exp.training.ewc import consolidate_fisher, starting_fisher

    first = compose_cfg([*FAST, *test_rewards.SPREAD_REWARD, "train.max_steps=1", "train.temperature=0.7"],
                        tmp_path / "a")
    train(first)
    (tmp_path / "a" / ".hydra").mkdir()
    OmegaConf.save(first, tmp_path / "a" / ".hydra" / "config.yaml")  # what Hydra records for a CLI run
    later = [*FAST, *test_rewards.SPREAD_REWARD, "stage=intermediate", "train.max_steps=2", "train.learning_rate=1e-3",
             "ewc.lambda=1e6", f"init_from={tmp_path / 'a'}"]

    model, tokenizer = models.load(first.model, first.paths.cache_dir, seed=0, init_from=tmp_path / "a" / "model")
    estimated = starting_fisher(compose_cfg(later, tmp_path / "direct"), model, tokenizer, tmp_path / "a")
    examples = stage_split(first.stage, "train", first.train.seed)
    at_the_end, _ = consolidate_fisher(first, model, tokenizer, examples, None, tmp_path / "end")
    assert estimated.stages == ["basic"] and estimated.fisher.keys() == at_the_end.fisher.keys()
    for name in estimated.fisher:
        torch.testing.assert_close(estimated.fisher[name], at_the_end.fisher[name])

    metrics = train(compose_cfg(later, tmp_path / "b"))
    assert metrics["steps"] == 2 and ewc.EwcState.load(tmp_path / "b").stages == ["basic", "intermediate"]
    assert not (tmp_path / "a" / "fisher.safetensors").exists()  # init_from's directory is left as it was
    history = [json.loads(line) for line in (tmp_path / "b" / "history.jsonl").read_text().splitlines()]
    assert all(row["ewc_penalty"] >= 0 for row in history if "loss" in row)
    assert "estimated at the start" in metrics["ewc_from"]


@pytest.mark.slow
def test_three_stage_curriculum_writes_stages_fishers_and_matrix(tmp_path):
    overrides = [*FAST, "train.max_steps=1", "ewc.lambda=10", "curriculum=progressive",
                 "curriculum.stages=[basic,intermediate,advanced]", "curriculum.eval_limit=3", "curriculum.eval_batch_size=3", "train.max_completion_length=8"]
    cfg = compose_cfg(overrides, tmp_path)
    result = run_curriculum(cfg, overrides)
    for i, stage in enumerate(["basic", "intermediate", "advanced"], start=1):
        stage_dir = tmp_path / f"{i}_{stage}"
        assert (stage_dir / "model" / "config.json").exists()
        assert ewc.EwcState.load(stage_dir).stages == ["basic", "intermediate", "advanced"][:i]
        assert json.loads((stage_dir / "metrics.json").read_text())["stage"] == stage
    saved = json.loads((tmp_path / "curriculum.json").read_text())
    # every stage is scored after every stage: the entry above the diagonal is the next stage's "before"
    assert [len(row) for row in saved["matrix"]] == [3, 3, 3]
    assert len(saved["base"]) == 3
    assert [[len(bits) for bits in row] for row in saved["correct"]["rows"]] == [[3, 3, 3]] * 3
    assert [g["stage"] for g in saved["stage_gains"]] == ["basic", "intermediate", "advanced"]
    gain = saved["stage_gains"][1]
    assert gain["before"] == saved["matrix"][0][1] and gain["after"] == saved["matrix"][1][1]
    assert {"average_accuracy", "bwt", "forgetting_max"} <= saved.keys()
    assert result["table"].count("\n") == 5  # header, separator, base and three stage rows
    # The curriculum continued the same policy: stage 2 started from stage 1's model.
    assert json.loads((tmp_path / "2_intermediate" / "metrics.json").read_text())["init_from"].endswith("1_basic/model")
    # Each later stage logged its forgetting of every earlier stage, on the same rows as its own eval.
    logged = [set().union(*(json.loads(line) for line in (tmp_path / d / "history.jsonl").read_text().splitlines()))
              for d in ("1_basic", "2_intermediate", "3_advanced")]
    assert not any(k.startswith("forgetting/") for k in logged[0])
    assert {"forgetting/basic/kl", "eval/basic/accuracy", "eval/intermediate/accuracy"} <= logged[1]
    assert {"forgetting/basic/kl", "forgetting/intermediate/kl", "eval/advanced/accuracy"} <= logged[2]
    assert "forgetting/advanced/kl" not in logged[2]
    # and how far it moved the policy on its own prompts (the drift that forgetting is fitted against)
    assert not any(k.startswith("drift/") for k in logged[0])
    assert "drift/intermediate/kl" in logged[1] and "drift/advanced/kl" in logged[2]


def test_stage_gains_pair_each_stage_with_the_model_before_it():
    # two stages, three problems each; rows[i][j]: after stage i, on stage j's problems
    base = [[0, 0, 1], [0, 0, 0]]
    rows = [[[1, 1, 1], [0, 1, 0]], [[1, 0, 1], [1, 1, 1]]]
    gains = stage_gains(["a", "b"], base, rows)
    assert [g["stage"] for g in gains] == ["a", "b"]
    assert gains[0]["before"] == pytest.approx(1 / 3) and gains[0]["after"] == 1.0
    # stage b's baseline is stage a's model on b (one right), not the start model (none right)
    assert gains[1]["before"] == pytest.approx(1 / 3) and gains[1]["gain"] == pytest.approx(2 / 3)
    assert gains[1]["mcnemar_p"] == pytest.approx(mcnemar_exact_p(0, 2))
    assert "| b | 3 | 0.333 | 1.000 | +0.667" in format_gains(gains)
    assert stage_gains(["a", "b"], None, rows)[0]["stage"] == "b"  # no start model scored: the first has no baseline


def test_transfer_metrics_follow_the_definitions():
    r = [[0.5], [0.3, 0.6], [0.2, 0.5, 0.7]]
    m = transfer_metrics(r)
    assert m["average_accuracy"] == pytest.approx((0.2 + 0.5 + 0.7) / 3)
    assert m["bwt"] == pytest.approx(((0.2 - 0.5) + (0.5 - 0.6)) / 2)
    assert m["forgetting_per_stage"] == pytest.approx([0.5 - 0.2, 0.6 - 0.5])
    assert m["forgetting_max"] == pytest.approx(0.3)
