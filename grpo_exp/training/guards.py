"""The trainer's guards: where training stops or skips a step instead of letting a bad one through.

A NaN/inf reward or loss stops the run before the bad update (`on_nonfinite=stop`), or (`skip`) turns every
optimizer step of its generation round into a no-op on every process; a first Ctrl-C/SIGTERM stops the run
within seconds, abandoning the step in progress (base/stop.py: every forward of the policy and every reward
function is a point where it does), and a data-parallel run after the current step; a batch meant to take its
old log-probs from its own training forward refuses to train once the policy has moved.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from transformers import TrainerCallback

from grpo_exp.base import dist, log, stop

logger = log.get_logger(__name__)


class NonFiniteError(RuntimeError):
    """A loss or reward was NaN/inf; training stops before the bad update and keeps the last checkpoint."""


# ---------------------------------------------------------------------------------------- non-finite values


class RoundGuard:
    """The round guard's state, one per trainer: whether the current generation round is poisoned (and why),
    whether the optimizer step being accumulated is dropped, and how many were. on_nonfinite=skip: a NaN/inf reward
    poisons its whole generation round (every optimizer step that trains on it), a NaN/inf loss the rest of its
    round; poisoned steps change no parameter or state. Others (dynamic sampling) ask it to skip a round
    (`skip_round`) rather than set its flags."""

    def __init__(self, on_nonfinite: str):
        self.on_nonfinite = on_nonfinite  # stop | skip
        self.poisoned: str | None = None  # why the current generation round is poisoned
        self.drop_update = False  # the optimizer step being accumulated must not happen
        self.skipped_steps = 0
        self.said: set[str] = set()  # the reasons a dropped update was already logged for

    def skip_round(self, why: str) -> None:
        """Drop every optimizer step the current round feeds (the first reason given is kept)."""
        self.poisoned = self.poisoned or why

    def start_round(self, trainer) -> None:
        """A new generation round starts clean (its rewards may poison it again); TRL's own test for a new round."""
        if trainer.model.training:
            generate_every = trainer.args.steps_per_generation * trainer.num_iterations
            if trainer._step % generate_every == 0 or trainer._buffered_inputs is None:
                self.poisoned = None

    def reward(self, trainer, func: Callable) -> Callable:
        """`func` with every reward checked for NaN/inf: stop the run, or (on_nonfinite=skip) drop the round."""

        def guarded(*args, **kwargs):
            with stop.urgent("reward scoring"):  # a reward function is the user's code: it cannot poll
                values = func(*args, **kwargs)
            bad = [v for v in values if v is not None and not math.isfinite(v)]
            if bad:
                where = f"reward function '{func.__name__}' returned {bad[0]} at step {trainer.state.global_step + 1}"
                if self.on_nonfinite == "stop":
                    raise NonFiniteError(f"{where}; stopped, last good checkpoint kept "
                                         f"(on_nonfinite=skip drops such batches instead)")
                self.poisoned = where
                values = [0.0 if v is not None and not math.isfinite(v) else v for v in values]
            return values

        guarded.__name__ = func.__name__
        return guarded

    def loss(self, trainer, model, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss, checked: a NaN/inf loss stops the run (on_nonfinite=stop) or poisons the rest of its
        round, and a poisoned round's micro-batch drops the optimizer step it accumulates into."""
        if model.training and self.poisoned is None and not torch.isfinite(loss):
            self.poisoned = f"non-finite loss ({float(loss)}) at step {trainer.state.global_step + 1}"
            if self.on_nonfinite == "stop":
                raise NonFiniteError(f"{self.poisoned}; stopped, last good checkpoint kept")
        if model.training and self.poisoned is not None:
            self.drop_update = True  # the optimizer step this micro-batch accumulates into is dropped
            # A zero that still belongs to the graph: backward runs and leaves every gradient at zero.
            return sum(p.sum() * 0.0 for p in model.parameters() if p.requires_grad)
        return loss


class DropPoisonedUpdates(TrainerCallback):
    """on_nonfinite=skip: turn the optimizer step of a poisoned round into a no-op, so parameters, AdamW's
    moments and step count, and the LR schedule are all exactly as before it.

    The trainer's optimizer is accelerate's wrapper; its `step_was_skipped` flag (set here) is what the HF
    loop reads to leave the scheduler alone, as it does for an fp16 overflow."""

    def __init__(self, trainer, guard: RoundGuard):
        self.trainer, self.guard = trainer, guard

    def on_train_begin(self, args, state, control, **kwargs):
        optimizer = self.trainer.optimizer
        if getattr(optimizer, "_grpo_exp_guarded", False):
            return
        original = optimizer.step
        guard = self.guard

        def step(*a, **k):
            # data-parallel: a non-finite value on one rank drops the update on all, or their weights part
            drop = dist.any_rank(guard.drop_update)
            if drop and not guard.drop_update:
                guard.drop_update = True
                guard.skip_round("a non-finite value on another process")
            optimizer._is_overflow = guard.drop_update
            if guard.drop_update:
                return None
            return original(*a, **k)

        optimizer.step = step
        optimizer._grpo_exp_guarded = True

    def on_optimizer_step(self, args, state, control, **kwargs):
        guard = self.guard
        if guard.drop_update:
            guard.skipped_steps += 1
            self.trainer.pending_logs.update({"skipped_update": 1, "skipped_reason": guard.poisoned or "non-finite"})
            why = guard.poisoned or "non-finite"
            # a model that never scores drops every step for the same reason: said once, counted in metrics.json
            if why in guard.said:
                logger.debug("step %s: update dropped (%s)", state.global_step + 1, why)
            else:
                guard.said.add(why)
                logger.warning("step %s: update dropped (%s); parameters and optimizer state unchanged; later steps "
                               "dropped for the same reason are counted in metrics.json's skipped_steps, not logged",
                               state.global_step + 1, why)
            guard.drop_update = False


# ------------------------------------------------------------------------------------------ the policy moved


def refuse_moved_policy(round_step: int, global_step: int) -> None:
    """Old log-probs by batch (speed.exact_shortcuts): a batch whose old log-probs are to come from its own training forward must
    train before the policy moves from the one that sampled it."""
    if global_step != round_step:
        raise RuntimeError(f"old log-probs by batch (speed.exact_shortcuts): a batch of the round generated at step "
                           f"{round_step} trains at step {global_step}, after the policy "
                           f"moved; set speed.exact_shortcuts=false")


# --------------------------------------------------------------------------------------------------- signals


class GracefulStop(TrainerCallback):
    """The stop request (base/stop.py) at the end of a step: that step is saved and training stops.

    In a single process a stop usually ends the step in progress before it gets here (`Stopped` out of a
    forward, a decoding step or a reward function); one asked for after the step's last poll (during its
    backward or optimizer step) ends the run here, the step finished and saved. Data-parallel runs stop only
    here, every rank at the same step: a signal may reach the ranks at different moments, so whether any rank
    has one is decided together."""

    def on_step_end(self, args, state, control, **kwargs):
        if dist.is_distributed() and dist.any_rank(stop.requested() is not None):
            stop.request()
        if stop.requested() is not None:
            control.should_save = True
            control.should_training_stop = True
        return control


def stop_points(model: torch.nn.Module):
    """Make every forward of `model` (training, scoring, TRL's generation, the Fisher's) a point where a stop
    abandons the step in progress: a hook on the input embedding, which every forward starts with (shared-prefix
    scoring's too, which calls the decoder without its LM head). Returns the hook's handle."""

    def poll(module, args):
        if not torch.compiler.is_compiling():  # a compiled graph must not bake the check in
            stop.check("a forward of the policy")

    return model.get_input_embeddings().register_forward_pre_hook(poll)
