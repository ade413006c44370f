"""`python -m tests.stop_main <overrides>`: tests/spread_reward_main.py's entrypoint (the real train app plus the
tests' rewards) with hooks that let tests/training/test_stop.py signal a run inside a chosen phase.

GRPO_EXP_TEST_MARKS=<dir>: a file appears in <dir> when a phase starts, holding the time it did:
  compilation         the rollout engine's first call of its compiled decoding step
  generation-<n>      the n-th rollout round (the engine's, or TRL's own `generate`)
  reward-<n>          the n-th call of the reward `sleepy`
  eval-during, eval-after   an evaluation's first batch, during training (held-out) or after it
  save-<checkpoint>   the publish of a checkpoint (checkpoints.publish)
GRPO_EXP_TEST_SLOW=<phase>=<seconds>[,...]: stretches a phase so that the tiny model's lasts long enough to be hit:
  decode   each decoding step of a rollout (the engine's or TRL's)
  eval     each token an evaluation decodes
  reward   each call of `sleepy`, in one sleep that polls nothing (as a slow reward function would)
  save     each checkpoint publish, before it renames anything
A phase's mark slows that one alone (save-checkpoint-2=60, reward-1=120; generation-3=0.2: round 3's decoding steps).
  hold-<mark>   waits, once that phase has started, until a stop is requested (at most the seconds given): the
                signal then lands inside the phase however slowly the test sends it on a loaded machine
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests import spread_reward_main


def _marks() -> Path | None:
    where = os.environ.get("GRPO_EXP_TEST_MARKS")
    return Path(where) if where else None


def mark(name: str) -> None:
    """The phase `name` starts now (written once: the first start of it is the one a test waits for)."""
    where = _marks()
    if where is None:
        return
    where.mkdir(parents=True, exist_ok=True)
    path = where / name
    if not path.exists():
        tmp = where / f".{name}.tmp"
        tmp.write_text(str(time.time()))
        os.replace(tmp, path)


def slow(*phases: str) -> float:
    """Seconds GRPO_EXP_TEST_SLOW gives the first of `phases` it names (0: not slowed); a phase is named by kind
    (`save`) or by its mark (`save-checkpoint-2`)."""
    given = dict(item.partition("=")[::2] for item in os.environ.get("GRPO_EXP_TEST_SLOW", "").split(",") if item)
    return next((float(given[p]) for p in phases if p in given), 0.0)


def hold(phase: str) -> None:
    """With hold-<phase>=<seconds> given, polls for a stop request until one comes or the seconds pass."""
    from grpo_exp.base import stop

    deadline = time.time() + slow(f"hold-{phase}")
    while stop.requested() is None and time.time() < deadline:
        time.sleep(0.05)


_calls = {"generation": 0, "reward": 0}


def sleepy(completions, **kwargs):
    """A reward that takes GRPO_EXP_TEST_SLOW's `reward` seconds in one sleep and scores 0."""
    _calls["reward"] += 1
    mark(f"reward-{_calls['reward']}")
    time.sleep(slow(f"reward-{_calls['reward']}", "reward"))
    return [0.0 for _ in completions]


def hook_phases() -> None:
    """Marks (and, where asked, slows) the phases above by wrapping the functions that run them."""
    from transformers import LogitsProcessor, LogitsProcessorList
    from transformers.generation.utils import GenerationMixin

    from grpo_exp.evaluation import generate as evaluation
    from grpo_exp.training import checkpoints
    from grpo_exp.training.rollout.engine import RolloutEngine

    def round_starts():
        _calls["generation"] += 1
        mark(f"generation-{_calls['generation']}")

    compile_step, engine_generate, engine_sample = (RolloutEngine._compile_step, RolloutEngine.generate,
                                                    RolloutEngine._sample)

    def _compile_step(self, *args, **kwargs):
        mark("compilation")
        return compile_step(self, *args, **kwargs)

    def generate(self, *args, **kwargs):
        round_starts()
        return engine_generate(self, *args, **kwargs)

    def _sample(self, *args, **kwargs):
        time.sleep(slow(f"generation-{_calls['generation']}", "decode"))
        return engine_sample(self, *args, **kwargs)

    RolloutEngine._compile_step, RolloutEngine.generate, RolloutEngine._sample = _compile_step, generate, _sample

    class Sleep(LogitsProcessor):
        def __call__(self, input_ids, scores):
            time.sleep(slow(f"generation-{_calls['generation']}", "decode"))
            return scores

    hf_generate = GenerationMixin.generate

    def trl_generate(self, *args, **kwargs):
        config = kwargs.get("generation_config")
        if config is not None and getattr(config, "do_sample", False):  # TRL's rollouts, not an evaluation
            round_starts()
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), Sleep()])
        return hf_generate(self, *args, **kwargs)

    GenerationMixin.generate = trl_generate

    completions, criterion = evaluation.generate_completions, evaluation.StopRequested.__call__

    def generate_completions(model, tokenizer, prompts, **kwargs):
        phase = "eval-during" if str(kwargs.get("desc", "")).startswith("held-out") else "eval-after"
        mark(phase)
        hold(phase)
        return completions(model, tokenizer, prompts, **kwargs)

    def each_token(self, input_ids, scores, **kwargs):
        time.sleep(slow("eval"))
        return criterion(self, input_ids, scores, **kwargs)

    evaluation.generate_completions, evaluation.StopRequested.__call__ = generate_completions, each_token

    publish = checkpoints.publish

    def slow_publish(staging, final):
        mark(f"save-{final.name}")
        time.sleep(slow(f"save-{final.name}", "save"))
        publish(staging, final)

    checkpoints.publish = slow_publish


def hooked_train_task():
    """The app's task with the hooks installed as it starts: after the task wrapper has set the CPU up, since
    they import torch, which reads its thread settings once."""
    from grpo_exp.apps import train

    task = train.train_task

    def train_task(cfg):
        hook_phases()
        return task(cfg)

    train.train_task = train_task


if __name__ == "__main__":
    from grpo_exp.core import rewards

    rewards.REGISTRY.update({**spread_reward_main.TEST_REWARDS, "sleepy": sleepy})
    spread_reward_main.kill_at_publish_step()
    hooked_train_task()
    spread_reward_main.main()
