"""The GRPO trainer: TRL's GRPOTrainer, built from the Hydra config in one place.

The subclass adds what TRL does not do on its own: an optional extra loss term (EWC) scaled for
gradient accumulation the way TRL scales its own auxiliary losses, and a `completions.jsonl`
sample of prompts, completions and rewards in the run directory.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Callable, Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from grpo_exp.config import resolve_precision

# TrainConfig fields that are not GRPOConfig fields of the same name.
_NOT_GRPO_FIELDS = {"precision", "extra"}


class LossTerm(Protocol):
    """An extra differentiable term added to the GRPO loss (EWC implements it)."""

    name: str

    def __call__(self, model: torch.nn.Module) -> torch.Tensor: ...


def grpo_config(train_cfg, output_dir: str | Path, reward_weights: list[float], report_to: list[str]) -> GRPOConfig:
    """Map `cfg.train` onto GRPOConfig; names are shared, so this is mostly a copy."""
    values = OmegaConf.to_container(train_cfg, resolve=True) if isinstance(train_cfg, DictConfig) else dict(train_cfg)
    extra = values.pop("extra", None) or {}
    precision = resolve_precision(values.pop("precision"))
    kwargs = {k: v for k, v in values.items() if k not in _NOT_GRPO_FIELDS}
    # transformers 5 renamed gradient_checkpointing; passing the new name avoids a deprecation warning,
    # and TRL's own default (True) would otherwise slow a small CPU model by ~20%.
    kwargs["activation_checkpointing"] = kwargs.pop("gradient_checkpointing")
    kwargs.update(extra)
    # transformers only allows bf16 autocast on the CPU when told the run is CPU-only.
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    return GRPOConfig(
        output_dir=str(output_dir),
        # GRPOConfig defaults to bf16=True; say fp32 explicitly when asked for it.
        bf16=precision == "bf16",
        fp16=False,
        data_seed=kwargs.get("seed"),
        reward_weights=list(reward_weights),
        report_to=report_to,
        save_strategy="steps",
        logging_strategy="steps",
        disable_tqdm=False,
        log_completions=False,
        dataloader_num_workers=0,
        **kwargs,
    )


class GrpoExpTrainer(GRPOTrainer):
    def __init__(self, *args, extra_loss: LossTerm | None = None, completions_path: str | Path | None = None,
                 completions_every: int = 5, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra_loss = extra_loss
        self.completions_path = Path(completions_path) if completions_path else None
        self.completions_every = completions_every
        self._last_sampled_step = -1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.extra_loss is None or not model.training:
            return loss
        return loss + self.extra_loss_term(model)

    def extra_loss_term(self, model) -> torch.Tensor:
        """The extra term for one micro-batch: logged at full value, added at 1/accumulation steps."""
        term = self.extra_loss(model)
        self._metrics["train"][self.extra_loss.name].append(float(term.detach()))
        # TRL scales the policy loss for gradient accumulation itself (HF auto-scaling is off), so scale ours too:
        # the accumulated gradient then equals one full-batch gradient of the term.
        return term / self.current_gradient_accumulation_steps

    def log(self, logs: dict, start_time: float | None = None) -> None:
        step = self.state.global_step
        if (self.completions_path is not None and self.model.training and step != self._last_sampled_step
                and (step == 1 or step % self.completions_every == 0) and self._logs["prompt"]):
            self._last_sampled_step = step
            self._write_completions(step)
        super().log(logs, start_time)

    def _write_completions(self, step: int) -> None:
        rewards = {name: list(vals) for name, vals in self._logs["rewards"].items()}
        with self.completions_path.open("a") as fh:
            for i, (prompt, completion) in enumerate(zip(self._logs["prompt"], self._logs["completion"])):
                row = {
                    "step": step,
                    "prompt": prompt[-1]["content"] if isinstance(prompt, list) else prompt,
                    "completion": completion[-1]["content"] if isinstance(completion, list) else completion,
                    "rewards": {name: vals[i] for name, vals in rewards.items() if i < len(vals)},
                    "advantage": self._logs["advantages"][i] if i < len(self._logs["advantages"]) else None,
                }
                fh.write(json.dumps(row) + "\n")


class GracefulStop(TrainerCallback):
    """First Ctrl-C/SIGTERM: finish the current step, save a checkpoint and stop. Second: abort now."""

    def __init__(self):
        self.signal_received: int | None = None
        self._previous = {}

    def install(self) -> "GracefulStop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        if self.signal_received is not None:
            raise KeyboardInterrupt
        self.signal_received = signum
        print(f"\n[grpo-exp] {signal.Signals(signum).name} received: saving a checkpoint after this step "
              f"(press Ctrl-C again to abort at once)", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.signal_received is not None:
            control.should_save = True
            control.should_training_stop = True
        return control


def build_trainer(cfg, model, tokenizer, train_dataset, reward_funcs: list[Callable], reward_weights: list[float],
                  output_dir: str | Path, callbacks: list[TrainerCallback], extra_loss: LossTerm | None = None,
                  report_to: list[str] | None = None) -> GrpoExpTrainer:
    """The one place a trainer is made from a config."""
    args = grpo_config(cfg.train, Path(output_dir) / "checkpoints", reward_weights, report_to or [])
    return GrpoExpTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
        extra_loss=extra_loss,
        completions_path=Path(output_dir) / "completions.jsonl",
        completions_every=cfg.completions_every,
    )


def completions_per_step(train_cfg) -> int:
    """Completions consumed by one optimizer step (TRL counts batch sizes in completions)."""
    return train_cfg.per_device_train_batch_size * train_cfg.gradient_accumulation_steps

