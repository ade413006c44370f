"""Held-out accuracy during training (`eval.every_steps`): the learning curve users should watch.

Training reward is measured on sampled completions at the training temperature, on prompts the
policy trains on; greedy accuracy on held-out problems is what a user wants to see move. Every N
optimizer steps (and after the last) the callback scores a small fixed subset of the stage's
held-out split and hands `eval/<set>/accuracy` (and format, length) to the trainer's next log row,
so it lands in history.jsonl and wandb on the same `train/global_step` axis as everything else.

With `train.stop_at_accuracy` the first of these evaluations whose accuracy reaches it ends the stage there (a
stopping point chosen on validation, never on test): the continual study's SFT run matched to GRPO's accuracy.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

from grpo_exp.base import log
from grpo_exp.evaluation.generate import evaluate

logger = log.get_logger(__name__)


class HeldOutEvalCallback(TrainerCallback):
    def __init__(self, pending_logs: dict, set_name: str, examples: list[dict], every_steps: int, *,
                 system_prompt: str, max_new_tokens: int, batch_size: int, judge=None, decode: str = "auto",
                 stop_at: float | None = None, engine_cache_mb: float | None = None):
        self.pending_logs = pending_logs  # the trainer merges and clears it in its next log() call
        self.set_name, self.examples, self.every_steps = set_name, examples, every_steps
        self.system_prompt, self.max_new_tokens, self.batch_size = system_prompt, max_new_tokens, batch_size
        self.judge = judge  # a prompts stage's eval reward (evaluation/judge.py), else None
        self.decode = decode  # eval.decode (evaluation/generate.decode_path)
        self.engine_cache_mb = engine_cache_mb  # eval.engine_cache_mb
        self.stop_at = stop_at  # train.stop_at_accuracy
        self.reached: dict | None = None  # where it was reached: {"target", "step", "accuracy", "n"}

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        step = state.global_step
        if step % self.every_steps and step != state.max_steps:
            return control
        started = time.perf_counter()
        metrics, _ = evaluate(model, processing_class, self.examples, system_prompt=self.system_prompt,
                              max_new_tokens=self.max_new_tokens, batch_size=self.batch_size,
                              desc=f"held-out eval {self.set_name}", judge=self.judge, decode=self.decode,
                              engine_cache_mb=self.engine_cache_mb)
        prefix = f"eval/{self.set_name}"
        self.pending_logs.update({
            f"{prefix}/accuracy": metrics["accuracy"],
            f"{prefix}/format": metrics["format_compliance"],
            f"{prefix}/mean_tokens": metrics["mean_completion_tokens"],
            f"{prefix}/n": metrics["n"],
            f"{prefix}/seconds": time.perf_counter() - started,
        })
        if self.stop_at is not None and metrics["accuracy"] >= self.stop_at:
            self.reached = {"target": self.stop_at, "step": step, "accuracy": metrics["accuracy"], "n": metrics["n"]}
            if step != state.max_steps:
                logger.info("validation accuracy %.3f on %d problems reached train.stop_at_accuracy=%g at step %d of "
                            "%d: the stage ends here", metrics["accuracy"], metrics["n"], self.stop_at, step,
                            state.max_steps)
                control.should_training_stop = True
        return control


def held_out_callback(cfg, pending_logs: dict) -> HeldOutEvalCallback:
    """The `eval.every_steps` callback of a stage: the first eval.every_limit problems of its validation split (a
    curve to choose settings by, so never the test split), scored at the stage's completion length."""
    from grpo_exp.evaluation.judge import for_stage
    from grpo_exp.evaluation.run import validation_subset

    return HeldOutEvalCallback(pending_logs, cfg.stage.name, validation_subset(cfg, cfg.stage), cfg.eval.every_steps,
                               system_prompt=cfg.reward.system_prompt,
                               max_new_tokens=cfg.train.max_completion_length, batch_size=cfg.eval.batch_size,
                               judge=for_stage(cfg.stage, list(cfg.reward.funcs)), decode=cfg.eval.decode,
                               stop_at=cfg.train.get("stop_at_accuracy"), engine_cache_mb=cfg.eval.engine_cache_mb)
