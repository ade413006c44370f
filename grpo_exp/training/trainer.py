"""The GRPO trainer: TRL's GRPOTrainer subclassed (GrpoExpTrainer) and built from the Hydra config in one place."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import DictConfig, OmegaConf
from transformers import TrainerCallback
from transformers.trainer_utils import rotate_checkpoints
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import RepeatSampler

from grpo_exp.base import dist, log
from grpo_exp.base.errors import DiskFullError
from grpo_exp.base.io import disk_full_reason, state_bytes
from grpo_exp.config.speed import SpeedPlan, resolve
from grpo_exp.kernels import attention, embedding_grad, lean_reference, lean_saved
from grpo_exp.training import checkpoints, guards, shared_prefix, stop_save
from grpo_exp.training.curriculum.mix import AdaptiveSampler, StageMix, StageMixing, lag_rounds, pass_column
from grpo_exp.training.dynamic_sampling import DynamicSampling
from grpo_exp.training.curriculum.replay import mix_stages
from grpo_exp.training.rollout import importance, trl_hook
from grpo_exp.training.rollout.old_logps import padded_logps

logger = log.get_logger(__name__)

# TrainConfig fields that are not GRPOConfig fields of the same name.
_NOT_GRPO_FIELDS = {"precision", "extra", "dynamic_sampling", "dynamic_sampling_max_draws"}


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
    elif plan.generation == "vllm":
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


class GrpoExpTrainer(StageMixing, DynamicSampling, GRPOTrainer):
    """TRL's GRPOTrainer with what TRL does not do on its own: an extra loss term (EWC), shared-prefix scoring,
    grpo-exp's rollout engine (training/rollout/), the guards (training/guards.py), dynamic sampling
    (training/dynamic_sampling.py, a mixin), a training set that mixes stages (training/adaptive.py, a mixin: replay's
    and the adaptive curriculum's figures, the adaptive sampler), atomic checkpoints and a `completions.jsonl` sample.

    Private methods of TRL's it overrides (the last three are HF Trainer's, overridden by TRL in turn):
    - `_get_per_token_logps_and_entropies`: every scoring forward passes here, so that the sampler's log-probs can
      stand in for the policy's no-grad scoring, the shared-prefix forward and lean saved tensors can run, and the
      sampler's mismatch can be measured on a training forward (`_scored`, `_forward`).
    - `_generate_and_score_completions`: to defer a round's old-log-prob scoring to its batches
      (speed.exact_shortcuts) and to log the sampler's mismatch each round; below it, the DynamicSampling mixin's
      runs TRL's once per round it draws (train.dynamic_sampling) and splices the kept groups into one batch.
    - `_calculate_rewards` (DynamicSampling): TRL's, keeping the round's gathered rewards (`_round_rewards`) that
      decide which groups are all equal.
    - `_prepare_inputs`: a new round clears the non-finite guard, and a deferred round is scored batch by batch
      (`_score_round`) once TRL has split it into batches.
    - `_get_train_sampler`: TRL's RepeatSampler reseeded per epoch, so that a resumed run draws an uninterrupted
      run's order; the adaptive curriculum's sampler in its place (curriculum.mode=adaptive).
    - `_save_checkpoint`: the checkpoint written into a staging directory and renamed into place, with grpo-exp's
      run state, so that a kill leaves the last complete one.
    Public ones: `compute_loss` (the EWC term, the loss guard, the batches whose own forward gives their old
    log-probs) and `log` (the completions sample, figures measured between steps). For a stop (base/stop.py) it
    hooks the policy's input embedding (guards.stop_points) and wraps the callback handler's `on_step_end`
    (stop_save.StepEndState, whose `save_on_stop` writes the checkpoint a stop keeps). It relies on TRL's
    `_compute_loss` and `training_step` (`_step` counts micro-batches), calls HF's `_get_output_dir`, and reads TRL's
    private state (`_step`, `_buffered_inputs`, `_metrics`, `_logs`; for the engine `_generate`'s rollout_func,
    `_tokenize_prompts`, `_tokenizer`, `_is_vlm`, `_last_loaded_step`), which a TRL upgrade may rename.
    tests/training/test_trl_hooks.py records each of these at trl 1.16.0 and fails, naming it and what to re-check,
    when an upgrade changes one (docs/architecture.md, "TRL's private hooks").

    Why it impersonates vLLM: TRL's importance-sampling correction (each token's loss weighed by pi_train /
    pi_sampler, truncated or masked at a cap, after a scoring forward by the policy) runs only when `use_vllm`
    and `vllm_importance_sampling_correction` are set. The engine's copy (a bf16 one, say) is, like vLLM, a
    sampler that is not quite the trained policy, so rollout/trl_hook.enable_is_correction sets those flags and
    stubs vLLM's weight sync (the engine refreshes its copy itself): TRL applies its own correction, no vLLM
    involved. With speed.generation=vllm TRL's real vLLM samples (colocated, `use_vllm` in GRPOConfig), no engine is
    built and nothing is impersonated; enable_is_correction refuses a trainer that has a real one.
    """

    def __init__(self, *args, extra_loss: LossTerm | None = None, completions_path: str | Path | None = None,
                 completions_every: int = 5, on_nonfinite: str = "stop", run_state: dict | None = None,
                 plan: SpeedPlan, dynamic_draws: int | None = None, mix_stages: list[str] | None = None,
                 stage_mix: StageMix | None = None, **kwargs):
        self.on_nonfinite = on_nonfinite
        self.dynamic_draws = dynamic_draws  # train.dynamic_sampling_max_draws; None: dynamic sampling off
        self.mix_stages, self.stage_mix = mix_stages, stage_mix  # a training set of several stages (adaptive.py)
        # on_nonfinite=skip: a NaN/inf reward poisons its whole generation round (every optimizer step that
        # trains on it), a NaN/inf loss the rest of its round; poisoned steps change no parameter or state
        self._round_poisoned: str | None = None  # why the current generation round is poisoned
        self._drop_update = False  # the optimizer step being accumulated must not happen
        self.skipped_steps = 0
        kwargs["reward_funcs"] = [guards.guard_reward(self, f) for f in kwargs["reward_funcs"]]
        super().__init__(*args, **kwargs)
        self.add_callback(guards.DropPoisonedUpdates(self))
        if stage_mix is not None:
            pass_column(list(self.reward_func_names))  # the reward it reads passes from, or one line saying so
            stage_mix.lag = lag_rounds(self.args.gradient_accumulation_steps,
                                       self.args.steps_per_generation * self.num_iterations)
        if self.ref_model is not None:
            # TRL loads the KL reference afresh, with transformers' attention; with the policy's attention the
            # KL at a step where the two hold the same weights is 0, not a rounding difference
            attention.use(self.accelerator.unwrap_model(self.ref_model), plan.attention, plan.attention_decode)
        if plan.lean_reference and not self._shrink_reference():
            plan = dataclasses.replace(plan, lean_reference=False)
        self.extra_loss = extra_loss
        self.completions_path = Path(completions_path) if completions_path else None
        self.completions_every = completions_every
        self.run_state = run_state or {}
        self._last_sampled_step = -1
        # figures measured outside the step (held-out accuracy): merged into the next log row
        self.pending_logs: dict = {}
        if plan.shared_prefix:
            why_not = shared_prefix.unsupported_reason(self.model) or (
                "train.extra.cast_lm_head_to_fp32" if self.args.cast_lm_head_to_fp32 else None)
            if why_not:
                logger.info("shared-prefix scoring off for %s; TRL's own forward scores the batch", why_not)
                plan = dataclasses.replace(plan, shared_prefix=False)
        if self.args.use_vllm and plan.generation != "vllm":
            # train.extra.use_vllm (vLLM's server mode, say): TRL's vLLM samples, not the engine or generate, and the
            # plan records what ran; the engine declines such a trainer (trl_hook.unsupported_reason)
            logger.info("train.extra.use_vllm: TRL's vLLM (%s mode) samples, not speed.generation=%s",
                        self.args.vllm_mode, plan.generation)
            plan = dataclasses.replace(plan, generation="vllm", rollout_dtype=None, rollout_compile=False,
                                       rollout_prepack=False, old_logps=None,
                                       vllm_memory=self.args.vllm_gpu_memory_utilization)
        # speed.generation=engine: grpo-exp's sampler through TRL's rollout_func (None: TRL's generate or vLLM)
        self.rollout_engine = trl_hook.build_engine(self, plan) if plan.generation == "engine" else None
        if plan.generation == "engine" and self.rollout_engine is None:
            plan = dataclasses.replace(plan, generation="trl", rollout_dtype=None, rollout_compile=False,
                                       rollout_prepack=False, old_logps=None)
        # what this trainer runs: the resolved plan less what this model or TRL setting forced off
        self.speed_plan = plan
        self.share_prefixes = plan.shared_prefix
        self.logprob_kernel = plan.logprob_kernel
        self.saved_tensors = plan.saved_tensors
        logger.info("speed plan: %s", ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(plan).items()))
        # (the sampler's log-probs, completion mask) of a batch whose training forward measures the mismatch
        self._mismatch_batch: tuple[torch.Tensor, torch.Tensor] | None = None
        # Old log-probs by batch (see _score_round): TRL's scoring of each round is deferred to its batches
        # (where a round's batches and the optimizer steps line up, so it is known which batches meet the policy
        # that sampled them)
        spg, accumulation = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        self.score_by_batch = (self.rollout_engine is not None and self.use_vllm
                               and self.vllm_importance_sampling_correction and self.num_iterations == 1
                               and (spg % accumulation == 0 or accumulation % spg == 0)
                               and plan.scoring == "batch")
        self._round_step = -1  # the optimizer step the current round's on-policy batches belong to
        self._deferring = False  # TRL is generating a round whose scoring forward is deferred
        self._round_to_score = False  # a round was generated whose batches are not scored yet
        self._on_policy: list[dict] = []  # this round's batches that their own training forward scores
        self._weigh_in_forward: dict | None = None  # the batch whose training forward is running
        # a stop (base/stop.py) abandons the step in progress at any forward of the policy; what it keeps: stop_save
        self._stop_hook = guards.stop_points(self.model)
        self.step_end = stop_save.StepEndState(self)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **model_kwargs):
        """TRL's scoring forward (`_scored`); on the training forward of a batch marked by compute_loss, the
        sampler's mismatch with the trained policy is measured on the way."""
        scored = self._scored(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                              compute_aux_loss, **model_kwargs)
        inputs, self._weigh_in_forward = self._weigh_in_forward, None
        if inputs is not None and torch.is_grad_enabled():
            # the policy has not moved since it sampled this batch: its training forward's log-probs are the old ones
            self._weigh(inputs, scored[0].detach())
        batch, self._mismatch_batch = self._mismatch_batch, None
        if batch is not None:  # on every process alike: _mismatch gathers
            sampler, mask = batch
            if scored[0].shape != sampler.shape:  # nothing comparable here: this process adds no tokens
                sampler, mask = scored[0].detach(), torch.zeros_like(scored[0], dtype=torch.long)
            stats = self._mismatch(scored[0].detach(), sampler, mask, "token_mask", None, None)
            for key in ("rollout/kl", "rollout/logp_diff_abs"):  # nothing is capped: no clipped share
                self._metrics["train"][key].append(stats[key])
        return scored

    def _shrink_reference(self) -> bool:
        """speed.exact_shortcuts: the KL reference's Linear weights in bf16, off the model file's map, where its
        forwards run under bf16 autocast (kernels/lean_reference.py); False where it is kept as TRL loads it."""
        amp = self.accelerator.native_amp and self.accelerator.mixed_precision == "bf16"
        reference = self.accelerator.unwrap_model(self.ref_model) if self.ref_model is not None else None
        why_not = lean_reference.unsupported_reason(
            reference, autocast_dtype=torch.bfloat16 if amp else None,
            syncs_with_policy=bool(self.args.sync_ref_model), head_in_fp32=bool(self.args.cast_lm_head_to_fp32))
        if why_not:
            logger.info("lean reference: the KL reference kept as TRL loads it (%s)", why_not)
            return False
        before, after = lean_reference.shrink(reference, torch.bfloat16)
        logger.info("lean reference: the KL reference's Linear weights in bf16 (%.0f MB of parameters, "
                    "%.0f before), off the model file's memory map", after / 2**20, before / 2**20)
        return True

    def _scored(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                compute_aux_loss=False, **model_kwargs):
        """TRL's scoring forward, with each distinct prompt run once per chunk (speed.exact_shortcuts).

        With speed.old_logps=sampler, TRL's no-grad scoring of the round by the policy (its old
        log-probs) takes the engine's sampling log-probs instead of a forward."""
        engine = self.rollout_engine
        if (engine is not None and engine.pending_logps is not None and model is self.model
                and not torch.is_grad_enabled() and not compute_entropy):
            rows, engine.pending_logps = engine.pending_logps, None
            if len(rows) != input_ids.size(0):
                raise RuntimeError(f"the rollout returned {len(rows)} completions; TRL scores {input_ids.size(0)}")
            return padded_logps(rows, logits_to_keep, input_ids.device), None, None
        if self._deferring and model is self.model and not torch.is_grad_enabled():
            # TRL's scoring of the whole round for its later batches: each batch is scored instead (_score_round)
            return torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device), None, None
        if self.saved_tensors == "lean" and model.training and torch.is_grad_enabled():
            with lean_saved.lean_forward(self.accelerator.unwrap_model(model)):
                return self._forward(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                     compute_aux_loss, **model_kwargs)
        return self._forward(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                             compute_aux_loss, **model_kwargs)

    def _forward(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                 compute_aux_loss=False, **model_kwargs):
        """The forward of `_scored`: the shared-prefix scoring, or TRL's."""
        # Gradient checkpointing drops the KV cache the completions need; TRL itself turns it off under no_grad.
        checkpointing = model.training and torch.is_grad_enabled() and shared_prefix.checkpointing(model)
        if (not self.share_prefixes or checkpointing or compute_aux_loss
                or any(v is not None for v in model_kwargs.values())):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, compute_entropy, compute_aux_loss,
                                                              **model_kwargs)
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            with self.accelerator.autocast():
                scored = shared_prefix.completion_logps(model, ids, mask, logits_to_keep, self.temperature,
                                                        compute_entropy, self.logprob_kernel)
            if scored is None:  # no prompt repeats in this chunk
                scored = super()._get_per_token_logps_and_entropies(model, ids, mask, logits_to_keep,
                                                                    compute_entropy=compute_entropy)[:2]
            logps.append(scored[0])
            entropies.append(scored[1])
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _generate_and_score_completions(self, inputs):
        """TRL's; with the rollout engine, the sampler's mismatch with the trained policy is logged every round."""
        deferred = self.score_by_batch and self.model.training
        if deferred:  # TRL neither scores nor weighs the round: _score_round does, batch by batch
            self._deferring, self.vllm_importance_sampling_correction = True, False
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            if deferred:
                self._deferring, self.vllm_importance_sampling_correction = False, True
        self._round_to_score = deferred
        if self.rollout_engine is not None:
            self.rollout_engine.pending_logps = None  # unused when TRL needed no old log-probs this round
        # (with the sampler's log-probs as the old ones the mismatch is 0 by construction: not logged)
        if (self.rollout_engine is not None and not self.rollout_engine.keep_logps and not deferred
                and "old_per_token_logps" in output):
            stats = self._mismatch(output["old_per_token_logps"], output["sampling_per_token_logps"],
                                   output["completion_mask"], self.args.vllm_importance_sampling_mode,
                                   self.args.vllm_importance_sampling_clip_max,
                                   self.args.vllm_importance_sampling_clip_min)
            mode = "train" if self.model.training else "eval"
            for key in ("rollout/kl", "rollout/clipped_frac", "rollout/logp_diff_abs"):
                self._metrics[mode][key].append(stats[key])
        return output

    def _mismatch(self, old_logps, sampling_logps, mask, mode: str, cap, floor) -> dict[str, float]:
        """The sampler's mismatch over every process's batch (importance.mismatch_from_totals): each process's totals
        are gathered, so a data-parallel run logs all of its tokens, not the main process's alone. Every process
        reaches this at the same point of a step (a collective)."""
        totals = importance.mismatch_totals(old_logps, sampling_logps, mask, mode, cap, floor)
        totals = self.accelerator.gather(totals.to(self.accelerator.device)[None]).cpu()
        return importance.mismatch_from_totals(totals)

    def _get_train_sampler(self, dataset=None):
        sampler = super()._get_train_sampler(dataset)
        if self.stage_mix is not None:  # same fields; each round's prompts drawn by the stages' pass rates
            dataset = self.train_dataset if dataset is None else dataset
            return AdaptiveSampler.wrap(sampler, self.stage_mix, list(dataset["stage"]))
        sampler.__class__ = EpochSeededSampler  # same fields; only the per-epoch seeding differs
        return sampler

    def _prepare_inputs(self, generation_batch):
        """TRL's: a new generation round starts clean (its rewards may poison it again)."""
        guards.start_round(self)
        inputs = super()._prepare_inputs(generation_batch)
        if self._round_to_score:
            self._round_to_score = False
            self._score_round()
        return inputs

    def _score_round(self) -> None:
        """PPO's old log-probs and the importance weights of a new round, batch by batch (speed.exact_shortcuts).

        TRL scores the whole round with the policy before training on it. The batches trained before the next
        optimizer step meet a policy that has not moved since it sampled them, so their own training forward
        gives those log-probs (TRL's rule for on-policy batches: the old log-probs are the current ones,
        detached); the weights are taken there (_weigh). Only the later batches are scored now, before the policy
        moves: for the default's two steps a round, half of TRL's scoring forward."""
        batches = self._buffered_inputs
        accumulation = self.args.gradient_accumulation_steps
        on_policy = min(len(batches), accumulation - self._step % accumulation)  # until the next optimizer step
        self._on_policy, self._round_step = batches[:on_policy], self.state.global_step
        for batch in self._on_policy:
            batch.pop("old_per_token_logps", None)
        for batch in batches[on_policy:]:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, mask,
                                                                     batch["completion_ids"].size(1),
                                                                     batch_size=self.args.per_device_train_batch_size)
            self._weigh(batch, old)

    def _weigh(self, batch: dict, old_logps: torch.Tensor) -> None:
        """Store a batch's old log-probs and TRL's importance weights for its sampler's mismatch, and log the
        mismatch: what TRL's _generate_and_score_completions does for a whole round under vLLM."""
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        sampling, mode = batch["sampling_per_token_logps"], self.vllm_importance_sampling_mode
        floor, cap = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        weights, _ = importance.is_weights(old_logps, sampling, mask, mode, cap, floor)
        batch["old_per_token_logps"], batch["importance_sampling_ratio"] = old_logps, weights
        # with TRL's own names (sampling/*) for the same figures, where any process had a valid token
        for key, value in self._mismatch(old_logps, sampling, mask, mode, cap, floor).items():
            self._metrics["train"][key].append(value)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        engine = self.rollout_engine
        if engine is not None and engine.keep_logps and model.training and engine.synced_step == self.state.global_step:
            # The sampler's log-probs stand in for the policy's (its unfiltered ones are the old log-probs, or with
            # nothing filtered the sampling ones), and the policy has not changed since it sampled, so the training
            # forward's log-probs are what a scoring forward would give: their difference is the sampler's
            # mismatch, measured at no cost (rollout/kl, as TRL's scoring measures it otherwise)
            sampler = inputs.get("old_per_token_logps")
            if sampler is None and not engine.filters:
                sampler = inputs.get("sampling_per_token_logps")
            if sampler is not None:
                self._mismatch_batch = (sampler, inputs["completion_mask"])
        if model.training and any(inputs is batch for batch in self._on_policy):
            guards.refuse_moved_policy(self._round_step, self.state.global_step)
            self._weigh_in_forward = inputs  # its training forward gives its old log-probs (_score_round)
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self._weigh_in_forward = None
        self._mismatch_batch = None  # a loss that never called the scoring forward (TRL's liger path) leaves none
        if self.extra_loss is not None and model.training:
            loss = loss + self.extra_loss_term(model)
        return guards.guard_loss(self, model, loss)

    def _save_checkpoint(self, model, trial):
        """HF's checkpoint, written into a staging directory and renamed into place when complete.

        Data-parallel: rank 0 writes the weights, optimizer and state, every rank its own RNG state; rank 0
        publishes once all of them have written."""
        run_dir = Path(self._get_output_dir(trial=trial))
        final = run_dir / f"checkpoint-{self.state.global_step}"
        staging = checkpoints.staging_dir(final)
        staging.mkdir(parents=True, exist_ok=True)
        original = self.args.output_dir
        main = self.accelerator.is_main_process
        self.args.output_dir = str(staging)  # HF writes <output_dir>/checkpoint-N; point it at the staging area
        try:
            super()._save_checkpoint(model, trial)
            dist.barrier()  # every rank's rng_state_<rank>.pth is in the staging area
            if not main:
                return
            written = staging / final.name
            checkpoints.write_state(written, {**self.run_state, **self.mix_state(),
                                              "global_step": self.state.global_step})
            checkpoints.publish(written, final)
        except Exception as err:
            # before the cleanup below frees the partial write's space; a checkpoint holds the weights and
            # AdamW's two moments, about three times the model
            full = disk_full_reason(err, final, 3 * state_bytes(self.model))
            if full:
                raise DiskFullError(f"{full}; the last complete checkpoint is kept") from err
            raise
        finally:
            self.args.output_dir = original
            if main:
                shutil.rmtree(staging, ignore_errors=True)
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)

    def extra_loss_term(self, model) -> torch.Tensor:
        """The extra term for one micro-batch: logged at full value, added at 1/accumulation steps."""
        term = self.extra_loss(self.accelerator.unwrap_model(model))  # its parameter names, not DDP's module.*
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
        if self.pending_logs and "train_runtime" not in logs:
            logs = {**logs, **self.pending_logs}
            self.pending_logs.clear()
        super().log(logs, start_time)

    def _write_completions(self, step: int) -> None:
        rewards = {name: list(vals) for name, vals in self._logs["rewards"].items()}
        stages = list(self._logs["extra"].get("stage", []))  # a training set of several stages: each row's
        with self.completions_path.open("a") as fh:
            for i, (prompt, completion) in enumerate(zip(self._logs["prompt"], self._logs["completion"])):
                row = {
                    "step": step,
                    "prompt": prompt[-1]["content"] if isinstance(prompt, list) else prompt,
                    "completion": completion[-1]["content"] if isinstance(completion, list) else completion,
                    "rewards": {name: vals[i] for name, vals in rewards.items() if i < len(vals)},
                    "advantage": self._logs["advantages"][i] if i < len(self._logs["advantages"]) else None,
                }
                if i < len(stages):
                    row["stage"] = stages[i]
                fh.write(json.dumps(row) + "\n")


def build_trainer(cfg, parts, output_dir: str | Path, callbacks: list[TrainerCallback],
                  report_to: list[str] | None = None, run_state: dict | None = None,
                  plan: SpeedPlan | None = None) -> GrpoExpTrainer:
    """The one place a trainer is made: a stage's parts (training.stage.prepare), cfg.train and the speed plan
    (config/speed.resolve of cfg.speed; a test may pass a plan of its own to compare two of them)."""
    plan = plan or resolve(cfg.speed, cfg.train)
    args = grpo_config(cfg.train, Path(output_dir) / "checkpoints", parts.reward_weights, report_to or [], plan)
    policy = shared_prefix.scoring_model(parts.model)  # a peft wrapper's inner model, whose attention runs
    logger.info("speed.attention=%s: %s", plan.attention,
                attention.use(policy, plan.attention, plan.attention_decode) or policy.config._attn_implementation)
    # the same gradients, without a vocabulary-sized buffer per lookup (where the input embedding is the tied head)
    installed = plan.embedding_grad and embedding_grad.install(policy)
    if installed:
        logger.info("input embedding tied to the LM head: its gradient is taken as the rows its tokens touch")
    plan = dataclasses.replace(plan, embedding_grad=bool(installed))
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

