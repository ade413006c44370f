"""Runs stages in sequence (each from the last one's model and EWC state) and measures forgetting:
the accuracy matrix R[trained stage][evaluated stage] (every stage's held-out set after every stage, so the
entry above the diagonal is a stage's accuracy before it trains), average accuracy, backward transfer (BWT,
Lopez-Paz & Ranzato 2017), forgetting (Chaudhry et al. 2018) and each stage's gain on its own held-out
problems, paired over problems (interval and McNemar p) from the per-problem results kept in curriculum.json.

`curriculum.replay=r` mixes r of the earlier stages' training prompts into each later stage (replay.py).
`curriculum.mode=adaptive` trains once instead, on every stage's training set with each round's stages drawn by
their pass rates (adaptive.py, mix.py), for the stages' steps summed, and scores every stage after it: one row of
the matrix, comparable with a sequential curriculum's last.

Data-parallel (torchrun): every process trains every stage; rank 0 alone evaluates and writes the
curriculum's files, while the others wait for it at the next stage's first collective."""

from __future__ import annotations

from pathlib import Path

from grpo_exp.base import cpu, dist, log
from grpo_exp.base.io import write_json
from grpo_exp.base.run_files import CURRICULUM_EVAL_FILE, CURRICULUM_FILE
from grpo_exp.evaluation.continual import format_gains, forward_transfer, stage_gains, transfer_metrics, turnover
from grpo_exp.training.curriculum import branch, match, record
from grpo_exp.training.curriculum.overrides import check_stages, compose_stage, stage_overrides
from grpo_exp.training.curriculum.record import check_eval_sets, earlier_result, fmt, format_table, new_result, score_base
from grpo_exp.training.run_dir import drop_checkpoints, finished_metrics
from grpo_exp.training.stage import train

