"""What a stop keeps (base/stop.py asks, the trainer's loops raise): at every step's end the RNG states as that step
left them, and on a stop a checkpoint of the last finished step when none was written since it finished.

The step in progress was abandoned: the weights and the optimizer are as the last finished step left them (an
optimizer step is never cut short), and so, put back, are the RNG states, so the checkpoint is the one a save at
that step's end would have written.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from grpo_exp.base import log, stop
from grpo_exp.training import checkpoints

logger = log.get_logger(__name__)


def rng_states() -> dict:
    """The RNG states HF's checkpoint holds (Trainer._save_rng_state), in memory."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.random.set_rng_state_all(states["cuda"])


class StepEndState:
    """Wraps a trainer's callback handler so that, at every step's end after its callbacks, the RNG states are
    kept, and a stop during those callbacks (the held-out evaluation, the forgetting one) abandons them, not the
    step: it finished, so it is logged and saved as any step is, and training stops there.

    HF's callback handler is wrapped rather than a Trainer method overridden: nothing after the step-end callbacks
    and before the save draws a random number (the log row and the save itself do not)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.rng: dict | None = None  # as the last finished step left them
        handler = trainer.callback_handler
        step_end = handler.on_step_end

        def on_step_end(args, state, control):
            try:
                control = step_end(args, state, control)
            except stop.Stopped as err:
                logger.warning("%s at step %s: the step finished, so it is saved; the rest of its step-end "
                               "work is skipped", err, state.global_step)
                control.should_save = True
                control.should_training_stop = True
            self.rng = rng_states()
            return control

        handler.on_step_end = on_step_end

    def save_on_stop(self) -> Path | None:
        """A checkpoint of the last finished step, written on a stop when none was since that step finished;
        returns it, or None when there is nothing new to save (the last checkpoint is kept as it is)."""
        trainer = self.trainer
        step = trainer.state.global_step
        last = checkpoints.last_checkpoint(trainer.args.output_dir)
        if step == 0 or (last is not None and checkpoints.checkpoint_step(last) >= step):
            return None
        if self.rng is not None:
            set_rng_states(self.rng)
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        return Path(trainer.args.output_dir) / f"checkpoint-{step}"
