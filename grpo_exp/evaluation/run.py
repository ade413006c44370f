"""Evaluation of one model on held-out problems, the library behind `python -m grpo_exp.evaluate`.

Ground-truth accuracy (with a Wilson 95% interval), format compliance, completion length, speed
and memory of one model on the held-out split of each set, fp32 or `quantization=dynamic_int8`.
Writes eval.json and eval_samples.jsonl into the run directory and prints a table.

The functions here are the one code path for evaluation: this entrypoint, training runs with
`eval.after_train=true` (`evaluate_after_train`) and `grpo-compare` all call them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from grpo_exp.base import log
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.run_files import BEFORE_AFTER_FILE, BEFORE_AFTER_TABLE_FILE, EVAL_FILE, EVAL_SAMPLES_FILE
from grpo_exp.base.text import markdown_table
from grpo_exp.config.recorded import run_config
from grpo_exp.core.data.splits import split_seed, stage_split
from grpo_exp.evaluation import start_cache
from grpo_exp.evaluation.judge import for_stage

logger = log.get_logger(__name__)


@dataclass
class EvalSet:
    """One problem set: the stage option it comes from, its settings and its problems."""

    name: str
    dataset: str
    max_new_tokens: int
    source: str  # "generated", a JSONL path, or a hub id
    examples: list[dict] = field(default_factory=list)
    held_out: int = 0  # size of the held-out split the problems were taken from
    judge: Any = None  # a prompts stage's eval reward (evaluation/judge.py); None: the correctness reward


# --- checks that need no model ---------------------------------------------------------------

def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def resolve_checkpoint(checkpoint: str | None) -> Path | None:
    """The model directory of `checkpoint` (a run directory holding model/, or a model directory)."""
    if not checkpoint:
        return None
    path = Path(str(checkpoint)).expanduser()
    if not path.exists():
        raise ConfigError(f"checkpoint={checkpoint} does not exist; give a run directory (holding model/) "
                          f"or a model directory, or leave it null for the base model")
    for candidate in (path / "model", path):
        if (candidate / "config.json").is_file() and _has_weights(candidate):
            return candidate
    raise ConfigError(f"checkpoint={checkpoint} holds no model (expected {path}/model/ or {path}/ with config.json "
                      f"and *.safetensors weights); give the run directory of a finished training run")


def run_model_name(path: str | Path | None) -> str | None:
    """The model option a training run started from, for a run dir or its model/."""
    found = run_config(path)
    name = OmegaConf.select(found[0], "model.name") if found else None
    return str(name) if name else None


def set_names(cfg) -> list[str]:
    """eval.sets without repeats, or the current stage when it is empty."""
    names = list(cfg.eval.sets) or [cfg.stage.name]
    return list(dict.fromkeys(names))


def set_settings(cfg, name: str) -> tuple[DictConfig, int]:
    """(stage node, max_new_tokens) of an eval set.

    The current stage keeps its command-line overrides; any other set is conf/stage/<name>.yaml as
    `python -m grpo_exp.train stage=<name>` would compose it. A GSM8K set with no path of its own
    reads `stage.path` from the command line when one is given, else the hub.
    """
    if name == cfg.stage.name:
        stage, length = cfg.stage, cfg.train.max_completion_length
    else:
        composed = _compose([f"stage={name}"])
        stage, length = composed.stage, composed.train.max_completion_length
        if stage.dataset == "gsm8k" and not stage.path and cfg.stage.path:
            stage = OmegaConf.merge(stage, {"path": cfg.stage.path})
        # one partition for every level: a computation held out at one level is trained on at none
        stage = OmegaConf.merge(stage, {"split_seed": split_seed(cfg.stage, cfg.train.seed)})
    return stage, int(cfg.eval.max_new_tokens or length)


def _compose(overrides: list[str]) -> DictConfig:
    """conf/evaluate.yaml with `overrides`, inside or outside a running Hydra app."""
    from grpo_exp.config.compose import compose

    return compose("evaluate", overrides)


def check(cfg) -> Path | None:
    """Everything evaluate can check before loading data or a model; returns the checkpoint's model dir."""
    from grpo_exp.config.checks import validate
    from grpo_exp.core.models import check_available

    validate(cfg)  # includes eval.* (known set names, sizes)
    model_dir = resolve_checkpoint(cfg.get("checkpoint"))
    with open_dict(cfg):
        cfg.data_seed_from = use_recorded_split(cfg, model_dir)
    if model_dir is None:
        check_available(cfg.model, cfg.paths.cache_dir)
    for name in set_names(cfg):
        stage, _ = set_settings(cfg, name)
        if stage.dataset == "gsm8k" and stage.path:
            if not Path(stage.path).exists():
                raise ConfigError(f"stage.path={stage.path} (GSM8K set '{name}') does not exist; give a GSM8K JSONL "
                                  f"file or a directory holding test.jsonl, or leave it empty for the hub")
            held_out_split(stage, cfg.eval.split, cfg.eval.limit, cfg.train.seed, name)  # a bad line or a short split fails here
        elif stage.dataset == "prompts":  # its rows (a missing prompt column, a short split) and its eval reward
            if name != cfg.stage.name:
                from grpo_exp.config.schema import StageConfig

                StageConfig.check(stage)
            held_out_split(stage, cfg.eval.split, cfg.eval.limit, cfg.train.seed, name)
            check_prompt_columns(stage, cfg, train=False)
        elif stage.dataset != "gsm8k" and cfg.eval.limit > stage[f"num_{cfg.eval.split}"]:
            held_out_split(stage, cfg.eval.split, cfg.eval.limit, cfg.train.seed, name)  # raises: the split is too small
    return model_dir


