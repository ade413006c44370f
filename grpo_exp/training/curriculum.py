"""Runs stages in sequence (each from the last one's model and EWC state) and measures forgetting:
the accuracy matrix R[trained stage][evaluated stage] (every stage's held-out set after every stage, so the
entry above the diagonal is a stage's accuracy before it trains), average accuracy, backward transfer (BWT,
Lopez-Paz & Ranzato 2017), forgetting (Chaudhry et al. 2018) and each stage's gain on its own held-out
problems, paired over problems (interval and McNemar p) from the per-problem results kept in curriculum.json.

`curriculum.replay=r` mixes r of the earlier stages' training prompts into each later stage (training/replay.py).
`curriculum.mode=adaptive` trains once instead, on every stage's training set with each round's stages drawn by
their pass rates (training/adaptive.py), for the stages' steps summed, and scores every stage after it: one row of
the matrix, comparable with a sequential curriculum's last.

Data-parallel (torchrun): every process trains every stage; rank 0 alone evaluates and writes the
curriculum's files, while the others wait for it at the next stage's first collective."""

from __future__ import annotations

import gc
import json
from pathlib import Path

from grpo_exp.base import cpu, dist, log
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import write_json
from grpo_exp.base.text import markdown_table
from grpo_exp.config.checks import validate
from grpo_exp.core import models
from grpo_exp.evaluation.generate import evaluate
from grpo_exp.evaluation.run import held_out_split
from grpo_exp.evaluation.stats import paired_bits
from grpo_exp.training import branch
from grpo_exp.training.stage import finished_metrics, train

logger = log.get_logger(__name__)

# Overrides that the curriculum sets per stage itself.
_PER_STAGE_KEYS = ("stage", "curriculum", "init_from", "paths.output_dir", "resume", "eval.forgetting_sets",
                   "push_to_hub")


# what makes a stage that stage: an override of these would turn every stage of a curriculum into one
_STAGE_IDENTITY = ("name", "dataset", "path", "hub_id", "hub_config")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def stage_overrides(user_overrides: list[str], stage: str, out_dir: Path, init_from: str | None,
                    resume: bool = False, earlier: list[str] | None = None, push: bool = False,
                    replay: float = 0.0, replay_from: list[str] | None = None) -> list[str]:
    """`earlier`: the stages before this one, whose forgetting it tracks (eval.forgetting_sets). `push`: this
    stage uploads its model/ (push_to_hub: the last stage only, so the hub repo gets the curriculum's result).
    `replay_from`: the earlier stages whose training prompts make up the share `replay` of this one's."""
    names = [o for o in user_overrides if _key(o).startswith("stage.") and _key(o).split(".")[1] in _STAGE_IDENTITY]
    if names:
        raise ConfigError(f"{', '.join(names)}: a curriculum's stages are curriculum.stages, each with its own "
                          f"{', '.join('stage.' + k for k in _STAGE_IDENTITY)}; list the stages there, or train one "
                          f"stage (stage=<name>) without a curriculum")
    # stage.<setting> (sizes, splits) applies to every stage, over each stage's own conf/stage/<name>.yaml
    kept = [o for o in user_overrides if (_key(o).startswith("stage.") or not _key(o).startswith(_PER_STAGE_KEYS))
            and not o.startswith("hydra")]
    extra = [f"stage={stage}", "curriculum=none", f"paths.output_dir={out_dir}", f"resume={str(resume).lower()}",
             f"push_to_hub={str(push).lower()}"]
    if init_from:
        extra.append(f"init_from={init_from}")
    if earlier and init_from:
        extra.append(f"eval.forgetting_sets=[{','.join(earlier)}]")
    if replay > 0 and replay_from:
        extra += [f"curriculum.replay={replay}", f"curriculum.replay_from=[{','.join(replay_from)}]"]
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


def stage_gains(stages: list[str], before_first: list[list[int]] | None, rows: list[list[list[int]]]) -> list[dict]:
    """Each stage's gain on its own held-out problems: after training it (rows[i][i]) against before (the
    previous stage's model, rows[i-1][i]; for the first stage the start model, `before_first`), paired over the
    same problems. Entries are per-problem correctness (0/1) in one fixed order."""
    return [paired_gain(stage, *pair) for i, stage in enumerate(stages)
            if (pair := stage_pair(i, before_first, rows)) is not None]


def stage_pair(i: int, before_first: list[list[int]] | None,
               rows: list[list[list[int]]]) -> tuple[list[int], list[int]] | None:
    """Stage i's (before, after) per-problem results: the model that entered it (the previous stage's, or for the
    first stage the start model, `before_first`), then the one it left; None where either was not scored."""
    before = rows[i - 1][i] if i else (before_first[i] if before_first else None)
    return None if before is None or i >= len(rows) else (before, rows[i][i])


