"""The names of a run directory's files (docs/architecture.md, "The run directory"): the interface between
training, evaluation, the report, the web app and the user, so each is spelled once, here; and the two readings of
a job directory that the report and the web app share (a skipped sweep job, a run still training)."""

from __future__ import annotations

MODEL_DIR = "model"  # the trained model, an ordinary Hugging Face model directory
CHECKPOINTS_DIR = "checkpoints"
METRICS_FILE = "metrics.json"  # the stage's figures; its status "completed" marks the stage done for resume
HISTORY_FILE = "history.jsonl"  # one line per step
COMPLETIONS_FILE = "completions.jsonl"  # a sample of prompts, completions and rewards
STATUS_FILE = "status.json"  # how the job ended (apps/task)
SKIPPED = "skipped"  # status.json's status of a sweep job its study leaves out (curriculum.method_seeds): no run
ERROR_FILE = "error.txt"  # the traceback of a failed job
EVAL_FILE = "eval.json"  # the trained model on eval.split
EVAL_SAMPLES_FILE = "eval_samples.jsonl"  # every completion of that evaluation
BEFORE_AFTER_FILE = "before_after.json"  # trained against starting model, paired
BEFORE_AFTER_TABLE_FILE = "before_after.md"
# the starting model on the periodic evaluation's validation problems, for a run that scores no before/after
# (eval.after_train=false): the level its learning curve starts from
VALIDATION_START_FILE = "validation_start.json"
SETTINGS_FILE = "training_settings.json"  # the training settings a resume must match
SPEED_PLAN_FILE = "speed_plan.json"  # the speed plan the run computed with
LOCK_FILE = ".lock"  # the advisory lock of the process holding the directory
FISHER_FILE = "fisher.safetensors"  # the EWC state: Fisher and anchor
CURRICULUM_FILE = "curriculum.json"  # a curriculum's accuracy matrix and transfer metrics
CURRICULUM_EVAL_FILE = "curriculum_eval.json"  # one curriculum stage's scores on every stage
CURVES_FILE = "curves.png"
PEFT_SETTINGS_FILE = "grpo_exp_peft.json"  # in adapter/: the peft.* settings and model the adapter was trained with

# what a run logs about held-out problems (periodic evaluation, forgetting, drift): kept under their own names by
# the loggers, apart from the training figures
HELD_OUT_PREFIXES = ("eval/", "forgetting/", "drift/")


def skipped_job(path) -> bool:
    """Whether the directory is a sweep job that was skipped (status.json says so): a directory, not a run."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(path) / STATUS_FILE).read_text()).get("status") == SKIPPED
    except (OSError, ValueError, AttributeError):
        return False


def training_pid(run_dir) -> int | None:
    """The PID of the process training in run_dir (or in one of its curriculum stages) now, else None.

    The trainer writes its PID into <run dir>/.lock while it holds the lock and empties it on release; a
    live PID there means a run in progress. Only read, never locked: taking the lock, even shared, could
    make a run starting at that instant fail as "in use"."""
    import os
    from pathlib import Path

    run_dir = Path(run_dir)
    for lock in [run_dir / LOCK_FILE, *sorted(run_dir.glob(f"*/{LOCK_FILE}"))]:
        try:
            text = lock.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            try:
                os.kill(int(text), 0)
            except ProcessLookupError:
                continue  # a process that died without releasing: the kernel dropped its lock
            except PermissionError:
                pass  # alive, someone else's
            return int(text)
    return None


def stage_dir_name(index: int, stage: str) -> str:
    """A curriculum stage's directory in its run: 1_basic, 2_intermediate, ... (index from 0)."""
    return f"{index + 1}_{stage}"