def check_held_out(cfg) -> None:
    """A training run's held-out sets, read before any model loads: validation for the periodic evaluation
    (eval.every_limit problems) and eval.split after training (eval.limit), so a GSM8K file too small for
    either, or with a bad line, fails in one line rather than after training. The hub is left for the run, except a
    prompts stage's dataset: read here wherever it is, so that a missing `prompt` column, a short split or a column a
    reward needs is one line before any model loads."""
    stage = cfg.stage
    if stage.dataset == "prompts":  # its file (or hub dataset) is read here: a missing prompt column, a short split
        for split in ("train", "validation", "test"):  # an empty train split, a held-out one under stage.num_<split>
            stage_split(stage, split, cfg.train.seed)
        check_prompt_columns(stage, cfg, train=True)
    elif stage.dataset != "gsm8k" or not stage.path:
        return  # generated levels are sized by the config's own checks
    needed = []  # (split, problems, the key that asks for them)
    if cfg.eval.every_steps:
        needed.append(("validation", cfg.eval.every_limit, "eval.every_limit"))
    if cfg.eval.after_train:
        needed.append((cfg.eval.split, cfg.eval.limit, "eval.limit"))
    for split, limit, key in sorted(needed, key=lambda need: -need[1]):  # the larger ask of a split first
        held_out_split(stage, split, limit, cfg.train.seed, key=key)


def check_prompt_columns(stage, cfg, train: bool) -> None:
    """A prompts stage's columns against what its rewards need (its eval reward; with `train`, every reward.funcs
    entry too): one line where a reward needs a column the dataset lacks, before any model loads."""
    from grpo_exp.core import rewards
    from grpo_exp.core.data import prompt_table
    from grpo_exp.evaluation.judge import eval_reward_name

    table = prompt_table.load(stage.path, stage.hub_id, stage.hub_config)
    funcs = [str(f) for f in cfg.reward.funcs] if train else []
    if funcs:
        prompt_table.check_columns(table, list(zip(funcs, rewards.build(funcs, None)[0])))
    name = eval_reward_name(stage, list(cfg.reward.funcs))
    if name is not None and name not in funcs:
        key = "stage.eval_reward" if stage.get("eval_reward") else "reward.funcs"
        prompt_table.check_columns(table, [(name, rewards.resolve(name, key=key))], key=key)


