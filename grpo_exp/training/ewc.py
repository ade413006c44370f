"""Elastic weight consolidation: a diagonal Fisher estimated from the policy's own samples, its
online accumulation across stages, and the quadratic penalty added to the GRPO loss.

F_i = E_{x ~ prompts, y ~ pi_T(.|x)} [ (d/d theta_i log pi_T(y|x))^2 ], estimated one sequence at a time
(the gradient of each sequence's completion log-likelihood is squared before averaging; squaring a
batch gradient would give a different, smaller quantity).

pi_T is the policy at the training temperature T (softmax of logits / T): the distribution GRPO samples
from and whose log-probabilities TRL's loss uses. Sampling at T but differentiating the untempered
log pi would mix two distributions: the score would no longer have zero mean under the samples, and the
estimate would not be the Fisher of either.

In a data-parallel run each process samples and differentiates a share of the sequences (whole sampling
batches, seeded as in a single process, so the shares together are the single process's sequences); the
squared-gradient sums and counts are all-reduced, so every process holds the same estimate.

Each stage's estimate is normalised (`ewc.fisher_norm`, training/fisher_scale.py: by default divided by its mean,
so lambda means the same at any completion length and for any model) before it is folded in, or replaced by a
uniform Fisher (`ewc.fisher=uniform`, the Anchored Weight Decay ablation: no sampling). fisher.safetensors
records both, so a state is only ever mixed with one of its own kind.

A stage's EWC state: the one init_from carries in (`carried_state`, converted to this run's settings, or
`starting_fisher` for an init_from run trained without EWC), and the one it saves at its end (`consolidate_fisher`).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from grpo_exp.base import dist, log
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.run_files import FISHER_FILE
from grpo_exp.config.recorded import run_config
from grpo_exp.core import data
from grpo_exp.training import fisher_scale, lora
from grpo_exp.training.sampling import sample_batches

logger = log.get_logger(__name__)
EMBEDDING_MARKERS = ("embed_tokens", "lm_head", "wte", "embed_out")


def is_embedding(name: str) -> bool:
    return any(marker in name for marker in EMBEDDING_MARKERS)


def fisher_parameters(model: torch.nn.Module, include_embeddings: bool) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters covered by the Fisher; tied weights appear once (named_parameters dedups)."""
    return {name: p for name, p in model.named_parameters()
            if p.requires_grad and (include_embeddings or not is_embedding(name))}


def sequence_logprob(model, input_ids: torch.Tensor, prompt_len: int, temperature: float = 1.0) -> torch.Tensor:
    """Sum of log pi_T(y_t | x, y_<t) over the completion tokens of one unpadded sequence."""
    logits = model(input_ids=input_ids).logits[:, prompt_len - 1:-1].float() / temperature
    targets = input_ids[:, prompt_len:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).sum()


