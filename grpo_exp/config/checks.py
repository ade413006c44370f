"""`validate(cfg)`: every group's own checks (beside its fields in schema.py) and the rules that span
groups, run once at each entry before any model loads. Each failure is a one-line ConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from grpo_exp.base.errors import ConfigError
from grpo_exp.config.recorded import run_config, split_seed
from grpo_exp.config.schema import GROUPS, CurriculumConfig, RunConfig
from grpo_exp.config.speed import check_generation, check_vllm_head
from grpo_exp.core.data import LEVELS


def validate(cfg: Any) -> None:
    """Raise ConfigError with a one-line message on the first problem; needs no model."""
    for group, schema in GROUPS.items():
        schema.check(cfg[group])
    RunConfig.check(cfg)
    _check_speed(cfg)
    stage, ev = cfg.stage, cfg.eval
    if ev.forgetting_sets and not cfg.get("init_from"):
        raise ConfigError(f"eval.forgetting_sets={list(ev.forgetting_sets)} measures forgetting of a previous stage, "
                          f"but there is none: set init_from=<run dir of that stage> or run a curriculum")
    _check_init_split(cfg)
    _check_adaptive(cfg)
    _check_sft(cfg)
    if cfg.train.get("stop_at_accuracy") is not None and not ev.every_steps:
        raise ConfigError(f"train.stop_at_accuracy={cfg.train.stop_at_accuracy} stops at a periodic validation "
                          f"evaluation, every eval.every_steps, which is off (null); set eval.every_steps=<N>")
    if ev.forgetting_sets and not ev.every_steps:
        raise ConfigError(f"eval.forgetting_sets={list(ev.forgetting_sets)} is measured every eval.every_steps, "
                          f"which is off (null); set eval.every_steps=<N>")
    size = stage[f"num_{ev.split}"]
    # a generated level's held-out set is num_<split> problems; a file's (GSM8K, prompts) is its whole split, sized
    # when the pre-check reads it
    if stage.dataset in LEVELS and ev.after_train and ev.limit > size:
        raise ConfigError(f"eval set '{stage.name}' holds {size} {ev.split} problems (stage.num_{ev.split}) "
                          f"but {ev.limit} were asked for (eval.limit={ev.limit}); lower the limit or raise "
                          f"stage.num_{ev.split}")


def _check_speed(cfg: Any) -> None:
    """The speed rules that read the recipe (train.*) or the machine."""
    train, speed = cfg.train, cfg.speed
    check_generation(speed.generation)  # vllm needs CUDA and the vllm package on this machine
    if speed.generation == "vllm":
        check_vllm_head(head_width(cfg.model), cfg.model.name)
    # TRL's own rule for importance-corrected rollouts, which it checks only when use_vllm is set
    if (speed.generation in ("engine", "vllm", "auto") and speed.is_correction and train.loss_type == "vespo"
            and not speed.is_mode.startswith("token")):
        raise ConfigError(f"train.loss_type=vespo needs a token-level speed.is_mode (token_truncate or token_mask), "
                          f"not {speed.is_mode}")


def head_width(model: Any) -> int | None:
    """The attention head width of a model, read without loading it: the tiny model's sizes, or a local model
    directory's config.json; None where it cannot be known yet (a hub id, a packaged GGUF)."""
    import json

    if model.source == "tiny_random":
        return model.tiny_hidden // model.tiny_heads
    config = Path(str(model.get("id") or "")).expanduser() / "config.json"
    if model.source != "pretrained" or not config.is_file():
        return None
    try:
        values = json.loads(config.read_text())
        return values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        return None


def _check_sft(cfg: Any) -> None:
    """train.method=sft learns worked solutions (core/data/solutions.py): a generated level's or GSM8K's, on the
    stage's own problems."""
    if cfg.train.get("method", "grpo") != "sft":
        return
    if cfg.stage.dataset not in (*LEVELS, "gsm8k"):
        raise ConfigError(f"train.method=sft trains on worked solutions, which stage.dataset={cfg.stage.dataset} "
                          f"does not have; use a generated level ({', '.join(LEVELS)}) or gsm8k, or train.method=grpo")
    if cfg.curriculum.mode == "adaptive" or cfg.curriculum.replay > 0:
        what = "curriculum.mode=adaptive" if cfg.curriculum.mode == "adaptive" else f"curriculum.replay={cfg.curriculum.replay}"
        raise ConfigError(f"train.method=sft trains on one stage's problems; {what} mixes stages, which only "
                          f"train.method=grpo does")


def _check_adaptive(cfg: Any) -> None:
    """curriculum.mode=adaptive weighs each stage by its pass rate, read from a 0/1 correctness reward."""
    if cfg.curriculum.mode == "adaptive":
        funcs = list(cfg.reward.funcs)
        rewards = CurriculumConfig.PASS_REWARDS
        if not set(rewards) & set(funcs):
            raise ConfigError(f"curriculum.mode=adaptive reads each stage's pass rate from a correctness reward "
                              f"({' or '.join(rewards)}), which reward.funcs={funcs} lacks; choose reward=math, "
                              f"correctness, shaped or strict")
        if not cfg.curriculum.stages:
            raise ConfigError("curriculum.mode=adaptive needs the stages to mix: set curriculum.stages=[...] "
                              "(curriculum=adaptive lists basic, intermediate and advanced)")


def init_chain(init_from: str | None):
    """(init_from as recorded, its run's config) for each run the model descends from: init_from, the run its
    recorded config continued from, and so on (a run that is not a recorded run ends the chain)."""
    seen: set[Path] = set()
    while init_from:
        found = run_config(init_from)
        if found is None or found[1].resolve() in seen:  # a bare model directory, or a loop of copied configs
            return
        seen.add(found[1].resolve())
        yield str(init_from), found[0]
        init_from = OmegaConf.select(found[0], "init_from", throw_on_resolution_failure=False)


def _check_init_split(cfg: Any) -> None:
    """An earlier stage scored here must be scored on the split its own run held out: the split is drawn
    with the split seed (stage.split_seed; train.seed for runs recorded before it), so under another its
    'held-out' problems include ones that run trained on. Every run up the init_from chain trained a stage,
    so each is checked, not only the last."""
    scored = set(cfg.eval.sets) | set(cfg.eval.forgetting_sets)
    mine = split_seed(cfg.stage, cfg.train.seed)
    for run, recorded in init_chain(cfg.get("init_from")):
        seed, stage = OmegaConf.select(recorded, "train.seed"), OmegaConf.select(recorded, "stage.name")
        if seed is None or stage not in scored:
            continue
        theirs = split_seed(OmegaConf.select(recorded, "stage") or {}, int(seed))
        if theirs == mine:
            continue
        which = "" if run == str(cfg.init_from) else f" continues {run}, which"
        raise ConfigError(f"init_from={cfg.init_from}{which} trained {stage} on the split of split seed {theirs}, but "
                          f"this run scores {stage} on split seed {mine} (stage.split_seed), whose held-out problems "
                          f"include ones that run trained on; set stage.split_seed={theirs} or drop {stage} from "
                          f"eval.sets/eval.forgetting_sets")
