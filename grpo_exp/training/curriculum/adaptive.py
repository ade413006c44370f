"""`curriculum=adaptive` end to end: one training run on every listed stage's training set (its sampler draws each
round's stages by their pass rates, mix.py), then every stage's held-out set scored as the sequential
curriculum scores it after its last stage, so that both write a comparable curriculum.json.

The budget is the sequential curriculum's: the stages' train.max_steps summed (each stage composed as
curriculum=progressive composes it, with the command line's overrides), and the longest of their
train.max_completion_length, so no stage's answers are cut shorter than its own run would cut them. The rest of
the recipe is the first stage's (the one a sequential curriculum trains from the same start). The run trains in
<run dir>/adaptive; curriculum.json holds the base row and one row, `adaptive`, plus each stage's paired gain over
the base model and the mean mix the run trained on."""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

from grpo_exp.base import cpu, dist, log
from grpo_exp.base.io import read_jsonl, write_json
from grpo_exp.base.run_files import CURRICULUM_EVAL_FILE, CURRICULUM_FILE, HISTORY_FILE
from grpo_exp.config.checks import validate
from grpo_exp.evaluation.continual import format_gains, paired_gain
from grpo_exp.training.curriculum.overrides import compose_stage, stage_overrides
from grpo_exp.training.curriculum import record
from grpo_exp.training.curriculum.record import check_eval_sets, earlier_result, format_table, new_result, score_base
from grpo_exp.training.run_dir import finished_metrics
from grpo_exp.training.stage import train

logger = log.get_logger(__name__)

RUN_DIR = "adaptive"  # the training run's subdirectory
ROW = "adaptive"  # its row of the accuracy matrix


def stage_configs(cfg, user_overrides: list[str], stages: list[str], out_dir: Path) -> list:
    """Each stage composed once, as a curriculum stage is, with the training run's directory, start model, resume and
    hub push: its training set, held-out set and settings, and (the first) the recipe the run trains with."""
    return [compose_stage(stage_overrides(user_overrides, s, out_dir, cfg.init_from and str(cfg.init_from),
                                          bool(cfg.resume), push=bool(cfg.get("push_to_hub")))) for s in stages]


def adaptive_config(cfg, stage_cfgs: list):
    """The training run's config: the first stage's (stage_configs), with the adaptive curriculum's settings, the
    summed steps and the longest completion length."""
    run_cfg = copy.deepcopy(stage_cfgs[0])
    run_cfg.curriculum = cfg.curriculum  # a stage's composition sets curriculum=none
    run_cfg.train.max_steps = sum(int(c.train.max_steps) for c in stage_cfgs)
    run_cfg.train.max_completion_length = max(int(c.train.max_completion_length) for c in stage_cfgs)
    run_cfg.eval.after_train = False  # every stage is scored below instead of the first stage alone
    return run_cfg


def mean_mix(history: Path, stages: list[str]) -> dict[str, float | None]:
    """Each stage's mean share of the completions the run generated (curriculum/mix/<stage> over its steps)."""
    rows = read_jsonl(history, tolerant=True) if history.is_file() else []
    shares = {s: [r[f"curriculum/mix/{s}"] for r in rows if f"curriculum/mix/{s}" in r] for s in stages}
    return {s: statistics.fmean(v) if v else None for s, v in shares.items()}


def run_adaptive(cfg, user_overrides: list[str]) -> dict:
    """Train the adaptive curriculum in <run dir>/adaptive and write curriculum.json."""
    root = Path(cfg.paths.output_dir)  # cfg was checked by the entrypoint
    stages = list(dict.fromkeys(cfg.curriculum.stages))
    out_dir = root / RUN_DIR
    stage_cfgs = stage_configs(cfg, user_overrides, stages, out_dir)
    for stage_cfg in stage_cfgs:
        validate(stage_cfg)
    run_cfg = adaptive_config(cfg, stage_cfgs)
    validate(run_cfg)  # the summed budget and the adaptive settings, as the run trains them
    check_eval_sets(cfg, stage_cfgs)
    cpu.apply(cfg.cpu)  # before the base evaluation: oversubscribed threads spin and crawl

    result = {**new_result(cfg, stages), "row_labels": [ROW], "band": list(cfg.curriculum.band)}
    earlier = earlier_result(root, stages) if cfg.resume else None
    score_base(cfg, stage_cfgs, earlier, result)
    logger.info("adaptive curriculum over %s: %d steps in %s", ", ".join(stages), run_cfg.train.max_steps, out_dir)
    metrics = train(run_cfg, pools={s: c.stage for s, c in zip(stages, stage_cfgs)})
    if not dist.is_main():
        return result
    limit, batch = cfg.curriculum.eval_limit, cfg.curriculum.eval_batch_size
    kept = earlier and earlier.get("matrix") and earlier.get("correct", {}).get("rows")
    if kept and finished_metrics(out_dir) is not None:
        logger.info("adaptive curriculum: %s already scored; kept", out_dir)
        row, bits, evals = earlier["matrix"][0], earlier["correct"]["rows"][0], earlier["stage_metrics"][0]["eval"]
    else:
        scored = record.evaluate_dir(cfg.model, cfg.paths.cache_dir, str(out_dir / "model"), stage_cfgs, limit, batch,
                               cfg.train.seed)
        evals = [m for m, _ in scored]
        row, bits = [m["accuracy"] for m in evals], [b for _, b in scored]
    result["matrix"], result["correct"]["rows"] = [row], [bits]
    result["stage_metrics"] = [{"stage": ROW, "dir": str(out_dir), "reward_mean_first": metrics["reward_mean_first"],
                                "reward_mean_last": metrics["reward_mean_last"], "steps": metrics["steps"],
                                "eval": evals}]
    result["mix"] = mean_mix(out_dir / HISTORY_FILE, stages)
    # one row: no stage is trained after another, so there is no backward transfer or forgetting to measure
    result.update({"average_accuracy": sum(row) / len(row), "bwt": None, "forgetting_max": None,
                   "forgetting_mean": None})
    result["table"] = format_table(stages, ([("base", result["base"])] if result["base"] else []) + [(ROW, row)])
    base_bits = result["correct"]["base"]
    result["stage_gains"] = [paired_gain(s, base_bits[j], bits[j]) for j, s in enumerate(stages)] if base_bits else []
    result["gains_table"] = format_gains(result["stage_gains"])
    write_json(out_dir / CURRICULUM_EVAL_FILE, {"sets": {s: m for s, m in zip(stages, evals)}})
    write_json(root / CURRICULUM_FILE, result)
    logger.info("adaptive curriculum, accuracy on every stage's held-out set:\n%s\n%s\naverage accuracy %.3f; "
                "mean mix %s", result["table"], result["gains_table"], result["average_accuracy"],
                {s: None if v is None else round(v, 3) for s, v in result["mix"].items()})
    return result