# --- data, model, evaluation -----------------------------------------------------------------

def load_sets(cfg) -> list[EvalSet]:
    """The problems of every eval set: the first eval.limit of its held-out split (eval.split).

    The held-out splits are the ones training leaves out (drawn with the data seed, train.seed or the
    seed recorded by the checkpoint's run; GSM8K: its test file, shuffled with that seed), so the
    same config always gives the same problems, smaller limits give a prefix of larger ones, and
    curriculum runs score the same problems.
    """
    from grpo_exp.core import data

    sets = []
    for name in set_names(cfg):
        stage, max_new_tokens = set_settings(cfg, name)
        split = held_out_split(stage, cfg.eval.split, cfg.eval.limit, cfg.train.seed, name)
        source = "generated" if stage.dataset in data.LEVELS else str(stage.path or stage.hub_id)
        sets.append(EvalSet(name, stage.dataset, max_new_tokens, source, split[:cfg.eval.limit], len(split),
                            judge=for_stage(stage, list(cfg.reward.funcs))))
    return sets


def held_out_split(stage, split: str, limit: int, seed: int, name: str | None = None,
                   key: str = "eval.limit") -> list[dict]:
    """The held-out split (validation or test) of a stage that evaluations draw their first `limit`
    problems from; a split smaller than `limit` is a one-line ConfigError naming both numbers and `key`, the
    setting that asked for them."""
    from grpo_exp.core import data

    name = name or stage.name
    size = stage[f"num_{split}"]
    if stage.dataset in data.LEVELS and limit > size:
        raise ConfigError(f"eval set '{name}' holds {size} {split} problems (stage.num_{split}) but "
                          f"{limit} were asked for ({key}={limit}); lower the limit or raise stage.num_{split}")
    # GSM8K's and a prompts stage's held-out sets are whole splits of their files, of which the first `limit` are
    # scored (stage.num_<split>: the least the split must hold, checked first)
    if stage.dataset == "prompts":
        stage_split(stage, split, seed)  # raises where the split holds fewer than stage.num_<split>
    problems = stage_split(stage, split, seed, size=None if stage.dataset in data.LEVELS else 0)
    if len(problems) < limit:
        raise ConfigError(f"eval set '{name}' holds {len(problems)} {split} problems but {limit} were asked for "
                          f"({key}={limit}); lower the limit or use a larger {split} split")
    return problems


def recorded_data_settings(model_dir: Path | None) -> dict | None:
    """The data seed and stage of the training run a checkpoint came from, so the checkpoint is scored
    on the split that run held out; None for a base model or a bare model directory."""
    found = run_config(model_dir)
    seed = OmegaConf.select(found[0], "train.seed") if found else None
    if seed is None:
        return None
    return {"seed": int(seed), "stage": OmegaConf.select(found[0], "stage"), "source": str(found[1]),
            "max_completion_length": OmegaConf.select(found[0], "train.max_completion_length"),
            "reward_funcs": OmegaConf.select(found[0], "reward.funcs")}


def use_recorded_split(cfg, model_dir: Path | None) -> str:
    """Point cfg's data seed (and, for the run's own stage, its split settings) at what the
    checkpoint's run used; returns where the data seed came from, for eval.json."""
    recorded = recorded_data_settings(model_dir)
    if recorded is None:
        return "train.seed"
    cfg.train.seed = recorded["seed"]
    stage = recorded["stage"]
    # the run's partition: its stage.split_seed, or (recorded before that key) its training seed
    cfg.stage.split_seed = split_seed(stage if stage is not None else {}, recorded["seed"])
    if stage is not None and stage.get("name") == cfg.stage.name:
        for key in ("num_validation", "num_test", "test_fraction", "validation_fraction", "path", "eval_threshold"):
            if key in stage and not (key == "path" and cfg.stage.get("path")):
                cfg.stage[key] = stage[key]
        if stage.get("dataset") == "prompts" and not cfg.stage.get("eval_reward"):
            # the reward that decided the run's accuracy (its stage.eval_reward, else the first of its reward.funcs),
            # not the first of this command's reward.funcs
            funcs = recorded["reward_funcs"] or []
            named = stage.get("eval_reward") or (funcs[0] if funcs else None)
            if named:
                cfg.stage.eval_reward = str(named)
        # the run's own stage is scored at the length its run scored it (eval.max_new_tokens overrides both)
        if recorded["max_completion_length"] is not None:
            cfg.train.max_completion_length = int(recorded["max_completion_length"])
    return recorded["source"]


