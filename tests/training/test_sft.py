"""The supervised arm (train.method=sft, training/sft.py): TRL's SFTTrainer learns the stage's worked solutions with
the loss on the completion's tokens only, at the recipe's optimizer settings, inside the GRPO stage's run directory,
evaluation and model card; the settings it cannot serve are one line before any model loads."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_exp.base.errors import ConfigError
from grpo_exp.config.checks import validate
from grpo_exp.core import data, models
from grpo_exp.core.data.solutions import worked_solution
from grpo_exp.training import ewc, stage
from grpo_exp.training.sft import SftExpTrainer
from grpo_exp.training.stage import StageParts
from grpo_exp.training.trainer import build_trainer
from tests.conftest import compose_cfg

SFT = ["debug=smoke", "logger=none", "train.method=sft", "train.save_steps=100"]


def _trainer(cfg, examples):
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    parts = StageParts(model, tokenizer, examples, None, [], [], None, None, None)
    return build_trainer(cfg, parts, output_dir=cfg.paths.output_dir, callbacks=[])


def test_the_loss_covers_the_worked_solution_and_not_the_prompt(tmp_path):
    cfg = compose_cfg(SFT, tmp_path)
    examples = data.build_examples("basic", "train", size=4, seed=0)
    trainer = _trainer(cfg, examples)
    assert isinstance(trainer, SftExpTrainer) and trainer.speed_plan.record()["speed.method"] == "sft"
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    tokenizer = trainer.processing_class
    for ids, labels, example in zip(batch["input_ids"], batch["labels"], examples):
        learned = tokenizer.decode(ids[labels != -100])
        assert worked_solution(example) in learned, learned
        assert example["question"] not in learned  # the prompt is context, not a target
        assert (labels != -100).sum() < (batch["attention_mask"][0] > 0).sum()


@pytest.mark.slow
def test_a_short_sft_stage_lowers_its_loss_and_writes_the_runs_files(tmp_path):
    run_dir = tmp_path / "run"
    cfg = compose_cfg([*SFT, "train.max_steps=6", "train.learning_rate=3e-3", "train.lr_scheduler_type=constant",
                       "train.save_steps=3", "eval.every_steps=null", "train.keep_final_checkpoint=true"], run_dir)
    validate(cfg)
    metrics = stage.train(cfg)
    assert metrics["status"] == "completed" and metrics["steps"] == 6
    losses = [row["loss"] for row in map(json.loads, (run_dir / "history.jsonl").read_text().splitlines())
              if "loss" in row]
    assert len(losses) == 6 and sum(losses[-2:]) < sum(losses[:2]), losses
    assert json.loads((run_dir / "speed_plan.json").read_text())["speed.method"] == "sft"
    assert "supervised fine-tuning on worked solutions" in (run_dir / "model" / "README.md").read_text()
    assert (run_dir / "checkpoints" / "checkpoint-6" / "grpo_exp_state.json").is_file()
    # saved at steps 3 and 6; the default train.save_total_limit=1 keeps the newest
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["checkpoint-6"]
    assert "basic" in metrics["eval"]


@pytest.mark.parametrize("args,needle", [
    (["train.method=ppo"], "train.method='ppo' is not valid; choose one of: grpo, sft"),
    (["train.method=sft", "stage=prompts", "stage.hub_id=org/prompts"], "train.method=sft trains on worked solutions, which "
                                            "stage.dataset=prompts does not have"),
    (["train.method=sft", "curriculum.replay=0.2", "curriculum.replay_from=[basic]"],
     "train.method=sft trains on one stage's problems; curriculum.replay=0.2 mixes stages"),
])
def test_what_sft_cannot_serve_is_one_line(tmp_path, args, needle):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(["debug=smoke", *args], tmp_path))
    assert str(err.value).startswith(needle), str(err.value)
    assert "\n" not in str(err.value)


def test_the_ewc_term_is_added_to_the_sft_loss_and_logged(tmp_path):
    cfg = compose_cfg(SFT, tmp_path)
    trainer = _trainer(cfg, data.build_examples("basic", "train", size=4, seed=0))
    model = trainer.model
    name, param = next((n, p) for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2)
    state = ewc.EwcState(fisher={name: torch.ones_like(param)}, anchor={name: param.detach() + 0.1})
    penalty = ewc.EwcPenalty(state, 2.0)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    model.train()
    plain = float(trainer.compute_loss(model, batch).detach())
    trainer.extra_loss = penalty
    with_ewc = float(trainer.compute_loss(model, batch).detach())
    term = float(penalty(model).detach())
    assert term > 0 and with_ewc - plain == pytest.approx(term, rel=1e-4)
    assert trainer.pending_logs["ewc_penalty"] == pytest.approx(term)
    model.eval()  # outside training the term is not added
    assert float(trainer.compute_loss(model, batch).detach()) == pytest.approx(plain, rel=1e-6)


@pytest.mark.slow
def test_sft_through_a_curriculum_writes_a_loadable_model_and_a_record_of_what_trained(tmp_path):
    """The study's SFT arm end to end on the tiny model: two stages of two SFT steps each, each stage from the last
    one's model; curriculum.json records the method and the accuracy matrix, and each stage's model/ loads."""
    from transformers import AutoModelForCausalLM

    from grpo_exp.training.curriculum.sequential import run_curriculum

    overrides = [*SFT, "method=sft", "curriculum=progressive", "train.max_steps=2", "stage.num_train=8",
                 "curriculum.eval_limit=3", "curriculum.eval_batch_size=3", "eval.every_steps=null",
                 "train.max_completion_length=8"]
    cfg = compose_cfg(overrides, tmp_path)
    validate(cfg)
    run_curriculum(cfg, overrides)
    saved = json.loads((tmp_path / "curriculum.json").read_text())
    assert saved["method"] == "sft" and saved["stages"] == ["basic", "intermediate"]
    assert [len(row) for row in saved["matrix"]] == [2, 2] and len(saved["correct"]["rows"]) == 2
    for i, name in enumerate(saved["stages"], start=1):
        stage_dir = tmp_path / f"{i}_{name}"
        metrics = json.loads((stage_dir / "metrics.json").read_text())
        assert metrics["status"] == "completed" and metrics["steps"] == 2
        assert json.loads((stage_dir / "speed_plan.json").read_text())["speed.method"] == "sft"
        model = AutoModelForCausalLM.from_pretrained(stage_dir / "model")
        assert isinstance(model, torch.nn.Module)
    assert json.loads((tmp_path / "2_intermediate" / "metrics.json").read_text())["init_from"].endswith("1_basic/model")
