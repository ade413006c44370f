"""Atomic checkpoints and what resuming needs: the last complete checkpoint, and run files cut
back to it so a resumed run appends rather than repeats.

A checkpoint is written into `checkpoints/.staging-checkpoint-N/` and renamed to `checkpoint-N`
only once complete, so any `checkpoint-N` directory is whole (a kill during a save leaves only a
staging directory, which resume removes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from grpo_exp.base.io import RETIRED_SUFFIX, publish_dir, read_jsonl, repair_publish, write_json

STAGING_PREFIX = ".staging-"
STATE_FILE = "grpo_exp_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def staging_dir(checkpoint_dir: Path) -> Path:
    return checkpoint_dir.parent / (STAGING_PREFIX + checkpoint_dir.name)


def fsync_tree(path: Path) -> None:
    """Flush files before the rename that publishes them (a crash after rename must not expose holes)."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())


def publish(staging: Path, final: Path) -> None:
    fsync_tree(staging)
    publish_dir(staging, final)  # a re-save of the same step replaces the old one whole, never leaving none


def repair(run_dir: Path) -> list[str]:
    """Resume's clean-up after a kill: staging directories go, interrupted publishes of checkpoints and
    model/ are finished or undone. Returns what was done, one line each."""
    done = [f"removed an incomplete checkpoint left by a crash: {p.name}"
            for p in remove_staging(run_dir / "checkpoints")]
    # the staging of a model/ (or a LoRA run's adapter/) save that was killed
    for partial in [*run_dir.glob("model.tmp-*"), *run_dir.glob("adapter.tmp-*")]:
        shutil.rmtree(partial, ignore_errors=True)
        done.append(f"removed an incomplete model directory left by a crash: {partial.name}")
    finals = {p.with_name(p.name[: -len(RETIRED_SUFFIX)])
              for p in [*(run_dir / "checkpoints").glob("*" + RETIRED_SUFFIX), run_dir / ("model" + RETIRED_SUFFIX),
                        run_dir / ("adapter" + RETIRED_SUFFIX)]}
    for final in sorted(finals):
        what = repair_publish(final)
        if what:
            done.append(what)
    return done


def complete_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name)) and (p / "trainer_state.json").is_file()]
    return [p for _, p in sorted(found)]


def remove_staging(checkpoints_dir: str | Path) -> list[Path]:
    root = Path(checkpoints_dir)
    leftovers = [p for p in root.glob(STAGING_PREFIX + "*")] if root.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def last_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def checkpoint_step(checkpoint: Path) -> int:
    return json.loads((checkpoint / "trainer_state.json").read_text())["global_step"]


def truncate_jsonl(path: Path, max_step: int) -> int:
    """Keep the rows of steps <= max_step (later ones are redone after resuming); returns rows kept."""
    # tolerant: a kill can cut the last line short while it is being appended
    rows = [r for r in read_jsonl(path, tolerant=True) if r.get("step", 0) <= max_step]
    if path.exists():
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)
    return len(rows)


def write_state(checkpoint: Path, state: dict) -> None:
    write_json(checkpoint / STATE_FILE, state)