def load_model(cfg, model_dir: Path | None = None):
    """(model, tokenizer) in fp32: the checkpoint's model, or the base model of the `model` option."""
    from grpo_exp.core import models

    return models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed, init_from=model_dir)


def evaluate_sets(model, tokenizer, sets: list[EvalSet], cfg, label: str = "") -> tuple[dict, list[dict]]:
    """Per-set metrics and per-problem samples of `model` (already quantized if it should be)."""
    from grpo_exp.config.schema import pass_k_samples
    from grpo_exp.evaluation.generate import evaluate

    ev = cfg.eval
    results, samples = {}, []
    for s in sets:
        metrics, rows = evaluate(model, tokenizer, s.examples, system_prompt=cfg.reward.system_prompt,
                                 max_new_tokens=s.max_new_tokens, batch_size=ev.batch_size, do_sample=ev.do_sample,
                                 temperature=ev.temperature, top_k=ev.top_k, top_p=ev.top_p, seed=ev.seed,
                                 desc=" ".join(filter(None, ("eval", label, s.name))),
                                 pass_k=list(ev.pass_k), maj_k=list(ev.maj_k), num_samples=pass_k_samples(ev),
                                 judge=s.judge, decode=ev.decode, engine_cache_mb=ev.engine_cache_mb)
        metrics.update({"dataset": s.dataset, "source": s.source, "held_out": s.held_out,
                        "max_new_tokens": s.max_new_tokens})
        results[s.name] = metrics
        samples.extend({"set": s.name, **({"variant": label} if label else {}), **row} for row in rows)
    return results, samples


def model_info(model, model_dir: Path | None, method: str) -> dict:
    """What was evaluated: where the weights came from, quantization and size in memory."""
    from grpo_exp.evaluation.generate import model_size_mb
    from grpo_exp.core.quantization import quantized_linear_count

    return {
        "checkpoint": str(model_dir) if model_dir is not None else None,
        "checkpoint_model": run_model_name(model_dir),  # the model option that run trained
        "quantization": method,
        "quantized_linear_layers": quantized_linear_count(model),
        "model_size_mb": round(model_size_mb(model), 1),
    }


def settings_summary(cfg, sets: list[EvalSet]) -> dict:
    """The evaluation settings eval.json records beside the figures."""
    import torch

    from grpo_exp.config.schema import pass_k_samples
    from grpo_exp.evaluation.generate import EVAL_PRECISION

    sampled = start_cache.draws_samples(cfg.eval)
    return {
        "model": cfg.model.name,
        "sets": [s.name for s in sets],
        "limit": cfg.eval.limit,
        "batch_size": cfg.eval.batch_size,
        "max_new_tokens": {s.name: s.max_new_tokens for s in sets},
        "decoding": "sampled" if cfg.eval.do_sample else "greedy",
        "decode": cfg.eval.decode,  # eval.decode; each set's figures say which path decoded them (decoded_by)
        "temperature": cfg.eval.temperature if sampled else None,
        "top_k": cfg.eval.top_k if sampled else None,
        "top_p": cfg.eval.top_p if sampled else None,
        "pass_k": list(cfg.eval.pass_k),
        "maj_k": list(cfg.eval.maj_k),
        "num_samples": pass_k_samples(cfg.eval),
        "seed": cfg.eval.seed,
        "data_seed": cfg.train.seed,
        "split_seed": split_seed(cfg.stage, cfg.train.seed),
        "data_seed_from": cfg.get("data_seed_from") or "train.seed",
        # held-out: no computation (GSM8K: question) shared with training or with the other held-out split
        "split": cfg.eval.split,
        "precision": EVAL_PRECISION,  # every command decodes in it (generate.fp32_decoding)
        "reward": cfg.reward.name,
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }


