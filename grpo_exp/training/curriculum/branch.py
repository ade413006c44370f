"""curriculum.branch_from: start a curriculum from the finished stages it shares with another run of it.

Methods compared on one seed (plain GRPO, EWC, replay) differ only from the second stage on: the first stage has
no earlier stage to protect or replay, so it trains the same model under all of them. A branch takes such stages
from an earlier run (its directory, the accuracy-matrix rows and per-problem results it scored) instead of
training them again, and trains the rest; every method then starts its second stage from the same model, a
paired design. A stage is shared only when every stage up to it was recorded with this run's training settings
(training_settings.json, compared as resume compares them); the first stage's ewc.lambda may differ when the
earlier run saved the Fisher this run needs (or this run needs none), since it only decides whether that
stage's Fisher is saved."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from grpo_exp.base import log
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import write_json
from grpo_exp.base.run_files import CURRICULUM_FILE, LOCK_FILE, SETTINGS_FILE, stage_dir_name
from grpo_exp.training import ewc
from grpo_exp.training.run_dir import differences, training_settings

logger = log.get_logger(__name__)

# not taken into a branch: resume state and the earlier run's own tracker run
_SKIPPED = ("checkpoints", "wandb", "trackio", LOCK_FILE)
_LINK_BYTES = 1 << 20  # larger files (the model, the Fisher) are hard-linked; a finished stage never rewrites them
# records from before curriculum.json kept its evaluation split scored the default one
_SPLIT_BEFORE_RECORD = "test"


class NothingToShare(ConfigError):
    """curriculum.branch_from holds no finished stage this run could take (no record yet, or its first stage trained
    other settings): curriculum.branch_from_missing=train trains every stage instead."""


def stage_dir(root: Path, index: int, stage: str) -> Path:
    return Path(root) / stage_dir_name(index, stage)


def shared_stages(cfg: Any, root: Path, stages: list[str], stage_config: Callable[[int, str | None], Any],
                  finished: Callable[[Path], Any]) -> tuple[dict, int]:
    """(the earlier run's curriculum.json, how many of its first stages this run shares). `stage_config(i,
    init_from)` composes stage i as this run trains it; `finished(dir)` is a finished stage's metrics or None.
    Raises a one-line ConfigError when not even the first stage can be shared."""
    source = Path(cfg.curriculum.branch_from)
    record_path = source / CURRICULUM_FILE
    if not record_path.is_file():
        raise NothingToShare(f"curriculum.branch_from={source} holds no curriculum.json; give the directory of a run "
                          f"of curriculum.stages={stages} (one job of a sweep)")
    earlier = json.loads(record_path.read_text())
    run_facts = {"model": cfg.model.name, "seed": cfg.train.seed, "eval_limit": cfg.curriculum.eval_limit,
                 "eval_split": cfg.eval.split, "eval_batch_size": cfg.curriculum.eval_batch_size,
                 "init_from": cfg.init_from and str(cfg.init_from)}
    # the batch pads prompts together, and padding can change a greedy answer; records from before it was kept
    # say nothing, and are taken as they are
    then = {**earlier, "eval_split": earlier.get("eval_split", _SPLIT_BEFORE_RECORD),
            "eval_batch_size": earlier.get("eval_batch_size", cfg.curriculum.eval_batch_size)}
    changed = [f"{k} ({then.get(k)!r} -> {v!r})" for k, v in run_facts.items() if then.get(k) != v]
    if changed:
        raise ConfigError(f"curriculum.branch_from={source} was run with other settings: {'; '.join(changed)}; "
                          f"branch from a run of the same model, seed, start model and evaluation")
    shared, reason, previous = 0, "", cfg.init_from and str(cfg.init_from)
    rows = earlier.get("correct", {}).get("rows", [])
    for i, stage in enumerate(stages):
        src = stage_dir(source, i, stage)
        if i >= len(earlier.get("stages", [])) or earlier["stages"][i] != stage:
            reason = f"its stage {i + 1} is not {stage}"
            break
        if i >= len(rows) or finished(src) is None or not (src / SETTINGS_FILE).is_file():
            reason = f"its stage {i + 1} ({stage}) did not finish"
            break
        changed = changed_settings(cfg, i, src, stage_config(i, previous), source, root)
        if changed:
            reason = f"stage {i + 1} ({stage}) trains other settings: {'; '.join(changed)}"
            break
        shared += 1
        previous = str(stage_dir(root, i, stage))
    if not shared:
        raise NothingToShare(f"curriculum.branch_from={source} shares no finished stage with this run: {reason}; "
                          f"branch from a run whose first stage trained as this run's does")
    if shared < len(stages):
        logger.info("curriculum.branch_from=%s: %d of %d stages shared; this run trains from stage %d on (%s)",
                    source, shared, len(stages), shared + 1, reason)
    return earlier, shared


def changed_settings(cfg: Any, index: int, src: Path, stage_cfg: Any, source: Path, root: Path) -> list[str]:
    then = json.loads((src / SETTINGS_FILE).read_text())
    now = training_settings(stage_cfg)
    if then.get("init_from"):  # the stage before, in the earlier run's directory or in this one's
        then["init_from"] = str(then["init_from"]).replace(str(source), str(root), 1)
    changed = differences(then, now)
    if index == 0:
        # the first stage carries no EWC state in, so ewc.lambda there only decides whether its Fisher is saved
        has_fisher = (src / ewc.FISHER_FILE).is_file()
        if has_fisher or cfg.ewc["lambda"] == 0:
            changed = [c for c in changed if not c.startswith("ewc.lambda ")]
        # and ewc.fisher / ewc.fisher_norm only which Fisher: a saved one serves where the next stage converts it
        # (ewc.conform: a sampled Fisher under fisher=uniform, a raw one under fisher_norm=mean)
        lam = cfg.ewc["lambda"]
        free = {"ewc.fisher ": lam == 0 or (has_fisher and cfg.ewc["fisher"] == "uniform"),
                "ewc.fisher_norm ": lam == 0 or (has_fisher and cfg.ewc["fisher_norm"] == "mean")}
        changed = [c for c in changed if not any(c.startswith(key) and ok for key, ok in free.items())]
    return changed


def take_stages(earlier: dict, shared: int, stages: list[str], source: Path, root: Path, fresh: dict) -> None:
    """Bring the first `shared` stages into root (large files hard-linked, the rest copied) and write root's
    curriculum.json: `fresh` (this run's new record) with those stages' scores, which the curriculum then
    continues as a resume would."""
    source = Path(source)
    for i in range(shared):
        _copy_stage(stage_dir(source, i, stages[i]), stage_dir(root, i, stages[i]))
    record = {**fresh, "base": earlier.get("base"), "matrix": earlier["matrix"][:shared],
              "correct": {"base": earlier.get("correct", {}).get("base"),
                          "rows": earlier["correct"]["rows"][:shared]},
              "stage_metrics": [{**m, "dir": str(stage_dir(root, i, stages[i])), "branched_from": m.get("dir")}
                                for i, m in enumerate(earlier["stage_metrics"][:shared])],
              "branched_from": {"dir": str(source), "stages": stages[:shared]}}
    write_json(root / CURRICULUM_FILE, record)
    logger.info("curriculum.branch_from=%s: took %s (model, scores, history) instead of training %s",
                source, ", ".join(stages[:shared]), "it" if shared == 1 else "them")


def _copy_stage(src: Path, dst: Path) -> None:
    def copy(a: str, b: str) -> None:
        if os.path.getsize(a) > _LINK_BYTES:
            try:
                os.link(a, b)
                return
            except OSError:  # another filesystem
                pass
        shutil.copy2(a, b)

    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n in _SKIPPED and Path(d) == src],
                    copy_function=copy, dirs_exist_ok=True)
