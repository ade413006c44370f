"""Runs stages in sequence (each from the last one's model and EWC state) and measures forgetting:
the accuracy matrix R[trained stage][evaluated stage], average accuracy, backward transfer (BWT,
Lopez-Paz & Ranzato 2017) and forgetting (Chaudhry et al. 2018).

Data-parallel (torchrun): every process trains every stage; rank 0 alone evaluates and writes the
curriculum's files, while the others wait for it at the next stage's first collective."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from grpo_exp.base import cpu, dist, log
from grpo_exp.base.io import write_json
from grpo_exp.base.text import markdown_table
from grpo_exp.config.checks import validate
from grpo_exp.core import models
from grpo_exp.evaluation.generate import evaluate
from grpo_exp.evaluation.run import held_out_split
from grpo_exp.training.stage import finished_metrics, train

logger = log.get_logger(__name__)

# Overrides that the curriculum sets per stage itself.
_PER_STAGE_KEYS = ("stage", "curriculum", "init_from", "paths.output_dir", "resume", "eval.forgetting_sets",
                   "push_to_hub")


def stage_overrides(user_overrides: list[str], stage: str, out_dir: Path, init_from: str | None,
                    resume: bool = False, earlier: list[str] | None = None, push: bool = False) -> list[str]:
    """`earlier`: the stages before this one, whose forgetting it tracks (eval.forgetting_sets). `push`: this
    stage uploads its model/ (push_to_hub: the last stage only, so the hub repo gets the curriculum's result)."""
    kept = [o for o in user_overrides
            if not o.lstrip("+~").split("=", 1)[0].startswith(_PER_STAGE_KEYS) and not o.startswith("hydra")]
    extra = [f"stage={stage}", "curriculum=none", f"paths.output_dir={out_dir}", f"resume={str(resume).lower()}",
             f"push_to_hub={str(push).lower()}"]
    if init_from:
        extra.append(f"init_from={init_from}")
    if earlier and init_from:
        extra.append(f"eval.forgetting_sets=[{','.join(earlier)}]")
    return [*kept, *extra]


def compose_stage(overrides: list[str]):
    """The config `python -m grpo_exp.train <overrides>` would get, composed with Hydra's API."""
    from grpo_exp.config.compose import compose

    return compose("train", overrides)


def transfer_metrics(matrix: list[list[float]]) -> dict:
    """Average accuracy, BWT and forgetting from R[i][j] (row i: after training stage i).

    Only entries with j <= i are read, so rows may stop at the diagonal.
    """
    t = len(matrix)
    final = matrix[-1]
    out = {"average_accuracy": sum(final[:t]) / t}
    if t < 2:
        return {**out, "bwt": None, "forgetting_max": None, "forgetting_mean": None}
    bwt = sum(final[j] - matrix[j][j] for j in range(t - 1)) / (t - 1)
    forgetting = [max(matrix[i][j] for i in range(j, t - 1)) - final[j] for j in range(t - 1)]
    return {**out, "bwt": bwt, "forgetting_max": max(forgetting), "forgetting_mean": sum(forgetting) / len(forgetting),
            "forgetting_per_stage": forgetting}


def format_table(stages: list[str], rows: list[tuple[str, list[float | None]]]) -> str:
    """The accuracy matrix: one row per trained stage (and the base model), one column per evaluated stage."""
    return markdown_table(["after \\ eval", *stages],
                          [[label, *(f"{v:.3f}" if v is not None else "" for v in values)] for label, values in rows])


def _evaluate_dir(model_cfg, cache_dir, model_dir: str | None, stage_cfgs: list, limit: int, batch_size: int,
                  seed: int) -> list[dict]:
    """Accuracy of one model on the held-out split (eval.split) of each given stage."""
    model, tokenizer = models.load(model_cfg, cache_dir, seed=seed, init_from=model_dir)
    results = []
    for stage_cfg in stage_cfgs:
        # the problems `python -m grpo_exp.evaluate` scores for this stage with eval.limit=limit
        examples = held_out_split(stage_cfg.stage, stage_cfg.eval.split, limit, stage_cfg.train.seed)[:limit]
        metrics, _ = evaluate(model, tokenizer, examples, system_prompt=stage_cfg.reward.system_prompt,
                              max_new_tokens=stage_cfg.train.max_completion_length, batch_size=batch_size,
                              seed=seed, desc=f"eval {stage_cfg.stage.name}")
        results.append(metrics)
    del model
    gc.collect()
    return results


def run_curriculum(cfg, user_overrides: list[str]) -> dict:
    """Train every stage of cfg.curriculum.stages in its own subdirectory and write curriculum.json."""
    validate(cfg)
    root = Path(cfg.paths.output_dir)
    stages = list(cfg.curriculum.stages)
    limit, batch = cfg.curriculum.eval_limit, cfg.curriculum.eval_batch_size
    stage_cfgs = [compose_stage(stage_overrides(user_overrides, s, root / f"{i + 1}_{s}", None))
                  for i, s in enumerate(stages)]
    for stage_cfg in stage_cfgs:
        validate(stage_cfg)  # every stage's settings are checked before the first one trains
    cpu.apply(cfg.cpu)  # before the base evaluation: oversubscribed threads spin and crawl

    result = {"stages": stages, "ewc_lambda": cfg.ewc["lambda"], "model": cfg.model.name, "seed": cfg.train.seed,
              "eval_limit": limit, "matrix": [], "base": None, "stage_metrics": []}
    earlier = _earlier_result(root, stages) if cfg.resume else None
    main = dist.is_main()
    if cfg.curriculum.eval_base and main:
        if earlier and earlier.get("base"):
            result["base"] = earlier["base"]
        else:
            base = _evaluate_dir(cfg.model, cfg.paths.cache_dir, cfg.init_from and str(cfg.init_from), stage_cfgs,
                                 limit, batch, cfg.train.seed)
            result["base"] = [m["accuracy"] for m in base]
    previous = cfg.init_from
    step_offset = 0
    for i, stage in enumerate(stages):
        out_dir = root / f"{i + 1}_{stage}"
        done = earlier["stage_metrics"][i] if earlier and i < len(earlier["stage_metrics"]) else None
        if done is not None and finished_metrics(out_dir) is not None:
            logger.info("curriculum stage %d/%d: %s already finished; kept", i + 1, len(stages), stage)
            result["matrix"].append(earlier["matrix"][i])
            result["stage_metrics"].append(done)
            step_offset += done["steps"]
            previous = str(out_dir)
            continue
        # forgetting of every earlier stage, measured during this one (needs the periodic evaluation)
        tracked = stages[:i] if cfg.curriculum.track_forgetting and cfg.eval.every_steps else None
        push = bool(cfg.get("push_to_hub")) and i == len(stages) - 1
        stage_cfg = compose_stage(stage_overrides(user_overrides, stage, out_dir, previous, bool(cfg.resume), tracked,
                                                  push))
        logger.info("curriculum stage %d/%d: %s -> %s", i + 1, len(stages), stage, out_dir)
        metrics = train(stage_cfg, step_offset=step_offset)
        step_offset += metrics["steps"]
        previous = str(out_dir)
        if not main:
            continue
        evals = _evaluate_dir(cfg.model, cfg.paths.cache_dir, str(out_dir / "model"), stage_cfgs[: i + 1],
                              limit, batch, cfg.train.seed)
        row = [m["accuracy"] for m in evals]
        result["matrix"].append(row)
        result["stage_metrics"].append({"stage": stage, "dir": str(out_dir), "reward_mean_first": metrics["reward_mean_first"],
                                        "reward_mean_last": metrics["reward_mean_last"], "steps": metrics["steps"],
                                        "eval": evals})
        write_json(out_dir / "curriculum_eval.json", {"sets": {s: m for s, m in zip(stages, evals)}})
        write_json(root / "curriculum.json", result)  # kept current so a killed run leaves what it measured

    if not main:
        return result
    square = [row + [None] * (len(stages) - len(row)) for row in result["matrix"]]
    result.update(transfer_metrics(result["matrix"]))
    rows = ([("base", result["base"])] if result["base"] else []) + list(zip(stages, square))
    result["table"] = format_table(stages, rows)
    write_json(root / "curriculum.json", result)
    print(result["table"])
    print(f"average accuracy {result['average_accuracy']:.3f}  BWT {_fmt(result['bwt'])}  "
          f"max forgetting {_fmt(result['forgetting_max'])}")
    return result


def _earlier_result(root: Path, stages: list[str]) -> dict | None:
    """curriculum.json of an interrupted run of the same stages, if any."""
    path = root / "curriculum.json"
    if not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    return earlier if earlier.get("stages") == stages else None


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:+.3f}"