def format_table(results: dict[str, dict], label_key: str = "set") -> str:
    """A markdown table of per-set (or per-variant) metrics; where completions were sampled, pass@1 estimated
    from them, pass@k and maj@k columns, each with its bootstrap 95% interval."""
    sampled = any("sampled_pass_at_1" in m for m in results.values())
    figures = [(key, k) for key in ("pass_at_k", "maj_at_k")
               for k in sorted({k for m in results.values() for k in m.get(key, {})}, key=int)]
    header = [label_key, "n", "accuracy", "95% CI", *(["pass@1 (sampled) [95% CI]"] if sampled else []),
              *(f"{key.split('_')[0]}@{k} [95% CI]" for key, k in figures), "format", "mean tokens",
              "tokens/s", "decode tokens/s", "size MB"]
    rows = []
    for name, m in results.items():
        rate = [f"{m[k]:.1f}" if m.get(k) else "n/a" for k in ("tokens_per_s", "decode_tokens_per_s")]
        extra = [_with_interval(m.get("sampled_pass_at_1"), m.get("sampled_pass_at_1_ci95"))] if sampled else []
        extra += [_with_interval(m.get(key, {}).get(k), m.get(f"{key}_ci95", {}).get(k)) for key, k in figures]
        rows.append([name, m["n"], f"{m['accuracy']:.3f}", f"[{m['accuracy_ci95_low']:.3f}, {m['accuracy_ci95_high']:.3f}]",
                     *extra, f"{m['format_compliance']:.3f}", f"{m['mean_completion_tokens']:.1f}", *rate,
                     f"{m['model_size_mb']:.1f}"])
    return markdown_table(header, rows, align="lrrl" + "r" * (len(header) - 4))


def _with_interval(value: float | None, interval: list[float] | None) -> str:
    """"0.500 [0.300, 0.700]" (the interval where known); "" where the figure was not measured."""
    if value is None:
        return ""
    return f"{value:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def write_outputs(run_dir: str | Path, summary: dict, results: dict, samples: list[dict]) -> dict:
    """eval.json (settings, per-set metrics, table) and eval_samples.jsonl in `run_dir`."""
    from grpo_exp.base.io import write_json

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    report = {"config": summary, "sets": results, "table": format_table(results)}
    write_json(run_dir / EVAL_FILE, report)
    with (run_dir / EVAL_SAMPLES_FILE).open("w") as fh:
        for row in samples:
            fh.write(json.dumps(row, default=str) + "\n")
    return report


def evaluate_model(cfg, model, tokenizer, sets: list[EvalSet], model_dir: Path | None, run_dir) -> dict:
    """Quantize (a copy) as configured, evaluate every set, write the outputs; returns eval.json's content."""
    from grpo_exp.core.quantization import quantize_for_eval

    started = time.time()
    eval_model = quantize_for_eval(model, cfg.quantization.method)
    results, samples = evaluate_sets(eval_model, tokenizer, sets, cfg)
    summary = {**settings_summary(cfg, sets), **model_info(eval_model, model_dir, cfg.quantization.method),
               "eval_time_s": round(time.time() - started, 1)}
    del eval_model
    return write_outputs(run_dir, summary, results, samples)


def run(cfg) -> dict:
    """Check, load the problems, then the model; evaluate and write eval.json."""
    from grpo_exp.base import cpu

    model_dir = check(cfg)
    sets = load_sets(cfg)  # data errors (bad JSONL line, hub offline) surface before the model loads
    cpu.apply(cfg.cpu)
    model, tokenizer = load_model(cfg, model_dir)
    report = evaluate_model(cfg, model, tokenizer, sets, model_dir, cfg.paths.output_dir)
    print(report["table"])
    logger.info("eval.json and eval_samples.jsonl in %s", cfg.paths.output_dir)
    return report