def fisher_from_sequences(model, sequences: list[tuple[torch.Tensor, int]], include_embeddings: bool = False,
                          progress: bool = True, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Average of squared per-sequence gradients of the completion log-likelihood at `temperature`
    (the one the sequences were sampled at).

    `sequences` holds (1 x T token ids, prompt length) pairs with no padding.
    """
    fisher, used = fisher_sums(model, sequences, include_embeddings, progress, temperature)
    if used == 0:
        raise ValueError("no sampled completion had any tokens; cannot estimate a Fisher")
    return {name: f / used for name, f in fisher.items()}


def fisher_sums(model, sequences: list[tuple[torch.Tensor, int]], include_embeddings: bool = False,
                progress: bool = True, temperature: float = 1.0) -> tuple[dict[str, torch.Tensor], int]:
    """Sum of squared per-sequence gradients, and how many sequences it holds (empty completions count none)."""
    params = fisher_parameters(model, include_embeddings)
    fisher = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    was_training = model.training
    model.eval()  # dropout off: the Fisher is of the policy as it samples
    used = 0
    for ids, prompt_len in tqdm(sequences, desc="fisher", disable=not progress, leave=False):
        if ids.shape[1] <= prompt_len:
            continue  # an empty completion has no log-likelihood to differentiate
        model.zero_grad(set_to_none=True)
        sequence_logprob(model, ids.to(model.device), prompt_len, temperature).backward()
        for name, p in params.items():
            if p.grad is not None:
                fisher[name] += p.grad.detach().float() ** 2
        used += 1
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return fisher, used


@torch.no_grad()
def sample_sequences(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, temperature: float,
                     batch_size: int, seed: int, shard: tuple[int, int] = (0, 1)) -> list[tuple[torch.Tensor, int]]:
    """One sampled completion per prompt, returned unpadded as (ids, prompt length).

    shard=(i, n): only the sampling batches i, i + n, ... (process i of n); each batch is seeded by its
    position, so the shards together hold exactly the sequences one process would sample."""
    out_seqs = []
    for enc, completions in sample_batches(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                           temperature=temperature, batch_size=batch_size, seed=seed, shard=shard,
                                           desc="fisher samples"):
        for ids, mask, completion in zip(enc["input_ids"], enc["attention_mask"], completions.tolist()):
            prompt = ids[mask.bool()]
            eos = next((i + 1 for i, t in enumerate(completion) if t in (tokenizer.eos_token_id, tokenizer.pad_token_id)),
                       len(completion))
            row = torch.cat([prompt, torch.tensor(completion[:eos], dtype=ids.dtype, device=ids.device)]).unsqueeze(0)
            out_seqs.append((row, len(prompt)))
    return out_seqs


@dataclass
class EwcState:
    """Accumulated Fisher and the anchor parameters theta* it protects.

    `norm`: the normalisation of every stage's part (fisher_scale.NORMS), None for a file from before it was
    recorded (the raw Fisher); `kind`: `sampled` or `uniform`."""

    fisher: dict[str, torch.Tensor]
    anchor: dict[str, torch.Tensor]
    stages: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    norm: str | None = "none"
    kind: str = "sampled"

    def consolidate(self, new_fisher: dict[str, torch.Tensor], new_anchor: dict[str, torch.Tensor], gamma: float,
                    stage: str, norm: str = "none", kind: str = "sampled") -> "EwcState":
        """Online EWC: F <- gamma * F_old + F_new; the anchor moves to the newest stage's parameters.

        Both parts must be of one normalisation and kind (`conform` converts a carried state first): a raw
        old Fisher beside a mean-1 new one would weigh the stages by their completion lengths.
        A parameter the new Fisher lacks (another include_embeddings setting, say) keeps its decayed old
        entry and its old anchor: what an earlier stage protected stays protected. The state lives on the
        CPU (the penalty moves it to the parameters' device once), whichever device estimated the Fisher."""
        if self.fisher and (self.norm, self.kind) != (norm, kind):
            raise ValueError(f"cannot fold a {kind} Fisher normalised '{norm}' into an EWC state of a {self.kind} "
                             f"Fisher normalised '{self.norm or 'none (unrecorded)'}'; convert it first (ewc.conform)")
        fisher = {name: gamma * old for name, old in self.fisher.items() if name not in new_fisher}
        anchor = {name: self.anchor[name].clone() for name in fisher}
        for name, f in new_fisher.items():
            f = f.detach().cpu()
            fisher[name] = gamma * self.fisher[name].cpu() + f if name in self.fisher else f.clone()
            anchor[name] = new_anchor[name].detach().cpu().clone()
        return EwcState(fisher, anchor, [*self.stages, stage], {**self.meta, "gamma": gamma}, norm, kind)

    def check_finite(self) -> None:
        bad = [f"{kind}.{name}" for kind, tensors in (("fisher", self.fisher), ("anchor", self.anchor))
               for name, t in tensors.items() if not torch.isfinite(t).all()]
        if bad:
            raise ValueError(f"EWC state has non-finite values in {len(bad)} tensors: {', '.join(bad[:5])}"
                             + (" ..." if len(bad) > 5 else "") + "; refusing to save it")

    def save(self, directory: str | Path) -> Path:
        """fisher.safetensors beside the stage's model/: `fisher.<name>` and `anchor.<name>` tensors."""
        self.check_finite()
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {f"fisher.{k}": v.detach().cpu().contiguous() for k, v in self.fisher.items()}
        tensors.update({f"anchor.{k}": v.detach().cpu().contiguous() for k, v in self.anchor.items()})
        path = directory / FISHER_FILE
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"stages": json.dumps(self.stages), "meta": json.dumps(self.meta),
                                               "fisher_norm": self.norm or "none", "fisher": self.kind})
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "EwcState":
        path = Path(directory) / FISHER_FILE
        if not path.is_file():
            raise ConfigError(f"no EWC state ({FISHER_FILE}) in {directory}; run that stage with ewc.lambda>0, "
                              f"or continue with ewc.lambda=0")
        from safetensors import safe_open

        with safe_open(str(path), "pt") as fh:
            metadata = fh.metadata() or {}
        tensors = load_file(str(path))
        fisher = {k[len("fisher."):]: v for k, v in tensors.items() if k.startswith("fisher.")}
        anchor = {k[len("anchor."):]: v for k, v in tensors.items() if k.startswith("anchor.")}
        # a file from before ewc.fisher_norm records no normalisation (None): its Fisher is the raw one
        return cls(fisher, anchor, json.loads(metadata.get("stages", "[]")), json.loads(metadata.get("meta", "{}")),
                   metadata.get("fisher_norm"), metadata.get("fisher", "sampled"))

    def stats(self) -> dict:
        values = torch.cat([f.flatten() for f in self.fisher.values()])
        return {"fisher_params": int(values.numel()), "fisher_mean": float(values.mean()),
                "fisher_max": float(values.max()), "fisher_std": float(values.std()), "stages": self.stages}


