"""The adaptive curriculum (`curriculum=adaptive`) and the per-stage figures of any run whose training set mixes
stages (replay too).

One run trains on the union of the stages' training sets (replay.mixed_examples). Its sampler
(AdaptiveSampler, in place of TRL's RepeatSampler) draws each generation round's groups stage by stage: each group's
stage with weights from the stages' running pass rates (StageMix.weights: 1 inside `curriculum.band`,
`below_band_weight` below it, `above_band_weight` above it; a stage not yet seen counts as inside), then a prompt of
that stage's training set, uniformly (with replacement across rounds, without within a round). The draw of round r
is a function of (train.seed, r) and the pass rates alone, so every process of a data-parallel run draws the same
and a resumed run draws what an uninterrupted one drew.

The pass rates: after every generation round, each stage's share of passed completions (the 0/1 `correctness`
reward, or `stated_correctness`) over the rewards TRL gathers from every process, folded into an EMA
(`curriculum.pass_rate_decay`). **The lag:** the data loader fetches the next round's prompts before the current
round is generated (accelerate prefetches one batch, HF fetches a step's gradient-accumulation batches at once), so
round r's draw cannot wait for round r-1's rewards. It reads the pass rates as they stood after round
r - 1 - lag, lag = ceil(gradient_accumulation_steps / batches per round) (1 with the default and debug recipes):
the draw always ignores the newest round's rewards, whatever the loader's timing, so it is reproducible.

Logged per step that generates: `curriculum/mix/<stage>` (the stages' shares of the round's completions; they sum to
1) and, adaptive only, `curriculum/pass_rate/<stage>` (once a stage has been seen); completions.jsonl rows carry their
`stage`. The pass rates after each round are saved in every checkpoint's run state (grpo_exp_state.json) and
restored on resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from trl.trainer.utils import RepeatSampler

from grpo_exp.base import log
from grpo_exp.config.schema import CurriculumConfig

logger = log.get_logger(__name__)

PASS_REWARDS = CurriculumConfig.PASS_REWARDS
STATE_KEY = "curriculum_mix"  # its key in a checkpoint's run state
_DRAW_SALT = 0xADA97  # keys these draws apart from dynamic sampling's, which are seeded by train.seed too


class StageMix:
    """Per-stage running pass rates, their history by round, and the draws they weigh."""

    def __init__(self, stages: list[str], band: tuple[float, float], decay: float, below_weight: float,
                 above_weight: float, lag: int = 1):
        self.stages = list(stages)
        self.band, self.decay = (float(band[0]), float(band[1])), float(decay)
        self.below_weight, self.above_weight = float(below_weight), float(above_weight)
        self.lag = lag  # rounds whose rewards a draw never reads (the module's docstring)
        self.pass_rate: list[float | None] = [None] * len(self.stages)
        # round -> the pass rates after it was observed: every round's, so a resumed run (whose data loader draws
        # the rounds it skips again) finds the rates each draw read
        self.snapshots: dict[int, list[float | None]] = {}

    @classmethod
    def from_config(cls, curriculum) -> "StageMix":
        return cls(list(dict.fromkeys(curriculum.stages)), tuple(curriculum.band), curriculum.pass_rate_decay,
                   curriculum.below_band_weight, curriculum.above_band_weight)

    def weights(self, rates: list[float | None], available: list[bool] | None = None) -> np.ndarray:
        """Each stage's draw probability: 1 inside the band (or not yet seen), the floor below it, the mastered
        weight above it, normalized; uniform over the available stages if all weigh 0."""
        low, high = self.band
        raw = np.array([1.0 if rate is None or low <= rate <= high
                        else self.below_weight if rate < low else self.above_weight for rate in rates])
        open_ = np.ones(len(rates), dtype=bool) if available is None else np.array(available, dtype=bool)
        raw = raw * open_
        if raw.sum() <= 0:
            raw = open_.astype(float)
        return raw / raw.sum()

    def rates_for(self, round_index: int) -> list[float | None]:
        """The pass rates round `round_index` is drawn with: as they stood after round r - 1 - lag."""
        target = round_index - 1 - self.lag
        if target < 0:
            return [None] * len(self.stages)
        if target in self.snapshots:
            return self.snapshots[target]
        older = [r for r in self.snapshots if r < target]
        # a loader further ahead than the lag allows for: still drawn, from what is known, but a resumed run
        # (which knows round `target` by then) would draw otherwise
        logger.warning("adaptive curriculum: round %d drawn before round %d was scored; using the pass rates of "
                       "round %s (a resumed run may draw this round differently)", round_index, target,
                       max(older) if older else "none")
        return self.snapshots[max(older)] if older else [None] * len(self.stages)

    def draw(self, round_index: int, groups: int, pools: list[list[int]], seed: int) -> list[int]:
        """`groups` dataset indices for round `round_index`: each group's stage drawn by weight, then a prompt of
        that stage's pool (`pools[s]`: its dataset indices); seeded by (seed, round) alone."""
        weights = self.weights(self.rates_for(round_index), [len(p) > 0 for p in pools])
        rng = np.random.default_rng([seed & 0xFFFFFFFF, round_index, _DRAW_SALT])
        stages = rng.choice(len(self.stages), size=groups, p=weights)
        indices = [0] * groups
        for s, pool in enumerate(pools):
            slots = np.flatnonzero(stages == s)
            if len(slots):
                picks = rng.choice(len(pool), size=len(slots), replace=len(slots) > len(pool))
                for slot, pick in zip(slots, picks):
                    indices[slot] = pool[int(pick)]
        return indices

    def update(self, round_index: int, passed: list[float], scored: list[float]) -> bool:
        """Fold one round's passes into the pass rates and keep their snapshot; False (nothing changed) for a round
        already observed (a resumed run generates again the round its checkpoint cut in two)."""
        if round_index in self.snapshots:
            return False
        for s, (ok, n) in enumerate(zip(passed, scored)):
            if n > 0:
                rate, old = ok / n, self.pass_rate[s]
                self.pass_rate[s] = rate if old is None else self.decay * old + (1 - self.decay) * rate
        self.snapshots[round_index] = list(self.pass_rate)
        return True

    def state_dict(self) -> dict:
        return {"stages": self.stages, "pass_rate": self.pass_rate,
                "snapshots": {str(r): rates for r, rates in sorted(self.snapshots.items())}}

    def load_state_dict(self, state: dict) -> None:
        if state["stages"] != self.stages:
            raise ValueError(f"the checkpoint's adaptive curriculum mixes {state['stages']}, this run {self.stages}")
        self.pass_rate = list(state["pass_rate"])
        self.snapshots = {int(r): list(rates) for r, rates in state["snapshots"].items()}