def paired_gain(stage: str, before: list[int], after: list[int]) -> dict:
    """after - before on the same problems (per-problem correctness, 0/1), with its paired interval and McNemar p."""
    pair = paired_bits(before, after)
    return {"stage": stage, "n": pair["n"], "before": pair["before"], "after": pair["after"], "gain": pair["diff"],
            "gain_ci95": [pair["low"], pair["high"]], "mcnemar_p": pair["p"]}


def format_gains(gains: list[dict]) -> str:
    return markdown_table(["stage", "n", "before", "after", "gain [paired 95% CI]", "McNemar p"],
                          [[g["stage"], g["n"], f"{g['before']:.3f}", f"{g['after']:.3f}",
                            f"{g['gain']:+.3f} [{g['gain_ci95'][0]:+.3f}, {g['gain_ci95'][1]:+.3f}]",
                            f"{g['mcnemar_p']:.2g}"] for g in gains])


def format_table(stages: list[str], rows: list[tuple[str, list[float | None]]]) -> str:
    """The accuracy matrix: one row per trained stage (and the base model), one column per evaluated stage."""
    return markdown_table(["after \\ eval", *stages],
                          [[label, *(f"{v:.3f}" if v is not None else "" for v in values)] for label, values in rows])


def _evaluate_dir(model_cfg, cache_dir, model_dir: str | None, stage_cfgs: list, limit: int, batch_size: int,
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
                                    seed=seed, desc=f"eval {stage_cfg.stage.name}")
        results.append((metrics, [int(s["correct"]) for s in samples]))
    del model
    gc.collect()
    return results


def _new_result(cfg, stages: list[str]) -> dict:
    return {"stages": stages, "mode": cfg.curriculum.mode, "ewc_lambda": cfg.ewc["lambda"], "model": cfg.model.name,
            "seed": cfg.train.seed, "eval_limit": cfg.curriculum.eval_limit, "eval_split": cfg.eval.split,
            "eval_batch_size": cfg.curriculum.eval_batch_size, "init_from": cfg.init_from and str(cfg.init_from), "matrix": [], "base": None,
            "stage_metrics": [], "correct": {"base": None, "rows": []}}


def _score_base(cfg, stage_cfgs: list, earlier: dict | None, result: dict) -> None:
    """Row `base`: the starting model on every stage (rank 0), or what an interrupted run of the curriculum kept."""
    if not (cfg.curriculum.eval_base and dist.is_main()):
        return
    if earlier and earlier.get("base") and earlier.get("correct", {}).get("base"):
        result["base"], result["correct"]["base"] = earlier["base"], earlier["correct"]["base"]
        return
    base = _evaluate_dir(cfg.model, cfg.paths.cache_dir, cfg.init_from and str(cfg.init_from), stage_cfgs,
                         cfg.curriculum.eval_limit, cfg.curriculum.eval_batch_size, cfg.train.seed)
    result["base"] = [m["accuracy"] for m, _ in base]
    result["correct"]["base"] = [bits for _, bits in base]


def _warn_short_completions(stage_cfg, earlier: list[str], earlier_cfgs: list) -> None:
    """Replayed prompts are answered within this stage's train.max_completion_length, not their own stage's."""
    length = stage_cfg.train.max_completion_length
    longer = {s: c.train.max_completion_length for s, c in zip(earlier, earlier_cfgs)
              if c.train.max_completion_length > length}
    if longer:
        logger.warning("stage %s replays %s, trained with longer completions (%s) than its own %d tokens: their "
                       "replayed answers are cut at %d", stage_cfg.stage.name, ", ".join(longer),
                       ", ".join(f"{s}: {n}" for s, n in longer.items()), length, length)