class EwcPenalty:
    """lambda/2 * sum_i F_i (theta_i - theta*_i)^2 over the parameters the Fisher covers.

    A sum, not a mean over parameters: with a mean-1 Fisher the pull on one weight is then lambda F_i d_i, what
    it would be in a model of any size, and the total squared distance the loss's gradient can buy is
    ~ ||grad||^2 / lambda^2, which does not grow with the parameter count; a mean would divide every weight's
    pull by the count, so gemma3_270m (twice SmolLM2-135M's parameters) would be held half as hard at one lambda
    (docs/curriculum-ewc.md)."""

    name = "ewc_penalty"

    def __init__(self, state: EwcState, strength: float):
        self.state = state
        self.strength = float(strength)
        self._pairs: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] | None = None

    def _bind(self, model: torch.nn.Module):
        params = dict(model.named_parameters())
        missing = [name for name in self.state.fisher if name not in params]
        if missing:
            raise ValueError(f"EWC state names parameters the model lacks: {', '.join(missing[:3])}")
        self._pairs = [(params[name], self.state.fisher[name].to(params[name].device),
                        self.state.anchor[name].to(params[name].device)) for name in self.state.fisher]

    def __call__(self, model: torch.nn.Module) -> torch.Tensor:
        if self._pairs is None:
            self._bind(model)
        total = torch.zeros((), dtype=torch.float32, device=self._pairs[0][0].device)
        for param, fisher, anchor in self._pairs:
            total = total + (fisher * (param.float() - anchor) ** 2).sum()
        return 0.5 * self.strength * total

    def weighted_distance(self, model: torch.nn.Module) -> float:
        """sum_i F_i (theta_i - theta*_i)^2, the quantity EWC keeps small."""
        with torch.no_grad():
            return float(self(model)) * 2 / self.strength if self.strength else float(
                EwcPenalty(self.state, 1.0)(model)) * 2


