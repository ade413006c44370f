"""Forgetting, step by step (`eval.forgetting_sets`): how far a later stage moves the policy on the
prompts of earlier stages, and what that costs in accuracy there.

Forgetting in RL fine-tuning tracks the KL divergence from the earlier policy measured on the
earlier task's prompts (Shenfeld et al. 2025, "RL's Razor"). At the start of a later stage the
callback samples one completion per prompt from the previous stage's policy (`init_from`'s model/,
loaded from disk so a resumed run gets the same reference) at temperature 1 with no top-k/top-p,
and keeps those tokens and their log-probabilities. Every `eval.every_steps` it scores the same
tokens under the current policy and logs

    forgetting/<stage>/kl        mean over prompts of sum_t [(r_t - 1) - log r_t],  r_t = p_now / p_prev

(Schulman's k3 estimator per token: unbiased for the per-token KL(prev || now) because the tokens come
from prev, never negative, and lower-variance than the plain log-ratio), plus greedy accuracy on the
same earlier-stage problems as `eval/<stage>/accuracy`, the key the earlier stage itself logged, so
its curve continues across stages. Both sit on the `train/global_step` axis in history.jsonl and wandb.

The same estimator on the stage's own validation prompts is `drift/<stage>/kl`: how far training moved the
policy on the task it learns, the quantity RL's Razor finds predicts forgetting (and which lets GRPO and
supervised fine-tuning be put on one axis).

Cost per evaluation: one teacher-forced forward pass over the fixed samples and one greedy generation
per earlier stage (`eval.every_limit` problems each); the reference sampling is paid once per stage.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass

import torch
from transformers import TrainerCallback

from grpo_exp.base import log
from grpo_exp.core.data import prompt_messages, to_messages
from grpo_exp.evaluation.generate import evaluate, model_device
from grpo_exp.training.sampling import sample_batches

logger = log.get_logger(__name__)


@dataclass
class Reference:
    """Completions sampled from the previous policy: tokens, where the completion is, and its log-probs."""

    input_ids: torch.Tensor  # [n, prompt + completion], prompts left-padded
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor  # 1 on completion tokens up to and including EOS
    logps: torch.Tensor  # [n, completion length]: log p_prev of each completion token


@torch.no_grad()
def sample_reference(model, tokenizer, questions: list[str | list[dict]], *, system_prompt: str, max_new_tokens: int,
                     seed: int, batch_size: int = 32) -> Reference:
    """One completion per question (or chat prompt, a list of messages) from `model` at temperature 1 (its own
    distribution), with log-probs."""
    messages = [q if isinstance(q, list) else to_messages(q, system_prompt) for q in questions]
    rows = [(enc["input_ids"], enc["attention_mask"], completion, _completion_mask(completion, tokenizer))
            for enc, completion in sample_batches(model, tokenizer, messages, max_new_tokens=max_new_tokens,
                                                  temperature=1.0, batch_size=batch_size, seed=seed)]
    # [left-padded prompt | completion | right padding], so every completion starts in the same column
    prompts, prompt_masks = _pad_cat([r[0] for r in rows], left=True), _pad_cat([r[1] for r in rows], left=True)
    completions, masks = _pad_cat([r[2] for r in rows], left=False), _pad_cat([r[3] for r in rows], left=False)
    ref = Reference(torch.cat([prompts, completions], dim=1).cpu(), torch.cat([prompt_masks, masks], dim=1).cpu(),
                    masks.cpu(), torch.zeros(masks.shape))
    ref.logps = completion_logps(model, ref)
    return ref


def _completion_mask(completion: torch.Tensor, tokenizer) -> torch.Tensor:
    """1 up to and including the first EOS (or pad) of each row, 0 after it."""
    stop = torch.zeros_like(completion, dtype=torch.bool)
    for token in {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}:
        stop |= completion == token
    # positions after the first stop token: a stop token strictly before them
    after = torch.cumsum(stop.long(), dim=1) - stop.long() > 0
    return (~after).long()


def _pad_cat(tensors: list[torch.Tensor], left: bool) -> torch.Tensor:
    """Batches of different widths stacked, zero-padded on the left or right (masked wherever it is read)."""
    width = max(t.shape[1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]))
              for t in tensors]
    return torch.cat(padded, dim=0)


_HEAD_ROWS = 4  # completions whose log-softmax is taken at once: the vocabulary-wide temporaries of a few rows only


@functools.lru_cache(maxsize=None)
def _keeps_logits(model_type: type) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs do; a wrapper that passes
    keywords on, such as peft's, counts as taking it)."""
    params = inspect.signature(model_type.forward).parameters
    return "logits_to_keep" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@torch.no_grad()
def completion_logps(model, ref: Reference, batch_size: int = 32) -> torch.Tensor:
    """log p_model of each reference completion token (teacher forcing), fp32, [n, completion length].

    The LM head runs on the completion's positions only (`logits_to_keep`), and each token's log-prob is its logit
    minus the log-sum-exp over the vocabulary, a few rows at a time, so that no vocabulary-wide tensor of the whole
    batch's sequences is held at once (it set a later stage's peak: docs/log.md, 2026-12-07)."""
    was_training = model.training
    model.eval()
    device = model_device(model)
    width = ref.completion_mask.shape[1]
    keep = {"logits_to_keep": width + 1} if _keeps_logits(type(model)) else {}
    out = []
    try:
        for start in range(0, ref.input_ids.shape[0], batch_size):
            ids = ref.input_ids[start:start + batch_size].to(device)
            attention = ref.attention_mask[start:start + batch_size].to(device)
            logits = model(input_ids=ids, attention_mask=attention, **keep).logits[:, -width - 1:-1]
            target = ids[:, -width:]
            for row in range(0, logits.shape[0], _HEAD_ROWS):
                rows = logits[row:row + _HEAD_ROWS].float()
                picked = rows.gather(-1, target[row:row + _HEAD_ROWS].unsqueeze(-1)).squeeze(-1)
                out.append((picked - torch.logsumexp(rows, dim=-1)).cpu())
            del logits
    finally:
        model.train(was_training)
    return torch.cat(out, dim=0)