logger = log.get_logger(__name__)


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
    curriculum, curriculum.mode=adaptive, is adaptive.run_adaptive; the package's run() picks).

    `cfg` was checked by the entrypoint (its init_from too, which the first stage continues with the same ewc and
    peft settings; each later stage continues the stage before it, trained or branched with them). Each stage is
    composed once, as it trains, and checked before the first one trains (check_stages)."""
    root = Path(cfg.paths.output_dir)
    stages = list(cfg.curriculum.stages)
    limit, batch = cfg.curriculum.eval_limit, cfg.curriculum.eval_batch_size
    stage_cfgs = [_stage_config(cfg, user_overrides, stages, i, root) for i in range(len(stages))]
    check_stages(stage_cfgs, root)
    check_eval_sets(cfg, stage_cfgs)
    cpu.apply(cfg.cpu)  # before the base evaluation: oversubscribed threads spin and crawl

    result = new_result(cfg, stages)
    result["replay"] = cfg.curriculum.replay
    if cfg.curriculum.get("match_accuracy_of"):
        result["match_accuracy_of"] = str(cfg.curriculum.match_accuracy_of)
    earlier = earlier_result(root, stages) if cfg.resume else None
    if earlier:
        _check_kept_settings(cfg, earlier, stage_cfgs, root, stages)
    if cfg.curriculum.branch_from and earlier is None:
        earlier = _branch(cfg, stage_cfgs, root, stages, result)
    if earlier and earlier.get("branched_from"):
        result["branched_from"] = earlier["branched_from"]
    main = dist.is_main()
    score_base(cfg, stage_cfgs, earlier, result)
    step_offset = 0
    for i, stage in enumerate(stages):
        out_dir = branch.stage_dir(root, i, stage)
        done = earlier["stage_metrics"][i] if earlier and i < len(earlier["stage_metrics"]) else None
        kept_bits = earlier.get("correct", {}).get("rows", []) if earlier else []
        if done is not None and i < len(kept_bits) and finished_metrics(out_dir) is not None:
            logger.info("curriculum stage %d/%d: %s already finished; kept", i + 1, len(stages), stage)
            if main and not stage_cfgs[i].train.keep_final_checkpoint:  # one finished before they were dropped
                drop_checkpoints(out_dir)
            result["matrix"].append(earlier["matrix"][i])
            result["correct"]["rows"].append(kept_bits[i])
            result["stage_metrics"].append(done)
            step_offset += done["steps"]
            continue
        stage_cfg = stage_cfgs[i]
        replayed = list(stage_cfg.curriculum.replay_from)  # the earlier stages _stage_config gave it to replay
        pools = {s: c.stage for s, c in zip(stages[:i], stage_cfgs[:i])} if replayed else None
        if replayed:
            _warn_short_completions(stage_cfg, stages[:i], stage_cfgs[:i])
        logger.info("curriculum stage %d/%d: %s -> %s", i + 1, len(stages), stage, out_dir)
        metrics = train(stage_cfg, step_offset=step_offset, pools=pools)
        step_offset += metrics["steps"]
        if not main:
            continue
        # every stage, the later ones too: the next stage's accuracy before it trains is its gain's baseline
        scored = record.evaluate_dir(cfg.model, cfg.paths.cache_dir, str(out_dir / "model"), stage_cfgs,
                               limit, batch, cfg.train.seed)
        evals = [m for m, _ in scored]
        result["matrix"].append([m["accuracy"] for m in evals])
        result["correct"]["rows"].append([bits for _, bits in scored])
        result["stage_metrics"].append({"stage": stage, "dir": str(out_dir), "reward_mean_first": metrics["reward_mean_first"],
                                        "reward_mean_last": metrics["reward_mean_last"], "steps": metrics["steps"],
                                        "eval": evals, **({"stop_at_accuracy": metrics["stop_at_accuracy"]}
                                                          if "stop_at_accuracy" in metrics else {})})
        write_json(out_dir / CURRICULUM_EVAL_FILE, {"sets": {s: m for s, m in zip(stages, evals)}})
        write_json(root / CURRICULUM_FILE, result)  # kept current so a killed run leaves what it measured

    if not main:
        return result
    square = [row + [None] * (len(stages) - len(row)) for row in result["matrix"]]
    result.update(transfer_metrics(result["matrix"]))
    result["fwt"] = forward_transfer(result["matrix"], result["base"])
    result["turnover"] = turnover(result["correct"]["rows"])
    rows = ([("base", result["base"])] if result["base"] else []) + list(zip(stages, square))
    result["table"] = format_table(stages, rows)
    result["stage_gains"] = stage_gains(stages, result["correct"]["base"], result["correct"]["rows"])
    result["gains_table"] = format_gains(result["stage_gains"])
    write_json(root / CURRICULUM_FILE, result)
    print(result["table"])
    print(result["gains_table"])
    print(f"average accuracy {result['average_accuracy']:.3f}  BWT {fmt(result['bwt'])}  "
          f"max forgetting {fmt(result['forgetting_max'])}")
    return result


def _check_kept_settings(cfg, earlier: dict, stage_cfgs: list, root: Path, stages: list[str]) -> None:
    """A resumed curriculum keeps its finished stages: each must have trained with the settings this run gives it (as
    a branch compares them), or the later stages would continue a model of other settings. One line naming them."""
    from grpo_exp.base.errors import ConfigError
    from grpo_exp.base.run_files import SETTINGS_FILE

    for i, _ in enumerate(earlier.get("stage_metrics", [])[:len(stages)]):
        out_dir = branch.stage_dir(root, i, stages[i])
        if not (out_dir / SETTINGS_FILE).is_file():
            continue
        changed = branch.changed_settings(cfg, i, out_dir, stage_cfgs[i], root, root)
        if changed:
            raise ConfigError(f"resume: stage {i + 1} ({stages[i]}) in {out_dir} finished with other settings than "
                              f"this run gives it: {'; '.join(changed)}; rerun with the settings the run was started "
                              f"with, or give the run another directory")


def _stage_config(cfg, user_overrides: list[str], stages: list[str], i: int, root: Path):
    """Stage i's config as the curriculum trains it, from the model it continues: init_from for the first stage,
    the stage before it for the others."""
    previous = str(branch.stage_dir(root, i - 1, stages[i - 1])) if i else cfg.init_from and str(cfg.init_from)
    # forgetting of every earlier stage, measured during this one (needs the periodic evaluation)
    tracked = stages[:i] if cfg.curriculum.track_forgetting and cfg.eval.every_steps else None
    push = bool(cfg.get("push_to_hub")) and i == len(stages) - 1
    replayed = stages[:i] if cfg.curriculum.replay > 0 else None
    stage_cfg = compose_stage(stage_overrides(user_overrides, stages[i], branch.stage_dir(root, i, stages[i]),
                                              previous, bool(cfg.resume), tracked, push, cfg.curriculum.replay,
                                              replayed, list(cfg.curriculum.stage_overrides.get(stages[i]) or [])))
    target = match.stage_target(cfg, stages, i, stage_cfg)  # curriculum.match_accuracy_of: that run's accuracy here
    if target is not None:
        stage_cfg.train.stop_at_accuracy = target
    return stage_cfg


def _branch(cfg, stage_cfgs: list, root: Path, stages: list[str], result: dict) -> dict | None:
    """curriculum.branch_from: the stages this run shares with that run, taken into root (rank 0; the others
    wait), as the curriculum.json a resume continues from. None where there is nothing to take and
    curriculum.branch_from_missing=train says to train every stage: the source is this run itself (a sweep's job
    that the others branch from), has not finished a stage yet, or trained its first stage otherwise."""
    source = Path(cfg.curriculum.branch_from)
    train_all = cfg.curriculum.branch_from_missing == "train"
    if train_all and source.resolve() == root.resolve():
        logger.info("curriculum.branch_from is this run's own directory: it trains every stage")
        return None

    def take() -> None:
        try:
            earlier, shared = branch.shared_stages(
                cfg, root, stages, lambda i, previous: stage_cfgs[i], finished_metrics)
        except branch.NothingToShare as err:
            if not train_all:
                raise
            logger.info("%s; curriculum.branch_from_missing=train: this run trains every stage", err)
            return
        branch.take_stages(earlier, shared, stages, source, root, result)

    dist.on_main(take, share=False)
    return earlier_result(root, stages)