def run_curriculum(cfg, user_overrides: list[str]) -> dict:
    """Train every stage of cfg.curriculum.stages in its own subdirectory and write curriculum.json (the adaptive
    curriculum, curriculum.mode=adaptive, is adaptive_run.run_adaptive; apps/train.py picks)."""
    validate(cfg)
    root = Path(cfg.paths.output_dir)
    stages = list(cfg.curriculum.stages)
    limit, batch = cfg.curriculum.eval_limit, cfg.curriculum.eval_batch_size
    stage_cfgs = [compose_stage(stage_overrides(user_overrides, s, branch.stage_dir(root, i, s), None))
                  for i, s in enumerate(stages)]
    for stage_cfg in stage_cfgs:
        validate(stage_cfg)  # every stage's settings are checked before the first one trains
    cpu.apply(cfg.cpu)  # before the base evaluation: oversubscribed threads spin and crawl

    result = _new_result(cfg, stages)
    result["replay"] = cfg.curriculum.replay
    earlier = _earlier_result(root, stages) if cfg.resume else None
    if cfg.curriculum.branch_from and earlier is None:
        earlier = _branch(cfg, user_overrides, root, stages, result)
    if earlier and earlier.get("branched_from"):
        result["branched_from"] = earlier["branched_from"]
    main = dist.is_main()
    _score_base(cfg, stage_cfgs, earlier, result)
    previous = cfg.init_from
    step_offset = 0
    for i, stage in enumerate(stages):
        out_dir = branch.stage_dir(root, i, stage)
        done = earlier["stage_metrics"][i] if earlier and i < len(earlier["stage_metrics"]) else None
        kept_bits = earlier.get("correct", {}).get("rows", []) if earlier else []
        if done is not None and i < len(kept_bits) and finished_metrics(out_dir) is not None:
            logger.info("curriculum stage %d/%d: %s already finished; kept", i + 1, len(stages), stage)
            result["matrix"].append(earlier["matrix"][i])
            result["correct"]["rows"].append(kept_bits[i])
            result["stage_metrics"].append(done)
            step_offset += done["steps"]
            previous = str(out_dir)
            continue
        stage_cfg = _stage_config(cfg, user_overrides, stages, i, root, previous)
        replayed = list(stage_cfg.curriculum.replay_from)  # the earlier stages _stage_config gave it to replay
        pools = {s: c.stage for s, c in zip(stages[:i], stage_cfgs[:i])} if replayed else None
        if replayed:
            _warn_short_completions(stage_cfg, stages[:i], stage_cfgs[:i])
        logger.info("curriculum stage %d/%d: %s -> %s", i + 1, len(stages), stage, out_dir)
        metrics = train(stage_cfg, step_offset=step_offset, pools=pools)
        step_offset += metrics["steps"]
        previous = str(out_dir)
        if not main:
            continue
        # every stage, the later ones too: the next stage's accuracy before it trains is its gain's baseline
        scored = _evaluate_dir(cfg.model, cfg.paths.cache_dir, str(out_dir / "model"), stage_cfgs,
                               limit, batch, cfg.train.seed)
        evals = [m for m, _ in scored]
        result["matrix"].append([m["accuracy"] for m in evals])
        result["correct"]["rows"].append([bits for _, bits in scored])
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
    result["stage_gains"] = stage_gains(stages, result["correct"]["base"], result["correct"]["rows"])
    result["gains_table"] = format_gains(result["stage_gains"])
    write_json(root / "curriculum.json", result)
    print(result["table"])
    print(result["gains_table"])
    print(f"average accuracy {result['average_accuracy']:.3f}  BWT {_fmt(result['bwt'])}  "
          f"max forgetting {_fmt(result['forgetting_max'])}")
    return result


def _stage_config(cfg, user_overrides: list[str], stages: list[str], i: int, root: Path, previous: str | None):
    """Stage i's config as the curriculum trains it, from `previous` (the model it continues)."""
    # forgetting of every earlier stage, measured during this one (needs the periodic evaluation)
    tracked = stages[:i] if cfg.curriculum.track_forgetting and cfg.eval.every_steps else None
    push = bool(cfg.get("push_to_hub")) and i == len(stages) - 1
    replayed = stages[:i] if cfg.curriculum.replay > 0 else None
    return compose_stage(stage_overrides(user_overrides, stages[i], branch.stage_dir(root, i, stages[i]), previous,
                                         bool(cfg.resume), tracked, push, cfg.curriculum.replay, replayed))


def _branch(cfg, user_overrides: list[str], root: Path, stages: list[str], result: dict) -> dict:
    """curriculum.branch_from: the stages this run shares with that run, taken into root (rank 0; the others
    wait), as the curriculum.json a resume continues from."""
    def take() -> None:
        earlier, shared = branch.shared_stages(
            cfg, root, stages, lambda i, previous: _stage_config(cfg, user_overrides, stages, i, root, previous),
            finished_metrics)
        branch.take_stages(earlier, shared, stages, Path(cfg.curriculum.branch_from), root, result)

    dist.on_main(take, share=False)
    return _earlier_result(root, stages)


def _earlier_result(root: Path, stages: list[str]) -> dict | None:
    """curriculum.json of an interrupted run of the same stages, if any."""
    path = root / "curriculum.json"
    if not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    return earlier if earlier.get("stages") == stages else None


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:+.3f}"