def kl_from_reference(model, ref: Reference) -> dict:
    """KL(prev || now) per completion (nats, summed over its tokens) and per token, from the k3 estimator."""
    now = completion_logps(model, ref)
    mask = ref.completion_mask.float()
    log_ratio = (now - ref.logps).clamp(-30, 30)  # log r_t; the clamp only guards exp() from inf
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * mask
    tokens = mask.sum()
    return {"kl": (k3.sum(dim=1)).mean().item(), "kl_per_token": (k3.sum() / tokens.clamp(min=1)).item()}


class ForgettingCallback(TrainerCallback):
    """Every N steps (and after the last): KL from the previous policy and greedy accuracy on earlier stages."""

    def __init__(self, pending_logs: dict, sets: list[tuple[str, list[dict], int, Reference, object]],
                 every_steps: int, *, system_prompt: str, batch_size: int, decode: str = "auto",
                 own: tuple[str, Reference] | None = None, engine_cache_mb: float | None = None):
        self.pending_logs = pending_logs  # the trainer merges and clears it in its next log() call
        self.sets, self.every_steps = sets, every_steps
        self.own = own  # (this stage's name, the previous policy's samples on its validation prompts)
        self.system_prompt, self.batch_size = system_prompt, batch_size
        self.decode = decode  # eval.decode (evaluation/generate.decode_path)
        self.engine_cache_mb = engine_cache_mb  # eval.engine_cache_mb

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        step = state.global_step
        if step % self.every_steps and step != state.max_steps:
            return control
        self.pending_logs.update(self.measure(model, processing_class))
        return control

    def measure(self, model, tokenizer) -> dict:
        row = {}
        for name, examples, max_new_tokens, reference, judge in self.sets:
            started = time.perf_counter()
            kl = kl_from_reference(model, reference)
            metrics, _ = evaluate(model, tokenizer, examples, system_prompt=self.system_prompt,
                                  max_new_tokens=max_new_tokens, batch_size=self.batch_size,
                                  desc=f"forgetting eval {name}", judge=judge, decode=self.decode,
                                  engine_cache_mb=self.engine_cache_mb)
            row.update({
                f"forgetting/{name}/kl": kl["kl"],
                f"forgetting/{name}/kl_per_token": kl["kl_per_token"],
                f"forgetting/{name}/seconds": time.perf_counter() - started,
                f"eval/{name}/accuracy": metrics["accuracy"],
                f"eval/{name}/format": metrics["format_compliance"],
                f"eval/{name}/mean_tokens": metrics["mean_completion_tokens"],
                f"eval/{name}/n": metrics["n"],
            })
        if self.own is not None:
            name, reference = self.own
            kl = kl_from_reference(model, reference)
            row.update({f"drift/{name}/kl": kl["kl"], f"drift/{name}/kl_per_token": kl["kl_per_token"]})
        return row


def forgetting_callback(cfg, pending_logs: dict, previous_dir) -> ForgettingCallback:
    """The `eval.forgetting_sets` callback of a stage, its reference sampled from `previous_dir` (init_from's
    model/ on disk: the previous stage's policy, also when this stage resumes from a checkpoint)."""
    from grpo_exp.core import models
    from grpo_exp.evaluation.judge import for_stage
    from grpo_exp.evaluation.run import set_settings, validation_subset

    t0 = time.time()
    previous, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed, init_from=previous_dir)

    def reference_on(name: str):
        stage, max_new_tokens = set_settings(cfg, name)
        examples = validation_subset(cfg, stage, name)
        reference = sample_reference(previous, tokenizer,
                                     [prompt_messages(ex, cfg.reward.system_prompt) for ex in examples],
                                     system_prompt=cfg.reward.system_prompt, max_new_tokens=max_new_tokens,
                                     seed=cfg.train.seed, batch_size=cfg.eval.batch_size)
        return stage, examples, max_new_tokens, reference

    sets = []
    for name in dict.fromkeys(cfg.eval.forgetting_sets):
        stage, examples, max_new_tokens, reference = reference_on(name)
        sets.append((name, examples, max_new_tokens, reference, for_stage(stage, list(cfg.reward.funcs))))
    own = None
    if cfg.stage.name not in cfg.eval.forgetting_sets:  # the KL on the prompts this stage trains for
        own = (cfg.stage.name, reference_on(cfg.stage.name)[3])
    del previous
    logger.info("forgetting reference for %s (and the drift on %s) sampled from %s in %.1f s",
                ", ".join(s[0] for s in sets), cfg.stage.name, previous_dir, time.time() - t0)
    return ForgettingCallback(pending_logs, sets, cfg.eval.every_steps, system_prompt=cfg.reward.system_prompt,
                              batch_size=cfg.eval.batch_size, decode=cfg.eval.decode, own=own,
                              engine_cache_mb=cfg.eval.engine_cache_mb)