def evaluate_after_train(cfg, model, tokenizer, run_dir, start_model_dir: Path | None = None) -> dict:
    """`eval.after_train=true`: evaluate the just-trained policy (a quantized copy if configured) and
    the model it started from on the same held-out problems, and compare them pairwise.

    Writes eval.json and eval_samples.jsonl (the trained model) and before_after.json/.md (both
    models, with McNemar's exact test) to `run_dir`, prints the table and returns eval.json's
    per-set metrics plus a "before_after" entry. The starting model's figures are cached per model,
    problems and settings (the base model only), so repeated runs evaluate it once. A data error
    (e.g. GSM8K unreachable) is reported on one line and returned as {"error": ...}, so the training
    run still records its metrics.
    """
    try:
        sets = load_sets(cfg)
    except ConfigError as err:
        logger.warning("evaluation skipped: %s", err)
        return {"error": str(err)}
    saved = Path(run_dir) / "model"
    if saved.is_dir():
        # what model/ holds, loaded as `python -m grpo_exp.evaluate` loads it (not the policy in memory, whose
        # forward carries training's kernels), so both commands give this model one number
        del model
        model, tokenizer = load_model(cfg, saved)
    report = evaluate_model(cfg, model, tokenizer, sets, saved if saved.is_dir() else None, run_dir)
    from grpo_exp.base.io import read_jsonl

    trained_samples = read_jsonl(Path(run_dir) / EVAL_SAMPLES_FILE)
    before = starting_model_results(cfg, sets, start_model_dir)
    comparison = before_after(sets, before, {"sets": report["sets"], "samples": trained_samples},
                              "start" if start_model_dir else "base", cfg.eval.split)
    comparison["before_source"] = before.get("source")
    if cfg.eval.every_steps:
        comparison["validation_before"] = validation_before(cfg, start_model_dir)
    from grpo_exp.base.io import write_json

    write_json(Path(run_dir) / BEFORE_AFTER_FILE, comparison)
    (Path(run_dir) / BEFORE_AFTER_TABLE_FILE).write_text(comparison["table"] + "\n")
    print(comparison["table"])
    return {**report["sets"], "before_after": {name: c for name, c in comparison["sets"].items()}}


def validation_limit(cfg, stage) -> int:
    """How many validation problems a periodic evaluation scores: eval.every_limit, at most a generated split."""
    from grpo_exp.core import data

    limit = cfg.eval.every_limit
    return min(limit, stage.num_validation) if stage.dataset in data.LEVELS else limit


def validation_subset(cfg, stage, name: str | None = None) -> list[dict]:
    """The first eval.every_limit problems of a stage's validation split: what is scored during training."""
    limit = validation_limit(cfg, stage)
    return held_out_split(stage, "validation", limit, cfg.train.seed, name)[:limit]


def write_validation_start(cfg, run_dir, start_model_dir: Path | None) -> dict:
    """validation_start.json: `validation_before` for a run whose periodic evaluation has no before/after to sit in
    (eval.after_train=false), so its learning curve (and a compute curve's fit) has the level it starts from."""
    from grpo_exp.base.io import write_json
    from grpo_exp.base.run_files import VALIDATION_START_FILE

    start = {**validation_before(cfg, start_model_dir), "model": "start" if start_model_dir else "base"}
    write_json(Path(run_dir) / VALIDATION_START_FILE, start)
    return start


