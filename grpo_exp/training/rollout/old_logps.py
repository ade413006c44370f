"""PPO's old log-probs on the engine's path: the sampler's own, or a scoring forward by the trained policy.

Where the rollout copy computes what the policy computes (an fp32 copy of a policy trained in fp32; the autocast
copy of one trained under bf16 autocast), the sampler's log-probs are the policy's up to kernel rounding, so they
serve as the old log-probs and TRL's scoring forward over the round is skipped. Elsewhere the policy scores the
round and importance weights (importance.py) correct for the copy's mismatch. Which of the two a run takes is
the speed plan's `old_logps` (config/speed.py); `OldLogps` is a trainer's choice, with the deferred scoring by
batch and the mismatch figures.
"""

from __future__ import annotations

import torch

from grpo_exp.training import guards
from grpo_exp.training.rollout import importance


def padded_logps(rows: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-completion log-probs as TRL's [batch, completion length] tensor, right-padded with 0 as TRL pads
    completions (the completion mask hides the padding)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise RuntimeError(f"a completion of {len(row)} tokens does not fit TRL's {width} completion positions")
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


class OldLogps:
    """Where a trainer's old log-probs come from, and the sampler's mismatch with the trained policy; one per
    trainer (GrpoExpTrainer calls it at each of TRL's hooks below).

    - the sampler's own (speed.old_logps=sampler, `engine.keep_logps`): they stand in for TRL's no-grad scoring of
      the round (`stand_in`), and each batch's training forward measures the mismatch at no cost (`before_loss`,
      `after_forward`);
    - by batch (`by_batch`, speed.exact_shortcuts on the engine's corrected path): TRL's scoring of a round is
      deferred (`round`) to its batches (`after_prepare` -> `score_round`): the batches trained before the next
      optimizer step meet the policy that sampled them, so their own training forward gives their old log-probs
      (`after_forward` -> `weigh`); only the later ones are scored, before the policy moves;
    - else TRL's own scoring forward, the mismatch logged each round (`round`).

    Reads TRL's `_metrics`, `_buffered_inputs`, `_step` and its vLLM importance-sampling settings."""

    def __init__(self, trainer, engine, plan):
        self.trainer, self.engine = trainer, engine
        args = trainer.args
        spg, accumulation = args.steps_per_generation, args.gradient_accumulation_steps
        # where a round's batches and the optimizer steps line up, so it is known which batches meet the policy
        # that sampled them
        self.by_batch = (engine is not None and trainer.use_vllm and trainer.vllm_importance_sampling_correction
                         and trainer.num_iterations == 1 and (spg % accumulation == 0 or accumulation % spg == 0)
                         and plan.scoring == "batch")
        self.round_step = -1  # the optimizer step the current round's on-policy batches belong to
        self.deferring = False  # TRL is generating a round whose scoring forward is deferred
        self.round_to_score = False  # a round was generated whose batches are not scored yet
        self.on_policy: list[dict] = []  # this round's batches that their own training forward scores
        self.weigh_in_forward: dict | None = None  # the batch whose training forward is running
        # (the sampler's log-probs, completion mask) of a batch whose training forward measures the mismatch
        self.mismatch_batch: tuple[torch.Tensor, torch.Tensor] | None = None

    def round(self, generate, inputs) -> dict:
        """`generate(inputs)` (TRL's round, or dynamic sampling's rounds), its scoring deferred where by batch, and
        the sampler's mismatch with the policy's scoring logged."""
        trainer, engine = self.trainer, self.engine
        deferred = self.by_batch and trainer.model.training
        if deferred:  # TRL neither scores nor weighs the round: score_round does, batch by batch
            self.deferring, trainer.vllm_importance_sampling_correction = True, False
        try:
            output = generate(inputs)
        finally:
            if deferred:
                self.deferring, trainer.vllm_importance_sampling_correction = False, True
        self.round_to_score = deferred
        if engine is not None:
            engine.pending_logps = None  # unused when TRL needed no old log-probs this round
        # (with the sampler's log-probs as the old ones the mismatch is 0 by construction: not logged)
        if engine is not None and not engine.keep_logps and not deferred and "old_per_token_logps" in output:
            args = trainer.args
            stats = self.mismatch(output["old_per_token_logps"], output["sampling_per_token_logps"],
                                  output["completion_mask"], args.vllm_importance_sampling_mode,
                                  args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min)
            mode = "train" if trainer.model.training else "eval"
            for key in ("rollout/kl", "rollout/clipped_frac", "rollout/logp_diff_abs"):
                trainer._metrics[mode][key].append(stats[key])
        return output

    def stand_in(self, model, input_ids: torch.Tensor, logits_to_keep: int, compute_entropy: bool):
        """TRL's no-grad scoring of the policy answered without a forward, or None: the sampler's log-probs
        (speed.old_logps=sampler), or zeros for a round whose batches are scored by batch."""
        engine, trainer = self.engine, self.trainer
        if (engine is not None and engine.pending_logps is not None and model is trainer.model
                and not torch.is_grad_enabled() and not compute_entropy):
            rows, engine.pending_logps = engine.pending_logps, None
            if len(rows) != input_ids.size(0):
                raise RuntimeError(f"the rollout returned {len(rows)} completions; TRL scores {input_ids.size(0)}")
            return padded_logps(rows, logits_to_keep, input_ids.device), None, None
        if self.deferring and model is trainer.model and not torch.is_grad_enabled():
            # TRL's scoring of the whole round for its later batches: each batch is scored instead (score_round)
            return torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device), None, None
        return None

    def after_prepare(self) -> None:
        """After TRL's `_prepare_inputs` split a new round into batches: a deferred round is scored now."""
        if self.round_to_score:
            self.round_to_score = False
            self.score_round()

    def score_round(self) -> None:
        """PPO's old log-probs and the importance weights of a new round, batch by batch (speed.exact_shortcuts).

        TRL scores the whole round with the policy before training on it. The batches trained before the next
        optimizer step meet a policy that has not moved since it sampled them, so their own training forward
        gives those log-probs (TRL's rule for on-policy batches: the old log-probs are the current ones,
        detached); the weights are taken there (weigh). Only the later batches are scored now, before the policy
        moves: for the default's two steps a round, half of TRL's scoring forward."""
        trainer = self.trainer
        batches = trainer._buffered_inputs
        accumulation = trainer.args.gradient_accumulation_steps
        on_policy = min(len(batches), accumulation - trainer._step % accumulation)  # until the next optimizer step
        self.on_policy, self.round_step = batches[:on_policy], trainer.state.global_step
        for batch in self.on_policy:
            batch.pop("old_per_token_logps", None)
        for batch in batches[on_policy:]:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            with torch.no_grad():
                old, _, _ = trainer._get_per_token_logps_and_entropies(
                    trainer.model, ids, mask, batch["completion_ids"].size(1),
                    batch_size=trainer.args.per_device_train_batch_size)
            self.weigh(batch, old)

    def weigh(self, batch: dict, old_logps: torch.Tensor) -> None:
        """Store a batch's old log-probs and TRL's importance weights for its sampler's mismatch, and log the
        mismatch: what TRL's _generate_and_score_completions does for a whole round under vLLM."""
        trainer = self.trainer
        mask = batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]
        sampling, mode = batch["sampling_per_token_logps"], trainer.vllm_importance_sampling_mode
        floor, cap = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
        weights, _ = importance.is_weights(old_logps, sampling, mask, mode, cap, floor)
        batch["old_per_token_logps"], batch["importance_sampling_ratio"] = old_logps, weights
        # with TRL's own names (sampling/*) for the same figures, where any process had a valid token
        for key, value in self.mismatch(old_logps, sampling, mask, mode, cap, floor).items():
            trainer._metrics["train"][key].append(value)

    def before_loss(self, model, inputs: dict) -> None:
        """compute_loss of a batch: mark what its training forward measures or gives (after_forward)."""
        engine, trainer = self.engine, self.trainer
        if (engine is not None and engine.keep_logps and model.training
                and engine.synced_step == trainer.state.global_step):
            # The sampler's log-probs stand in for the policy's (its unfiltered ones are the old log-probs, or with
            # nothing filtered the sampling ones), and the policy has not changed since it sampled, so the training
            # forward's log-probs are what a scoring forward would give: their difference is the sampler's
            # mismatch, measured at no cost (rollout/kl, as TRL's scoring measures it otherwise)
            sampler = inputs.get("old_per_token_logps")
            if sampler is None and not engine.filters:
                sampler = inputs.get("sampling_per_token_logps")
            if sampler is not None:
                self.mismatch_batch = (sampler, inputs["completion_mask"])
        if model.training and any(inputs is batch for batch in self.on_policy):
            guards.refuse_moved_policy(self.round_step, trainer.state.global_step)
            self.weigh_in_forward = inputs  # its training forward gives its old log-probs (score_round)

    def after_loss(self) -> None:
        self.weigh_in_forward = None
        self.mismatch_batch = None  # a loss that never called the scoring forward (TRL's liger path) leaves none

    def after_forward(self, scored: tuple) -> None:
        """A scoring forward's result: on the training forward of a batch marked by before_loss, its old log-probs
        and weights taken, or the sampler's mismatch measured."""
        inputs, self.weigh_in_forward = self.weigh_in_forward, None
        if inputs is not None and torch.is_grad_enabled():
            # the policy has not moved since it sampled this batch: its training forward's log-probs are the old ones
            self.weigh(inputs, scored[0].detach())
        batch, self.mismatch_batch = self.mismatch_batch, None
        if batch is not None:  # on every process alike: mismatch gathers
            sampler, mask = batch
            if scored[0].shape != sampler.shape:  # nothing comparable here: this process adds no tokens
                sampler, mask = scored[0].detach(), torch.zeros_like(scored[0], dtype=torch.long)
            stats = self.mismatch(scored[0].detach(), sampler, mask, "token_mask", None, None)
            for key in ("rollout/kl", "rollout/logp_diff_abs"):  # nothing is capped: no clipped share
                self.trainer._metrics["train"][key].append(stats[key])

    def mismatch(self, old_logps, sampling_logps, mask, mode: str, cap, floor) -> dict[str, float]:
        """The sampler's mismatch over every process's batch (importance.mismatch_from_totals): each process's totals
        are gathered, so a data-parallel run logs all of its tokens, not the main process's alone. Every process
        reaches this at the same point of a step (a collective)."""
        accelerator = self.trainer.accelerator
        totals = importance.mismatch_totals(old_logps, sampling_logps, mask, mode, cap, floor)
        totals = accelerator.gather(totals.to(accelerator.device)[None]).cpu()
        return importance.mismatch_from_totals(totals)
