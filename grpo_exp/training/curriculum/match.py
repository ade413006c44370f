"""curriculum.match_accuracy_of: train each stage only until its validation accuracy reaches another run's there.

Forgetting is compared at matched new-task accuracy (RL's Razor, arXiv 2509.04259): an SFT run that learns a stage
further than GRPO did may forget more for that reason alone. Given the directory of another run of the same stages
(the continual study's plain-GRPO job of the same seed), each stage here gets `train.stop_at_accuracy` = that run's
last periodic validation accuracy on the stage (history.jsonl's `eval/<stage>/accuracy` at its final step, on the
first eval.every_limit validation problems), and ends at the first of its own periodic evaluations that reaches it,
its train.max_steps at most. The stopping point is chosen on validation; the test split is scored after, as for every
stage. A stage that never reaches it trains every step, and its record says so."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import read_jsonl
from grpo_exp.base.run_files import CURRICULUM_FILE, HISTORY_FILE, stage_dir_name
from grpo_exp.evaluation.run import validation_limit
from grpo_exp.training.run_dir import finished_metrics


def stage_target(cfg, stages: list[str], i: int, stage_cfg) -> float | None:
    """Stage i's train.stop_at_accuracy from curriculum.match_accuracy_of (None without it), for `stage_cfg`, the
    stage as this run trains it; a one-line ConfigError where that run cannot give it (not a run of these stages,
    stage i unfinished, another number of validation problems scored)."""
    source = cfg.curriculum.get("match_accuracy_of")
    if not source:
        return None
    source, stage = Path(source), stages[i]
    what = f"curriculum.match_accuracy_of={source}"
    try:
        recorded = json.loads((source / CURRICULUM_FILE).read_text())["stages"]
    except (OSError, ValueError, KeyError):
        raise ConfigError(f"{what} holds no curriculum.json; give the directory of a finished run of "
                          f"curriculum.stages={stages} (the continual study's plain-GRPO job of this seed)") from None
    if recorded[:i + 1] != stages[:i + 1]:
        raise ConfigError(f"{what} ran the stages {recorded}, not {stages[:i + 1]} first; match a run of "
                          f"curriculum.stages={stages}")
    stage_dir = source / stage_dir_name(i, stage)
    if finished_metrics(stage_dir) is None:
        raise ConfigError(f"{what}: its stage {i + 1} ({stage}) has not finished; run that job first (in "
                          f"experiment=continual it comes earlier in the seed's jobs)")
    key = f"eval/{stage}/accuracy"
    rows = [r for r in read_jsonl(stage_dir / HISTORY_FILE) if key in r and r.get("stage", stage) == stage]
    if not rows:
        raise ConfigError(f"{what}: its stage {stage} logged no periodic validation accuracy ({key} in "
                          f"{HISTORY_FILE}); it ran with eval.every_steps=null")
    # the first eval.every_limit validation problems, at most the split (evaluation/run.validation_subset)
    scored, mine = rows[-1].get(f"eval/{stage}/n"), validation_limit(stage_cfg, stage_cfg.stage)
    if scored != mine:
        raise ConfigError(f"{what}: its stage {stage} scored {scored} validation problems during training "
                          f"(eval.every_limit) and this run would score {mine}; the accuracies compare on the same "
                          f"problems only: set eval.every_limit={scored}")
    return float(rows[-1][key])
