"""completions.jsonl: every `completions_every` steps (and the first), the step's prompts and completions with
their rewards per function, advantage, (a training set of several stages) stage and the columns reward functions
logged with TRL's `log_extra`, from TRL's `_logs`."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _finite(value):
    """A reward as JSON holds it: None for TRL's NaN (a reward that returned None for the row: not its task)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class CompletionsSample:
    """Appends a trainer's sampled completions to `path` (rank 0's; None on the other ranks: nothing is written)."""

    def __init__(self, path: str | Path | None, every: int):
        self.path = Path(path) if path else None
        self.every = every
        self.last_step = -1

    def maybe_write(self, trainer) -> None:
        """At TRL's `log` of a training step: write that step's completions if it is a sampled one."""
        step, logs = trainer.state.global_step, trainer._logs
        if (self.path is None or not trainer.model.training or step == self.last_step
                or not (step == 1 or step % self.every == 0) or not logs["prompt"]):
            return
        self.last_step = step
        rewards = {name: list(vals) for name, vals in logs["rewards"].items()}
        stages = list(logs["extra"].get("stage", []))  # a training set of several stages: each row's
        # what reward functions logged per completion (TRL's log_extra kwarg), aligned with the prompts
        extra = {name: list(vals) for name, vals in logs["extra"].items() if name != "stage"}
        with self.path.open("a") as fh:
            for i, (prompt, completion) in enumerate(zip(logs["prompt"], logs["completion"])):
                row = {
                    "step": step,
                    "prompt": prompt[-1]["content"] if isinstance(prompt, list) else prompt,
                    "completion": completion[-1]["content"] if isinstance(completion, list) else completion,
                    "rewards": {name: _finite(vals[i]) for name, vals in rewards.items() if i < len(vals)},
                    "advantage": logs["advantages"][i] if i < len(logs["advantages"]) else None,
                }
                if i < len(stages):
                    row["stage"] = stages[i]
                logged = {name: vals[i] for name, vals in extra.items() if i < len(vals)}
                if logged:
                    row["extra"] = logged
                fh.write(json.dumps(row) + "\n")
