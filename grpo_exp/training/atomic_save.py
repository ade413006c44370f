"""A trainer's checkpoint written atomically: HF's checkpoint into a staging directory, grpo-exp's run state beside
it, renamed into place when complete (training/checkpoints.py), so that a kill leaves the last complete one."""

from __future__ import annotations

import shutil
from pathlib import Path

from transformers.trainer_utils import rotate_checkpoints

from grpo_exp.base import dist
from grpo_exp.base.errors import DiskFullError
from grpo_exp.base.io import disk_full_reason, state_bytes
from grpo_exp.training import checkpoints


def save_checkpoint(trainer, hf_save, model, trial, run_state: dict) -> None:
    """`hf_save(model, trial)` (TRL's and HF's `_save_checkpoint`) staged and published, with `run_state` in
    the checkpoint's grpo_exp_state.json.

    Data-parallel: rank 0 writes the weights, optimizer and state, every rank its own RNG state; rank 0
    publishes once all of them have written."""
    run_dir = Path(trainer._get_output_dir(trial=trial))
    final = run_dir / f"checkpoint-{trainer.state.global_step}"
    staging = checkpoints.staging_dir(final)
    staging.mkdir(parents=True, exist_ok=True)
    original = trainer.args.output_dir
    main = trainer.accelerator.is_main_process
    trainer.args.output_dir = str(staging)  # HF writes <output_dir>/checkpoint-N; point it at the staging area
    try:
        hf_save(model, trial)
        dist.barrier()  # every rank's rng_state_<rank>.pth is in the staging area
        if not main:
            return
        written = staging / final.name
        checkpoints.write_state(written, {**run_state, "global_step": trainer.state.global_step})
        checkpoints.publish(written, final)
    except Exception as err:
        # before the cleanup below frees the partial write's space; a checkpoint holds the weights and
        # AdamW's two moments, about three times the model
        full = disk_full_reason(err, final, 3 * state_bytes(trainer.model))
        if full:
            raise DiskFullError(f"{full}; the last complete checkpoint is kept") from err
        raise
    finally:
        trainer.args.output_dir = original
        if main:
            shutil.rmtree(staging, ignore_errors=True)
    rotate_checkpoints(output_dir=str(run_dir), save_total_limit=trainer.args.save_total_limit,
                       best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=False)