class AdaptiveSampler(RepeatSampler):
    """TRL's RepeatSampler's layout (each round's `batch_size` prompts, each repeated `mini_repeat_count` times, the
    round repeated `repeat_count` times) with the round's prompts drawn by StageMix. A round's prompts are drawn when
    its first index is asked for; round r of epoch e (HF calls set_epoch) is round e * rounds_per_epoch + r."""

    mix: StageMix
    pools: list[list[int]]
    epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @classmethod
    def wrap(cls, sampler, mix: StageMix, stage_column: list[str]) -> "AdaptiveSampler":
        """`sampler`: the RepeatSampler TRL built (its fields are kept); `stage_column`: each example's stage."""
        sampler.__class__ = cls
        sampler.mix = mix
        sampler.pools = [[i for i, s in enumerate(stage_column) if s == name] for name in mix.stages]
        unknown = sorted(set(stage_column) - set(mix.stages))
        if unknown:
            raise ValueError(f"the training set holds stages {unknown} that the adaptive curriculum does not mix")
        return sampler

    def __iter__(self):
        rounds = self.num_samples // self.batch_size
        for i in range(rounds):
            chunk = self.mix.draw(self.epoch * rounds + i, self.batch_size, self.pools, self.seed or 0)
            for _ in range(self.repeat_count):
                for index in chunk:
                    for _ in range(self.mini_repeat_count):
                        yield index


def pass_column(names: list[str]) -> int:
    for name in PASS_REWARDS:
        if name in names:
            return names.index(name)
    raise ValueError(f"the adaptive curriculum reads passes from a {' or '.join(PASS_REWARDS)} reward; the run's "
                     f"rewards are {names}")


