"""What a curriculum records (curriculum.json): the accuracy matrix's rows (every stage's held-out set scored
after every stage, and the starting model's row `base`), with each row's per-problem correctness, so that
gains are paired and an interrupted curriculum resumes with what it measured. The base row is the same for every
job of a sweep that starts from the same model on the same problems (the seeds of a ladder): a job takes it from a
sibling that scored it (base_key: the code, the model, each stage's problems and decoding settings), as greedy
decoding gives one model one answer per problem whatever else the job trains."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from grpo_exp.base import cpu, dist
from grpo_exp.base.commit import AT_START, is_dirty
from grpo_exp.base.run_files import CURRICULUM_FILE
from grpo_exp.base.text import markdown_table
from grpo_exp.core import models
from grpo_exp.evaluation.generate import evaluate
from grpo_exp.evaluation.run import held_out_split

logger = logging.getLogger(__name__)


def format_table(stages: list[str], rows: list[tuple[str, list[float | None]]]) -> str:
    """The accuracy matrix: one row per trained stage (and the base model), one column per evaluated stage."""
    return markdown_table(["after \\ eval", *stages],
                          [[label, *(f"{v:.3f}" if v is not None else "" for v in values)] for label, values in rows])


def evaluate_dir(model_cfg, cache_dir, model_dir: str | None, stage_cfgs: list, limit: int, batch_size: int,
                  seed: int) -> list[tuple[dict, list[int]]]:
    """Accuracy of one model on the held-out split (eval.split) of each given stage, with its per-problem
    correctness (0/1, in the split's fixed order)."""
    model, tokenizer = models.load(model_cfg, cache_dir, seed=seed, init_from=model_dir)
    results = []
    for stage_cfg in stage_cfgs:
        # the problems `python -m grpo_exp.evaluate` scores for this stage with eval.limit=limit
        examples = held_out_split(stage_cfg.stage, stage_cfg.eval.split, limit, stage_cfg.train.seed)[:limit]
        metrics, samples = evaluate(model, tokenizer, examples, system_prompt=stage_cfg.reward.system_prompt,
                                    max_new_tokens=stage_cfg.train.max_completion_length, batch_size=batch_size,
                                    seed=seed, desc=f"eval {stage_cfg.stage.name}",
                                    decode=stage_cfg.eval.get("decode", "auto"),
                                    engine_cache_mb=stage_cfg.eval.get("engine_cache_mb"))
        results.append((metrics, [int(s["correct"]) for s in samples]))
    del model
    cpu.release_freed_memory()  # the model, its decoder copy and its evaluation caches, before the next stage
    return results


def check_eval_sets(cfg, stage_cfgs: list) -> None:
    """Every stage's held-out split holds curriculum.eval_limit problems: a one-line ConfigError naming the stage,
    both numbers and the setting, before any model loads (the matrix scores that many after every stage)."""
    for c in stage_cfgs:
        held_out_split(c.stage, c.eval.split, cfg.curriculum.eval_limit, c.train.seed, key="curriculum.eval_limit")


def new_result(cfg, stages: list[str]) -> dict:
    return {"stages": stages, "mode": cfg.curriculum.mode, "method": cfg.train.get("method", "grpo"),
            "ewc_lambda": cfg.ewc["lambda"], "ewc_fisher": cfg.ewc.get("fisher", "sampled"), "model": cfg.model.name,
            "seed": cfg.train.seed, "eval_limit": cfg.curriculum.eval_limit, "eval_split": cfg.eval.split,
            "eval_batch_size": cfg.curriculum.eval_batch_size, "init_from": cfg.init_from and str(cfg.init_from), "matrix": [], "base": None,
            "stage_metrics": [], "correct": {"base": None, "rows": []}}


def score_base(cfg, stage_cfgs: list, earlier: dict | None, result: dict) -> None:
    """Row `base`: the starting model on every stage (rank 0), or what an interrupted run of the curriculum kept."""
    if not (cfg.curriculum.eval_base and dist.is_main()):
        return
    if earlier and earlier.get("base") and earlier.get("correct", {}).get("base"):
        result["base"], result["correct"]["base"] = earlier["base"], earlier["correct"]["base"]
        result["base_key"] = earlier.get("base_key")
        return
    key = base_key(cfg, stage_cfgs)
    result["base_key"] = key
    root = Path(cfg.paths.output_dir)
    sibling = sibling_base(root, key)
    if sibling is not None:
        logger.info("curriculum: base row taken from the sweep's job %s (the same model, problems, settings and code)",
                    sibling[0].name)
        result["base"], result["correct"]["base"] = sibling[1]["base"], sibling[1]["correct"]["base"]
        result["base_from"] = sibling[0].name
        return
    base = evaluate_dir(cfg.model, cfg.paths.cache_dir, cfg.init_from and str(cfg.init_from), stage_cfgs,
                         cfg.curriculum.eval_limit, cfg.curriculum.eval_batch_size, cfg.train.seed)
    result["base"] = [m["accuracy"] for m, _ in base]
    result["correct"]["base"] = [bits for _, bits in base]


def base_key(cfg, stage_cfgs: list) -> str | None:
    """A hash of what the base row depends on: the code (its commit, None outside a checkout or with uncommitted
    changes: no reuse), the start model (its option, or the directory it is loaded from with its files' sizes and
    times; the seed only for a randomly initialised one), the packages' versions, and each stage's scored problems
    and decoding settings."""
    if AT_START is None or is_dirty(AT_START):
        return None
    import torch
    import transformers
    from omegaconf import OmegaConf

    limit = cfg.curriculum.eval_limit
    if cfg.init_from:
        start = Path(cfg.init_from).resolve()
        model = {"dir": str(start), "files": sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns]
                                                    for p in start.iterdir() if p.is_file())}
    else:
        model = OmegaConf.to_container(cfg.model, resolve=True)
        if cfg.model.source == "tiny_random":
            model["seed"] = cfg.train.seed
    sets = [{"problems": held_out_split(c.stage, c.eval.split, limit, c.train.seed)[:limit],
             "tokens": c.train.max_completion_length, "system_prompt": c.reward.system_prompt,
             "decode": c.eval.get("decode", "auto")} for c in stage_cfgs]
    record = {"code": AT_START, "torch": torch.__version__, "transformers": transformers.__version__,
              "model": model, "sets": sets, "batch_size": cfg.curriculum.eval_batch_size}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sibling_base(root: Path, key: str | None) -> tuple[Path, dict] | None:
    """(job directory, curriculum.json) of another job of the sweep whose base row has `key`, if any."""
    if key is None:
        return None
    for path in sorted(root.parent.glob(f"*/{CURRICULUM_FILE}")):
        if path.parent.resolve() == root.resolve():
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # another job writing it: scored here instead
            continue
        if record.get("base_key") == key and record.get("base") and (record.get("correct") or {}).get("base"):
            return path.parent, record
    return None


def earlier_result(root: Path, stages: list[str]) -> dict | None:
    """curriculum.json of an interrupted run of the same stages, if any."""
    path = root / CURRICULUM_FILE
    if not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    return earlier if earlier.get("stages") == stages else None


def fmt(value) -> str:
    return "n/a" if value is None else f"{value:+.3f}"
