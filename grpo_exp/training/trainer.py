"""The GRPO trainer: TRL's GRPOTrainer subclassed (GrpoExpTrainer) and built from the Hydra config in one place."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import RepeatSampler

from grpo_exp.base import dist, log
from grpo_exp.config.speed import SpeedPlan, plan_for
from grpo_exp.kernels import attention, embedding_grad
from grpo_exp.training import atomic_save, guards, plan_fit, scoring, shared_prefix, stop_save
from grpo_exp.training.completions_log import CompletionsSample
from grpo_exp.training.curriculum.mix import AdaptiveSampler, StageMix, StageMixing, lag_rounds, pass_column
from grpo_exp.training.curriculum.replay import mix_stages
from grpo_exp.training.dynamic_sampling import DynamicSampling
from grpo_exp.training.rollout import trl_hook
from grpo_exp.training.rollout.old_logps import OldLogps

logger = log.get_logger(__name__)

# TrainConfig fields that are not GRPOConfig fields of the same name.
_NOT_GRPO_FIELDS = {"precision", "extra", "dynamic_sampling", "dynamic_sampling_max_draws", "method", "stop_at_accuracy",
                    "anytime", "keep_final_checkpoint"}


class LossTerm(Protocol):
    """An extra differentiable term added to the GRPO loss (EWC implements it)."""

    name: str

    def __call__(self, model: torch.nn.Module) -> torch.Tensor: ...


def grpo_config(train_cfg, output_dir: str | Path, reward_weights: list[float], report_to: list[str],
                plan: SpeedPlan) -> GRPOConfig:
    """Map `cfg.train` onto GRPOConfig (names are shared, so this is mostly a copy), with the speed plan's
    precision and, on the engine's and vLLM's paths, its importance-sampling settings."""
    return GRPOConfig(**grpo_config_kwargs(train_cfg, output_dir, reward_weights, report_to, plan))


def grpo_config_kwargs(train_cfg, output_dir: str | Path, reward_weights: list[float], report_to: list[str],
                       plan: SpeedPlan) -> dict:
    """The keyword arguments grpo_config gives GRPOConfig (grpo-export-trl writes them as TRL's YAML)."""
    values = OmegaConf.to_container(train_cfg, resolve=True) if isinstance(train_cfg, DictConfig) else dict(train_cfg)
    extra = values.pop("extra", None) or {}
    values.pop("precision")
    precision = plan.precision
    kwargs = {k: v for k, v in values.items() if k not in _NOT_GRPO_FIELDS}
    # transformers 5 renamed gradient_checkpointing; passing the new name avoids a deprecation warning,
    # and TRL's own default (True) would otherwise recompute the activations a small CPU model can afford to keep.
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(GRPOConfig)}:  # older releases lack it
        kwargs["activation_checkpointing"] = kwargs.pop("gradient_checkpointing")
    if plan.generation == "engine":
        # TRL's importance-sampling correction of vLLM rollouts, which the engine turns on
        # (training/rollout/trl_hook.py); with the sampler's log-probs as the old ones there is nothing to weigh against
        kwargs.update(vllm_importance_sampling_correction=plan.is_correction and plan.old_logps == "policy",
                      vllm_importance_sampling_mode=plan.is_mode, vllm_importance_sampling_clip_max=plan.is_cap)
    elif plan.generation == "vllm" and not extra.get("use_vllm"):  # (train.extra.use_vllm: TRL's vLLM as extra says)
        # TRL's own vLLM, colocated: one engine in each training process on its GPU, its weights synced from the policy
        # every step; like the engine's copy it samples from other arithmetic than the trained policy, so the same
        # speed.is_* correction applies (TRL's defaults would be sequence_mask, not the engine's token_truncate)
        kwargs.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=plan.vllm_memory,
                      vllm_importance_sampling_correction=plan.is_correction,
                      vllm_importance_sampling_mode=plan.is_mode, vllm_importance_sampling_clip_max=plan.is_cap)
    kwargs.update(extra)
    # transformers only allows bf16 autocast on the CPU when told the run is CPU-only.
    kwargs.setdefault("use_cpu", not torch.cuda.is_available())
    return dict(
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


class EpochSeededSampler(RepeatSampler):
    """TRL's RepeatSampler with each epoch's shuffle seeded by (seed, epoch). TRL's carries one generator
    across epochs, so a run resumed in epoch e drew epoch 0's order again and lost bit-exactness with an
    uninterrupted run (the soak test in tests/training/test_reliability.py found it); HF calls set_epoch."""

    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            self.generator.manual_seed((self.seed or 0) + 1_000_003 * self.epoch)
        return super().__iter__()


class GrpoExpTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with what TRL does not do on its own, each part an object of its own module that the
    trainer's overrides of TRL's hooks call in a stated order: an extra loss term (EWC), the scoring forward
    (training/scoring.py: shared-prefix scoring, lean saved tensors, the lean KL reference), grpo-exp's rollout engine
    (training/rollout/) and where the old log-probs come from (rollout/old_logps.OldLogps), the round guard
    (guards.RoundGuard: non-finite values, stops), dynamic sampling (dynamic_sampling.DynamicSampling), a training set
    that mixes stages (curriculum/mix.StageMixing: replay's and the adaptive curriculum's figures, the adaptive
    sampler), atomic checkpoints (atomic_save) and the completions sample (completions_log). The speed plan it
    runs was fitted to the model before it was built (training/plan_fit) and is never replaced.

    Private methods of TRL's it overrides (the last three are HF Trainer's, overridden by TRL in turn):
    - `_get_per_token_logps_and_entropies`: every scoring forward; the old log-probs' stand-in, else the plan's
      forward, then what a training forward measures (the sampler's mismatch) or gives (old log-probs by batch).
    - `_generate_and_score_completions`: one generation round (its docstring gives the order of the parts).
    - `_calculate_rewards`: TRL's; the round's gathered rewards go to dynamic sampling and the stage mix.
    - `_prepare_inputs`: a new round clears the round guard, and a deferred round is scored batch by batch once TRL
      has split it into batches.
    - `_get_train_sampler`: TRL's RepeatSampler reseeded per epoch, so that a resumed run draws an uninterrupted
      run's order; the adaptive curriculum's sampler in its place (curriculum.mode=adaptive).
    - `_save_checkpoint`: written into a staging directory and renamed into place, with grpo-exp's run state.
    Public ones: `compute_loss` (the EWC term, the loss guard, the batches whose own forward gives their old
    log-probs) and `log` (the completions sample, figures measured between steps). For a stop (base/stop.py) it
    hooks the policy's input embedding (guards.stop_points) and wraps the callback handler's `on_step_end`
    (stop_save.StepEndState). It relies on TRL's `_compute_loss` and `training_step` (`_step` counts micro-batches),
    calls HF's `_get_output_dir`, and reads TRL's private state, which a TRL upgrade may rename.
    tests/training/test_trl_hooks.py records each of these at trl 1.16.0 and fails, naming it and what to re-check,
    when an upgrade changes one (docs/architecture.md, "TRL's private hooks").

    Why it impersonates vLLM on the engine's path (TRL applies its importance-sampling correction to vLLM rollouts
    only; no vLLM involved, nothing impersonated beside TRL's real one): rollout/trl_hook.enable_is_correction.
    """

    def __init__(self, *args, plan: SpeedPlan, extra_loss: LossTerm | None = None,
                 completions_path: str | Path | None = None, completions_every: int = 5, on_nonfinite: str = "stop",
                 run_state: dict | None = None, dynamic_draws: int | None = None, mix_stages: list[str] | None = None,
                 stage_mix: StageMix | None = None, **kwargs):
        self.speed_plan = plan  # fitted to this model (training/plan_fit): what ran, as speed_plan.json records it
        self.round_guard = guards.RoundGuard(on_nonfinite)
        kwargs["reward_funcs"] = [self.round_guard.reward(self, f) for f in kwargs["reward_funcs"]]
        super().__init__(*args, **kwargs)
        self.add_callback(guards.DropPoisonedUpdates(self, self.round_guard))
        self.dynamic_sampling = DynamicSampling(dynamic_draws) if dynamic_draws is not None else None
        self.stage_mixing = StageMixing(self, mix_stages, stage_mix)
        if stage_mix is not None:
            pass_column(list(self.reward_func_names))  # the reward it reads passes from, or one line saying so
            stage_mix.lag = lag_rounds(self.args.gradient_accumulation_steps,
                                       self.args.steps_per_generation * self.num_iterations)
        if self.ref_model is not None:
            # TRL loads the KL reference afresh, with transformers' attention; with the policy's attention the
            # KL at a step where the two hold the same weights is 0, not a rounding difference
            attention.use(self.accelerator.unwrap_model(self.ref_model), plan.attention, plan.attention_decode)
        if plan.lean_reference:
            scoring.shrink_reference(self)
        self.extra_loss = extra_loss
        self.completions_sample = CompletionsSample(completions_path, completions_every)
        self.run_state = run_state or {}
        # figures measured outside the step (held-out accuracy): merged into the next log row
        self.pending_logs: dict = {}
        # speed.generation=engine: grpo-exp's sampler through TRL's rollout_func (None: TRL's generate or vLLM)
        self.rollout_engine = trl_hook.build_engine(self, plan) if plan.generation == "engine" else None
        self.old_logps = OldLogps(self, self.rollout_engine, plan)
        # a stop (base/stop.py) abandons the step in progress at any forward of the policy; what it keeps: stop_save
        self._stop_hook = guards.stop_points(self.model)
        self.step_end = stop_save.StepEndState(self)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the round guard dropped (metrics.json's skipped_steps)."""
        return self.round_guard.skipped_steps

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **model_kwargs):
        """Every scoring forward: the old log-probs' stand-in where one answers without a forward, else the plan's
        forward (training/scoring.py); then what a training forward measures or gives (rollout/old_logps)."""
        scored = self.old_logps.stand_in(model, input_ids, logits_to_keep, compute_entropy)
        if scored is None:
            scored = scoring.forward(self, super()._get_per_token_logps_and_entropies, model, input_ids,
                                     attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                                     **model_kwargs)
        self.old_logps.after_forward(scored)
        return scored

    def _generate_and_score_completions(self, inputs):
        """One generation round, its parts in this order, outermost first: the old log-probs (the round's scoring
        deferred to its batches, the sampler's mismatch logged: rollout/old_logps), the stage mix's pass counts
        (adaptive: curriculum/mix), dynamic sampling's rounds (train.dynamic_sampling: each all-equal group replaced
        from extra rounds), and for each round TRL's own generation and scoring. So dynamic sampling's extra rounds
        count towards the adaptive pass rates, and a deferred scoring covers every round spliced into the batch."""
        generate = super()._generate_and_score_completions
        if self.model.training and self.dynamic_sampling is not None:
            trl_round = generate
            generate = lambda batch: self.dynamic_sampling.fill(self, batch, trl_round, self.round_guard)  # noqa: E731
        if self.model.training and self.stage_mixing.stage_mix is not None:
            rounds = generate
            generate = lambda batch: self.stage_mixing.count_round(rounds, batch)  # noqa: E731
        return self.old_logps.round(generate, inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's; the round's gathered rewards decide dynamic sampling's all-equal groups and the stages' passes."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.dynamic_sampling is not None:
            self.dynamic_sampling.observe(rewards)
        self.stage_mixing.observe(inputs, rewards)
        return rewards

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if self.stage_mixing.stage_mix is not None:  # same fields; each round's prompts drawn by the pass rates
            dataset = self.train_dataset if dataset is None else dataset
            return AdaptiveSampler.wrap(sampler, self.stage_mixing.stage_mix, list(dataset["stage"]))
        sampler.__class__ = EpochSeededSampler  # same fields; only the per-epoch seeding differs
        return sampler

    def _prepare_inputs(self, generation_batch):
        """TRL's: a new generation round starts clean (its rewards may poison it again), and a round whose scoring
        was deferred is scored batch by batch."""
        self.round_guard.start_round(self)
        inputs = super()._prepare_inputs(generation_batch)
        self.old_logps.after_prepare()
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.old_logps.before_loss(model, inputs)
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.old_logps.after_loss()
        if self.extra_loss is not None and model.training:
            loss = loss + self.extra_loss_term(model)
        return self.round_guard.loss(self, model, loss)

    def _save_checkpoint(self, model, trial):
        """HF's checkpoint, written into a staging directory and renamed into place when complete (atomic_save)."""
        atomic_save.save_checkpoint(self, super()._save_checkpoint, model, trial,
                                    {**self.run_state, **self.stage_mixing.state()})

    def restore_mix(self, checkpoint: Path, state_file: str) -> None:
        """The adaptive curriculum's pass rates a checkpoint saved, put back before training resumes from it."""
        self.stage_mixing.restore(checkpoint, state_file)

    def extra_loss_term(self, model) -> torch.Tensor:
        """The extra term for one micro-batch: logged at full value, added at 1/accumulation steps."""
        term = self.extra_loss(self.accelerator.unwrap_model(model))  # its parameter names, not DDP's module.*
        self._metrics["train"][self.extra_loss.name].append(float(term.detach()))
        # TRL scales the policy loss for gradient accumulation itself (HF auto-scaling is off), so scale ours too:
        # the accumulated gradient then equals one full-batch gradient of the term.
        return term / self.current_gradient_accumulation_steps

    def log(self, logs: dict, start_time: float | None = None) -> None:
        self.completions_sample.maybe_write(self)
        if self.pending_logs and "train_runtime" not in logs:
            logs = {**logs, **self.pending_logs}
            self.pending_logs.clear()
        super().log(logs, start_time)


def build_trainer(cfg, parts, output_dir: str | Path, callbacks: list[TrainerCallback],
                  report_to: list[str] | None = None, run_state: dict | None = None,
                  plan: SpeedPlan | None = None) -> GrpoExpTrainer:
    """The one place a trainer is made: a stage's parts (training.stage.prepare), cfg.train and the speed plan
    (config/speed.plan_for(cfg), the one the settings record holds; a test may pass a plan of its own to compare two
    of them), fitted here to the model once, before the trainer is built (training/plan_fit.fit)."""
    if cfg.train.get("method", "grpo") == "sft":  # TRL's SFTTrainer on worked solutions (training/sft.py)
        from grpo_exp.training.sft import build_sft_trainer

        return build_sft_trainer(cfg, parts, output_dir, callbacks, report_to or [], run_state,
                                 (plan or plan_for(cfg)).precision)
    plan = plan_fit.fit(plan or plan_for(cfg), cfg, parts.model, parts.tokenizer)
    logger.debug("speed plan: %s", ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(plan).items()))
    args = grpo_config(cfg.train, Path(output_dir) / "checkpoints", parts.reward_weights, report_to or [], plan)
    policy = shared_prefix.scoring_model(parts.model)  # a peft wrapper's inner model, whose attention runs
    logger.debug("speed.attention=%s: %s", plan.attention,
                attention.use(policy, plan.attention, plan.attention_decode) or policy.config._attn_implementation)
    # the same gradients, without a vocabulary-sized buffer per lookup (where the input embedding is the tied head)
    if plan.embedding_grad and embedding_grad.install(policy):
        logger.debug("input embedding tied to the LM head: its gradient is taken as the rows its tokens touch")
    return GrpoExpTrainer(
        model=parts.model,
        reward_funcs=parts.reward_funcs,
        args=args,
        train_dataset=parts.train_dataset,
        processing_class=parts.tokenizer,
        callbacks=callbacks,
        extra_loss=parts.penalty,
        # TRL gathers the prompts and completions it logs on every rank; rank 0 writes them
        completions_path=Path(output_dir) / "completions.jsonl" if dist.is_main() else None,
        completions_every=cfg.completions_every,
        on_nonfinite=cfg.on_nonfinite,
        run_state=run_state,
        plan=plan,
        dynamic_draws=cfg.train.dynamic_sampling_max_draws if cfg.train.dynamic_sampling else None,
        mix_stages=mix_stages(cfg),
        stage_mix=StageMix.from_config(cfg.curriculum) if cfg.curriculum.mode == "adaptive" else None,
    )


def completions_per_step(train_cfg) -> int:
    """Completions consumed by one optimizer step (TRL counts batch sizes in completions)."""
    return train_cfg.per_device_train_batch_size * train_cfg.gradient_accumulation_steps
