"""Supervised fine-tuning as a stage's trainer (`train.method=sft`): TRL's SFTTrainer on the stage's training problems
with worked solutions (core/data/solutions.py) as the completions, the comparison arm of the continual-learning study
("does RL forget less than supervised fine-tuning?").

Everything around the trainer is the GRPO stage's (training/stage.py): the run directory, resume, the EWC term, the
periodic and held-out evaluations, model/ and metrics.json. It trains at the recipe's optimizer settings
(train.max_steps, per_device_train_batch_size sequences per step, learning rate and schedule), so that an SFT stage
and a GRPO stage take the same number of optimizer steps over the same number of sequences; the loss is the
completion's tokens only (TRL's completion_only_loss for prompt-completion rows). Generation, rewards and the speed
plan's rollout settings do not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer

from grpo_exp.base import log
from grpo_exp.core.data import to_messages
from grpo_exp.core.data.solutions import worked_solution
from grpo_exp.training import atomic_save

logger = log.get_logger(__name__)

METHODS = ("grpo", "sft")


@dataclass(frozen=True)
class SftPlan:
    """What an SFT stage computes with, in the shape the stage reads of a GRPO trainer's speed plan."""

    precision: str
    device: str

    def record(self) -> dict:
        return {"speed.method": "sft", "speed.precision": self.precision, "speed.device": self.device}

    def summary(self) -> str:
        return f"{self.precision} on {self.device}, supervised fine-tuning (TRL's SFTTrainer) on worked solutions"


def sft_dataset(examples: list[dict], system_prompt: str):
    """Conversational prompt-completion rows: the stage's chat prompt and the problem's worked solution."""
    import datasets

    return datasets.Dataset.from_dict({
        "prompt": [to_messages(ex["question"], system_prompt) for ex in examples],
        "completion": [[{"role": "assistant", "content": worked_solution(ex)}] for ex in examples],
    })


class SftExpTrainer(SFTTrainer):
    """TRL's SFTTrainer with what a grpo-exp stage reads of its trainer: the plan, figures measured between steps
    merged into the next log line (`pending_logs`), an extra loss term (EWC), atomic checkpoints with the run state,
    and no stage mix to restore."""

    def __init__(self, *args, plan: SftPlan, extra_loss=None, run_state: dict | None = None, **kwargs):
        self.speed_plan = plan
        self.extra_loss = extra_loss
        self.run_state = dict(run_state or {})
        self.pending_logs: dict = {}
        self.skipped_steps = 0  # GRPO's dropped updates; an SFT step always trains
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if self.extra_loss is None or not model.training:
            return out
        term = self.extra_loss(self.accelerator.unwrap_model(model))  # its parameter names, not DDP's module.*
        self.pending_logs[self.extra_loss.name] = float(term.detach())
        if return_outputs:
            return out[0] + term, out[1]
        return out + term

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if self.pending_logs and "train_runtime" not in logs:
            logs = {**logs, **self.pending_logs}
            self.pending_logs.clear()
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial):
        atomic_save.save_checkpoint(self, super()._save_checkpoint, model, trial, self.run_state)

    def restore_mix(self, checkpoint: Path, state_file: str) -> None:
        """Nothing to restore: an SFT stage trains on its own stage's problems only."""


def sft_config_kwargs(train_cfg, output_dir: str | Path, precision: str, report_to: list[str],
                      use_cpu: bool) -> dict:
    """cfg.train's optimizer settings as TRL's SFTConfig keyword arguments; the GRPO-only ones (generation,
    rewards, KL) are not read. grpo-export-trl writes the same arguments for an SFT run."""
    return dict(
        output_dir=str(output_dir),
        max_steps=train_cfg.max_steps,
        per_device_train_batch_size=train_cfg.per_device_train_batch_size,
        gradient_accumulation_steps=train_cfg.gradient_accumulation_steps,
        learning_rate=train_cfg.learning_rate,
        lr_scheduler_type=train_cfg.lr_scheduler_type,
        warmup_steps=train_cfg.warmup_steps,
        weight_decay=train_cfg.weight_decay,
        max_grad_norm=train_cfg.max_grad_norm,
        seed=train_cfg.seed,
        data_seed=train_cfg.seed,
        logging_steps=train_cfg.logging_steps,
        save_steps=train_cfg.save_steps,
        save_total_limit=train_cfg.save_total_limit,
        bf16=precision == "bf16",
        fp16=False,
        use_cpu=use_cpu,
        activation_checkpointing=train_cfg.gradient_checkpointing,
        completion_only_loss=True,
        report_to=list(report_to),
        dataset_num_proc=None,
    )


def sft_config(train_cfg, output_dir: Path, precision: str, report_to: list[str]) -> SFTConfig:
    """cfg.train's optimizer settings as TRL's SFTConfig (sft_config_kwargs)."""
    return SFTConfig(**sft_config_kwargs(train_cfg, output_dir, precision, report_to,
                                         use_cpu=not torch.cuda.is_available()))


def build_sft_trainer(cfg, parts, output_dir: str | Path, callbacks: list[TrainerCallback], report_to: list[str],
                      run_state: dict | None, precision: str) -> SftExpTrainer:
    """The SFT stage's trainer, from the stage's parts (training/stage.prepare) and cfg.train."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = sft_config(cfg.train, Path(output_dir) / "checkpoints", precision, report_to)
    return SftExpTrainer(
        model=parts.model,
        args=args,
        train_dataset=sft_dataset(parts.train_examples, cfg.reward.system_prompt),
        processing_class=parts.tokenizer,
        callbacks=callbacks,
        plan=SftPlan(precision, device),
        extra_loss=parts.penalty,
        run_state=run_state,
    )
