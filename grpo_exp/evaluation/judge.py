"""Held-out correctness on a prompts stage: its eval reward (stage.eval_reward, else the first of reward.funcs) reaching stage.eval_threshold."""

from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

from grpo_exp.base import log

logger = log.get_logger(__name__)


def _ignore(*args: Any, **kwargs: Any) -> None:
    """log_extra and log_metric at evaluation: there is no completions table or step to log to."""


@dataclass
class RewardJudge:
    """Scores held-out completions with a reward function, called as TRL calls it in training, and counts a
    completion solved where its score reaches `threshold`; a score of None (a reward for other rows' tasks) is
    not solved, and counted as unscored."""

    name: str  # as the config names it: a registered name or an import path
    func: Callable[..., list]
    threshold: float

    def scores(self, examples: list[dict], prompts: list[list[dict]], texts: list[str]) -> list[float | None]:
        """One score per completion. The reward gets the rows' columns, the chat prompts and the completions as
        assistant messages, as in training; completion_ids and trainer_state are None here (no trainer is
        running), and log_extra / log_metric do nothing."""
        names = list(dict.fromkeys(k for ex in examples for k in ex.get("columns", {})))
        columns = {name: [ex.get("columns", {}).get(name) for ex in examples] for name in names}
        completions = [[{"role": "assistant", "content": text}] for text in texts]
        values = list(self.func(prompts=prompts, completions=completions, completion_ids=None, trainer_state=None,
                                log_extra=_ignore, log_metric=_ignore, **columns))
        if len(values) != len(texts):
            raise ValueError(f"eval reward '{self.name}' returned {len(values)} scores for {len(texts)} completions")
        unscored = sum(v is None for v in values)
        if unscored:
            logger.warning("eval reward '%s' returned None for %d of %d held-out completions: they count as not "
                           "solved (stage.eval_reward names a reward that scores every row)", self.name, unscored,
                           len(values))
        return [None if v is None else float(v) for v in values]

    def solved(self, score: float | None) -> bool:
        return score is not None and math.isfinite(score) and score >= self.threshold

    def record(self) -> dict:
        """What decided accuracy, for eval.json and the starting model's cache key: the reward, the threshold and a
        hash of the function's source (an edited reward scores the starting model anew)."""
        try:
            source = inspect.getsource(self.func)
        except (OSError, TypeError):
            source = repr(self.func)
        return {"reward": self.name, "threshold": self.threshold,
                "source_sha256": hashlib.sha256(source.encode()).hexdigest()[:16]}

    def describe(self) -> str:
        return f"{self.name} >= {self.threshold:g}"


def eval_reward_name(stage: Any, reward_funcs: list[str]) -> str | None:
    """The reward that scores a prompts stage's held-out sets: stage.eval_reward, else the first of reward.funcs;
    None for the other stages (scored by their answer)."""
    if stage.get("dataset") != "prompts":
        return None
    named = stage.get("eval_reward")
    return str(named) if named else (str(reward_funcs[0]) if reward_funcs else None)


def for_stage(stage: Any, reward_funcs: list[str]) -> RewardJudge | None:
    """The judge of a stage's held-out sets, or None where the correctness reward scores them (generated, GSM8K)."""
    from grpo_exp.core import rewards

    name = eval_reward_name(stage, list(reward_funcs))
    if name is None:
        return None
    key = "stage.eval_reward" if stage.get("eval_reward") else "reward.funcs"
    return RewardJudge(name, rewards.resolve(name, key=key), float(stage.get("eval_threshold", 1.0)))