def validation_before(cfg, start_model_dir: Path | None) -> dict:
    """The starting model's greedy accuracy on the validation problems the periodic evaluation scores (the
    first eval.every_limit): the level a run's learning curve starts from (cached as the base figures are)."""
    stage, max_new_tokens = cfg.stage, int(cfg.train.max_completion_length)  # as the periodic evaluation
    examples = validation_subset(cfg, stage)
    source = "generated" if stage.dataset not in ("gsm8k", "prompts") else str(stage.path or stage.hub_id)
    sets = [EvalSet(stage.name, stage.dataset, max_new_tokens, source, examples, len(examples),
                    judge=for_stage(stage, list(cfg.reward.funcs)))]
    result = starting_model_results(cfg, sets, start_model_dir)["sets"][stage.name]
    return {"set": stage.name, "n": result["n"], "accuracy": result["accuracy"]}


def starting_model_results(cfg, sets: list[EvalSet], start_model_dir: Path | None) -> dict:
    """{"sets", "samples"} of the model training started from: the base model or init_from's (cached)."""
    from grpo_exp.core.quantization import quantize_for_eval
    from grpo_exp.base.io import write_json

    cache, key = start_cache.cache_path(cfg, sets, start_model_dir)
    settings = {k: key[k] for k in start_cache.evaluation_machine(cfg)}
    if cache.is_file():
        logger.info("starting model's figures from the cache: %s", cache)
        before = json.loads(cache.read_text())
        before["source"] = {"from": "cache", "path": str(cache), "settings": before.get("settings", settings)}
        return before
    model, tokenizer = load_model(cfg, start_model_dir)
    eval_model = quantize_for_eval(model, cfg.quantization.method)
    results, samples = evaluate_sets(eval_model, tokenizer, sets, cfg, label="before")
    del model, eval_model
    before = {"sets": results, "samples": samples, "settings": settings}
    write_json(cache, before)
    return {**before, "source": {"from": "computed now", "path": str(cache), "settings": settings}}


def before_after(sets: list[EvalSet], before: dict, after: dict, before_label: str, split: str = "test") -> dict:
    """Per set: both accuracies with intervals and the paired difference with McNemar's exact p, on the
    held-out `split` (the table's heading names it)."""
    from grpo_exp.evaluation.stats import paired

    out, rows = {}, []
    for s in sets:
        b, a = before["sets"][s.name], after["sets"][s.name]
        pairs = paired([r for r in before["samples"] if r["set"] == s.name],
                       [r for r in after["samples"] if r["set"] == s.name])
        out[s.name] = {"n": a["n"], "distinct": a.get("distinct"), "before": b["accuracy"], "after": a["accuracy"],
                       "before_ci95": [b["accuracy_ci95_low"], b["accuracy_ci95_high"]],
                       "after_ci95": [a["accuracy_ci95_low"], a["accuracy_ci95_high"]],
                       "format_before": b["format_compliance"], "format_after": a["format_compliance"], **pairs}
        low, high = pairs["accuracy_diff_ci95"]
        rows.append([f"{s.name} ({a['n']})", _accuracy_ci(b), _accuracy_ci(a),
                     f"{pairs['accuracy_diff']:+.3f} [{low:+.3f}, {high:+.3f}]",
                     f"{pairs['mcnemar_p']:.2g}", f"{b['format_compliance']:.2f} -> {a['format_compliance']:.2f}"])
    lines = [f"Greedy accuracy on the {split} split ({'held out, reported once' if split == 'test' else 'held out, for choosing settings'}):",
             "", markdown_table(["set (n)", f"{before_label} accuracy [95% CI]", "trained accuracy [95% CI]",
                             "difference [paired 95% CI]",
                             "McNemar p", f"format {before_label} -> trained"], rows)]
    judged = [f"{s.name}: solved where {s.judge.describe()}" for s in sets if s.judge is not None]
    if judged:  # accuracy there is a reward's verdict, not the parsed number against `answer`
        lines += ["", f"Accuracy of {'; '.join(judged)}."]
    return {"before": before_label, "split": split, "sets": out, "table": "\n".join(lines)}


def _accuracy_ci(m: dict) -> str:
    return f"{m['accuracy']:.3f} [{m['accuracy_ci95_low']:.3f}, {m['accuracy_ci95_high']:.3f}]"