class StageMixing:
    """GrpoExpTrainer's part for a training set that mixes stages (its `stage` column), one per trainer: the mix
    logged per round, the stage kept with each completion, and, with a StageMix (adaptive), its pass rates updated
    after each round (`count_round` around the round's generation, dynamic sampling's extra rounds included), its
    state in checkpoints. Reads TRL's `_metrics`, `_log_completion_extra`, `_step` and `reward_func_names`, which a
    TRL upgrade may rename."""

    def __init__(self, trainer, mix_stages: list[str] | None, stage_mix: StageMix | None):
        self.trainer = trainer
        self.mix_stages = mix_stages  # the stages mixed, in the order of their figures; None: one stage
        self.stage_mix = stage_mix  # the adaptive curriculum's state; None: no adaptive sampler
        self.counts: torch.Tensor | None = None  # the round being generated: [passed, scored] per stage

    def observe(self, inputs: list[dict], rewards: torch.Tensor) -> None:
        """A round's gathered rewards (TRL's `_calculate_rewards`): its stage shares over every process (a
        collective: every process gets here alike) and, adaptive, its passes per stage."""
        trainer = self.trainer
        if not (self.mix_stages and trainer.model.training and inputs and "stage" in inputs[0]):
            return
        order = {name: i for i, name in enumerate(self.mix_stages)}
        local = torch.tensor([order[x["stage"]] for x in inputs], device=trainer.accelerator.device)
        ids = trainer.accelerator.gather(local).cpu()
        counts = torch.bincount(ids, minlength=len(self.mix_stages)).float()
        for name, count in zip(self.mix_stages, counts.tolist()):
            trainer._metrics["train"][f"curriculum/mix/{name}"].append(count / max(float(counts.sum()), 1.0))
        trainer._log_completion_extra("stage", [x["stage"] for x in inputs])  # completions.jsonl's `stage`
        if self.counts is not None:
            values = rewards[:, pass_column(list(trainer.reward_func_names))].detach().cpu()
            scored = ~torch.isnan(values)
            passed = scored & (values >= 0.5)
            for s in range(len(self.mix_stages)):
                self.counts[0, s] += float((passed & (ids == s)).sum())
                self.counts[1, s] += float((scored & (ids == s)).sum())

    def count_round(self, generate, inputs: list[dict]) -> dict:
        """`generate(inputs)` (a training round, with dynamic sampling's extra rounds), its passes folded into the
        pass rates afterwards."""
        self.counts = torch.zeros(2, len(self.mix_stages))
        try:  # dynamic sampling's extra rounds, generated inside, count towards this round's passes
            output = generate(inputs)
            counts = self.counts
        finally:
            self.counts = None
        self.stage_mix.update(self.generation_round(), counts[0].tolist(), counts[1].tolist())
        for name, rate in zip(self.stage_mix.stages, self.stage_mix.pass_rate):
            if rate is not None:
                self.trainer._metrics["train"][f"curriculum/pass_rate/{name}"].append(rate)
        return output

    def generation_round(self) -> int:
        """The round being generated, counted from the run's start: optimizer steps and this step's micro-batches
        (TRL's `_step` restarts at 0 on resume, at a step boundary) over the batches a round feeds. Exact while each
        epoch's batches are a multiple of gradient_accumulation_steps (always with 1, the default)."""
        trainer = self.trainer
        accumulation = trainer.args.gradient_accumulation_steps
        per_round = trainer.args.steps_per_generation * trainer.num_iterations
        return (trainer.state.global_step * accumulation + trainer._step % accumulation) // per_round

    def state(self) -> dict:
        """The adaptive curriculum's part of a checkpoint's run state."""
        return {STATE_KEY: self.stage_mix.state_dict()} if self.stage_mix is not None else {}

    def restore(self, checkpoint: Path, state_file: str) -> None:
        """Put back the pass rates a checkpoint saved (before training resumes from it)."""
        if self.stage_mix is None:
            return
        path = Path(checkpoint) / state_file
        saved = json.loads(path.read_text()).get(STATE_KEY) if path.is_file() else None
        if saved is None:
            logger.warning("%s holds no adaptive curriculum state; its pass rates start afresh", checkpoint)
            return
        self.stage_mix.load_state_dict(saved)
        logger.info("adaptive curriculum resumed with pass rates %s", {
            s: None if r is None else round(r, 3) for s, r in zip(self.stage_mix.stages, self.stage_mix.pass_rate)})


def lag_rounds(gradient_accumulation_steps: int, batches_per_round: int) -> int:
    """Rounds whose rewards a draw cannot count on (the module's docstring)."""
    return max(1, math.ceil(gradient_accumulation_steps / batches_per_round))