def current_parameters(model: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {name: params[name].detach().float().clone() for name in names}


def estimate(model, tokenizer, prompts: list[list[dict]], *, samples: int, max_new_tokens: int, temperature: float,
             batch_size: int, seed: int, include_embeddings: bool,
             shard: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
    """Sample `samples` completions from the current policy and return the diagonal Fisher.

    shard=(rank, world size) in a data-parallel run: this process takes its share of the sampling batches,
    and the sums and counts of all shares are all-reduced (collective: every process must call it)."""
    chosen = prompts[:samples] if len(prompts) >= samples else [prompts[i % len(prompts)] for i in range(samples)]
    sequences = sample_sequences(model, tokenizer, chosen, max_new_tokens=max_new_tokens, temperature=temperature,
                                 batch_size=batch_size, seed=seed, shard=shard)
    sums, used = fisher_sums(model, sequences, include_embeddings, temperature=temperature)
    if shard[1] > 1:
        names = sorted(sums)  # the same order on every process
        count = torch.tensor([float(used)], device=sums[names[0]].device)
        dist.all_reduce_sum([*(sums[n] for n in names), count])
        used = int(count.item())
    if used == 0:
        raise ValueError("no sampled completion had any tokens; cannot estimate a Fisher")
    fisher = {name: f / used for name, f in sums.items()}
    bad = [name for name, f in fisher.items() if not torch.isfinite(f).all()]
    if bad:
        raise ValueError(f"Fisher estimate is non-finite in {', '.join(bad[:5])}; not saved")
    return fisher


# --- a stage's EWC state ---------------------------------------------------------------------

def check_init(cfg, init: tuple[Path, Path] | None) -> None:
    """ewc.lambda>0 from an init_from without an EWC state: its Fisher is estimated at the start instead
    (starting_fisher), which needs the stage that run trained (its .hydra config)."""
    if init and cfg.ewc["lambda"] > 0 and not (init[1] / FISHER_FILE).is_file():
        if run_config(init[1]) is None:
            raise ConfigError(f"init_from={cfg.init_from} has no EWC state ({FISHER_FILE} in {init[1]}) and no "
                              f"recorded run config (.hydra/config.yaml) to estimate it from; give a run directory, "
                              f"train that stage with ewc.lambda>0, or continue with ewc.lambda=0")
        if lora.enabled(cfg):
            raise ConfigError(f"init_from={cfg.init_from} has no EWC state ({FISHER_FILE}); with peft=lora the "
                              f"Fisher covers the adapter, so train that stage with ewc.lambda>0 and peft=lora")


def carried_state(cfg, init: tuple[Path, Path] | None) -> EwcState | None:
    """The EWC state init_from saved, where this stage uses one (ewc.lambda > 0), in this run's normalisation and
    kind (`conform`); loaded before the model, so a broken or unusable file fails before anything heavy."""
    if init is not None and cfg.ewc["lambda"] > 0 and (init[1] / FISHER_FILE).is_file():
        return conform(EwcState.load(init[1]), cfg.ewc["fisher_norm"], cfg.ewc["fisher"], init[1] / FISHER_FILE)
    return None


def conform(state: EwcState, norm: str, kind: str, where) -> EwcState:
    """A carried state in the normalisation and kind this run folds its own stage's Fisher in with.

    - A raw Fisher (`none`, or a file from before the option, which records none) under `mean` is converted, with
      one INFO line: scaled to the mean a state of its stages normalised stage by stage holds (1 + gamma + ...;
      exact for one stage, and the stages' relative weights of an older multi-stage file are kept as they were).
      Refusing would strand every earlier run's Fisher, and the conversion is one scalar.
    - A normalised Fisher under `none` is refused: the raw scale it was divided by is not recorded.
    - A sampled Fisher under `uniform` keeps its anchor and sets every entry to 1 + gamma + ..., what a uniform
      Fisher of its stages holds (so the ablation can branch off an EWC run's first stage); a uniform one under
      `sampled` is refused: it holds no Fisher to use.
    """
    weight = fisher_scale.stage_weight(len(state.stages), float(state.meta.get("gamma", 1.0)))
    if kind == "uniform":
        if state.kind != "uniform":
            logger.info("%s holds a sampled Fisher; ewc.fisher=uniform keeps its anchor and sets every entry to %g "
                        "(a uniform Fisher over its %d stage(s))", where, weight, len(state.stages))
            state = replace(state, fisher={n: torch.full_like(f, weight) for n, f in state.fisher.items()})
        return replace(state, norm=norm, kind=kind)  # all ones: the same under either normalisation
    if state.kind == "uniform":
        raise ConfigError(f"{where} holds a uniform Fisher (ewc.fisher=uniform), no sampled one for ewc.fisher=sampled; "
                          f"continue with ewc.fisher=uniform, or from a stage trained with ewc.fisher=sampled")
    had = state.norm or "none"
    if had == norm:
        if state.norm is None:
            logger.info("%s records no Fisher normalisation (a file from before ewc.fisher_norm): the raw Fisher, "
                        "used as is under ewc.fisher_norm=none", where)
        return replace(state, norm=norm)
    if norm == "none":
        raise ConfigError(f"{where} holds a Fisher normalised by its mean (ewc.fisher_norm={had}), not the raw one "
                          f"ewc.fisher_norm=none needs; continue with ewc.fisher_norm={had}")
    mean = fisher_scale.mean_value(state.fisher)
    if not mean > 0:
        raise ConfigError(f"{where} holds a Fisher whose mean is {mean!r}; it cannot be normalised (ewc.fisher_norm)")
    logger.info("%s holds a raw Fisher (%s, mean %.3g); converted to ewc.fisher_norm=%s: scaled to mean %g "
                "(1 + gamma + ... over its %d stage(s)), the scale this run's lambda is on", where,
                "no normalisation recorded" if state.norm is None else "ewc.fisher_norm=none", mean, norm, weight,
                len(state.stages))
    return replace(state, fisher={n: f * (weight / mean) for n, f in state.fisher.items()}, norm=norm)


def source(init: tuple[Path, Path] | None, state: EwcState | None) -> str | None:
    """Where the carried EWC state came from (metrics.json, checkpoints' run state)."""
    if state is None:
        return None
    saved = init[1] / FISHER_FILE
    return str(saved) if saved.is_file() else f"estimated at the start from {init[0]} (starting_fisher)"


def consolidate_fisher(cfg, model, tokenizer, examples: list[dict], old_state: EwcState | None,
                       run_dir: Path) -> tuple[EwcState, dict]:
    """Estimate this stage's Fisher on its training prompts, fold it into the running EWC state, save it;
    returns (the state, its figures for metrics.json)."""
    t0 = time.time()
    norm, kind = cfg.ewc["fisher_norm"], cfg.ewc["fisher"]
    raw_mean = None
    if kind == "uniform":
        fisher = fisher_scale.uniform(fisher_parameters(model, cfg.ewc["include_embeddings"]))
        logger.info("ewc.fisher=uniform: every Fisher entry is 1 (an L2 pull to this stage's weights, Anchored "
                    "Weight Decay); no completions sampled, the Fisher estimate skipped")
    else:
        prompts = [data.prompt_messages(ex, cfg.reward.system_prompt) for ex in examples]
        random.Random(cfg.train.seed).shuffle(prompts)
        # every process estimates on its share of the samples, and all of them get the whole estimate
        fisher = estimate(
            model, tokenizer, prompts, samples=cfg.ewc["fisher_samples"],
            max_new_tokens=cfg.ewc["fisher_max_new_tokens"] or cfg.train.max_completion_length,
            temperature=cfg.train.temperature, batch_size=cfg.ewc["fisher_batch_size"], seed=cfg.train.seed,
            include_embeddings=cfg.ewc["include_embeddings"], shard=(dist.rank(), dist.world_size()),
        )
        raw_mean = fisher_scale.mean_value(fisher)
        fisher = fisher_scale.normalise(fisher, norm)
    anchor = current_parameters(model, fisher.keys())
    base = old_state if old_state is not None else EwcState({}, {}, [], {}, norm, kind)
    state = base.consolidate(fisher, anchor, cfg.ewc["gamma"], cfg.stage.name, norm, kind)
    if dist.is_main():
        state.save(run_dir)
    return state, {"fisher_time_s": time.time() - t0, **{k: v for k, v in state.stats().items() if k != "stages"},
                   "ewc_stages": state.stages, "ewc_fisher": kind, "ewc_fisher_norm": norm,
                   "fisher_estimated": kind != "uniform",
                   # this stage's own estimate before normalisation: the scale lambda was on before the option
                   "fisher_raw_mean": raw_mean}


def starting_fisher(cfg, model, tokenizer, init_dir: Path) -> EwcState:
    """The EWC state of an init_from run trained without EWC: its Fisher, estimated now on the model it
    saved and the prompts of the stage it trained, with that run's data seed, sampling temperature,
    completion length and system prompt (its .hydra/config.yaml). So any earlier run can be protected,
    and one basic run can start an EWC sweep. Saved in this run's directory, never in init_from's."""
    from omegaconf import OmegaConf

    recorded = run_config(init_dir)[0]
    earlier = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    earlier.stage = OmegaConf.to_container(recorded.stage, resolve=True)
    for key in ("seed", "temperature", "max_completion_length"):
        earlier.train[key] = recorded.train[key]
    earlier.reward.system_prompt = recorded.reward.system_prompt
    examples = data.stage_split(earlier.stage, "train", earlier.train.seed)
    state, figures = consolidate_fisher(earlier, model, tokenizer, examples, None, Path(cfg.paths.output_dir))
    if figures["fisher_estimated"]:
        logger.info("init_from=%s has no EWC state: estimated its Fisher on %s prompts in %.1f s (raw mean %.3g)",
                    init_dir, earlier.stage.name, figures["fisher_time_s"], figures["fisher_raw_mean"])
    return state
