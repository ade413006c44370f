"""`python -m tests.spread_reward_main <overrides>`: the real train entrypoint plus test rewards.

The tiny random model scores 0 on math rewards, so GRPO advantages, gradients and optimizer
state would all be zero. These rewards have spread on random-token text (and one turns NaN on
request), so subprocess tests can check that training state survives kills and resumes.
"""

from __future__ import annotations

import math
import os

from grpo_exp.apps.train import main
from grpo_exp.core import rewards

_calls = {"n": 0}


def vowel_fraction(completions, **kwargs):
    texts = [rewards.completion_text(c) for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def nan_after(completions, **kwargs):
    """NaN from the call number given in GRPO_EXP_TEST_NAN_AFTER on (0-based)."""
    _calls["n"] += 1
    bad = _calls["n"] > int(os.environ.get("GRPO_EXP_TEST_NAN_AFTER", "1000000"))
    return [math.nan if bad else 0.0 for _ in completions]


TEST_REWARDS = {"vowel_fraction": vowel_fraction, "nan_after": nan_after}

def kill_at_publish_step() -> None:
    """GRPO_EXP_TEST_KILL_AT=<step>:<dir name>: die like SIGKILL (no clean-up) at that step of a publish."""
    spec = os.environ.get("GRPO_EXP_TEST_KILL_AT")
    if not spec:
        return
    from grpo_exp.base import io

    step, name = spec.split(":", 1)

    def hook(at, final):
        if at == step and final.name == name:
            os._exit(137)

    io.publish_fault_hook = hook


if __name__ == "__main__":
    rewards.REGISTRY.update(TEST_REWARDS)
    kill_at_publish_step()
    main()
