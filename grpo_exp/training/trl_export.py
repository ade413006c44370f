"""`grpo-export-trl <run> --out <file.yaml>`: the GRPOConfig a run trained with, as a YAML file that TRL's own
`trl grpo --config <file.yaml>` (TrlParser) reads back with the same values, plus the model and dataset keys
that command expects (TRL's ModelConfig and ScriptArguments). A supervised run (train.method=sft) is written as
the SFTConfig its SFTTrainer took, for `trl sft --config <file.yaml>`.

The GRPOConfig is rebuilt as the run built it: the run's recorded config (.hydra/config.yaml, with the stage's
own training settings, training_settings.json, over it) through training/trainer.grpo_config_kwargs with the
speed plan the run resolved (speed_plan.json). What grpo-exp does that TRL cannot express (EWC, the curriculum,
the rollout engine and the rest of the speed plan, generated datasets, reward functions by registry name, the
system prompt) is said in YAML comments beside the keys."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from grpo_exp.base import commit
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.run_files import SETTINGS_FILE, SPEED_PLAN_FILE
from grpo_exp.config.recorded import run_config
from grpo_exp.config.schema import TrainConfig
from grpo_exp.config.speed import SpeedConfig, SpeedPlan, resolve
from grpo_exp.training.curriculum.describe import trained_on
from grpo_exp.training.model_card import base_model

RESOLVED = "resolved."


@dataclasses.dataclass
class Export:
    """What the YAML file is made of: the GRPOConfig keyword arguments, TRL's script and model keys, and the
    comments that go with them."""

    run_dir: Path
    cfg: DictConfig
    plan: SpeedPlan
    plan_source: str
    curriculum: Path | None  # the curriculum run this stage belongs to, else None
    grpo: dict[str, Any]  # the trainer's config keywords: GRPOConfig's, or SFTConfig's for an SFT run
    method: str  # train.method: grpo (GRPOTrainer) or sft (SFTTrainer)
    script: dict[str, Any]
    model: dict[str, Any]
    env: dict[str, str]
    notes: list[str]


# --- the run ---------------------------------------------------------------------------------------------

def load_run(path: str | Path) -> tuple[Path, DictConfig, Path | None]:
    """(run directory, the config it trained with, the curriculum run it is a stage of or None) of a training
    run's directory or its model/; a ConfigError in one line for anything else."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory; give a training run's directory (outputs/train/runs/<run>)")
    if path.name in ("model", "adapter") and (path.parent / ".hydra").is_dir():
        path = path.parent
    found = run_config(path)
    if found is None:
        why = " (a sweep: give one of its numbered runs)" if (path / "multirun.yaml").is_file() else ""
        raise ConfigError(f"{path} is not a training run: it has no recorded config (.hydra/config.yaml){why}; "
                          f"give a run directory that grpo_exp.train wrote")
    cfg = found[0]
    if cfg.get("task_name", "train") != "train":
        raise ConfigError(f"{path} is a run of grpo_exp.{cfg.task_name}, not a training run; give a run directory "
                          f"that grpo_exp.train wrote")
    settings = _read_json(path / SETTINGS_FILE)
    if found[1].parent.parent != path:  # a curriculum's stage: the root's config, the stage's own settings
        if settings is None or not OmegaConf.select(cfg, "curriculum.stages"):
            raise ConfigError(f"{path} is not a training run: it has no recorded config (.hydra/config.yaml) or "
                              f"{SETTINGS_FILE} of its own; give a run directory that grpo_exp.train wrote")
        cfg = OmegaConf.merge(cfg, _unflatten({k: v for k, v in settings.items() if not k.startswith(RESOLVED)}))
        return path, cfg, path.parent
    if OmegaConf.select(cfg, "curriculum.stages"):
        stages = sorted(p.name for p in path.iterdir() if p.is_dir() and (p / SETTINGS_FILE).is_file())
        raise ConfigError(f"{path} is a curriculum of {len(cfg.curriculum.stages)} stages; TRL trains one stage "
                          f"at a time, so export each stage's directory: {', '.join(stages) or 'none trained yet'}")
    return path, cfg, None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def _unflatten(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def train_node(cfg: DictConfig) -> DictConfig:
    """The recorded train.* on today's schema: keys the run predates get their defaults, speed switches recorded
    under train.* before the speed group are dropped (the speed plan holds them), and options recorded as
    train.extra.<name> before they were train.* keys (train.epsilon_high, ...) are read as train.<name>."""
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    recorded = OmegaConf.to_container(cfg.train, resolve=True)
    extra = dict(recorded.get("extra") or {})
    promoted = {k: extra.pop(k) for k in list(extra) if k in known}
    recorded = {**{k: v for k, v in recorded.items() if k in known}, "extra": extra, **promoted}
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), recorded)


def speed_plan(run_dir: Path, cfg: DictConfig, train: DictConfig) -> tuple[SpeedPlan, str]:
    """(the plan the run computed with, where it came from): speed_plan.json, else what the run's settings record
    resolved (resolved.* in training_settings.json) over the plan resolved now, on this machine."""
    speed = OmegaConf.merge(OmegaConf.structured(SpeedConfig), cfg.get("speed") or {})
    names = {f.name for f in dataclasses.fields(SpeedPlan)}
    # a plan recorded before a field was added lacks it; such fields have defaults (vllm_memory)
    required = {f.name for f in dataclasses.fields(SpeedPlan) if f.default is dataclasses.MISSING}
    recorded = _read_json(run_dir / SPEED_PLAN_FILE)
    if recorded:
        values = {k[len("speed."):]: v for k, v in recorded.items() if k[len("speed."):] in names}
        if required <= set(values):
            return SpeedPlan(**values), SPEED_PLAN_FILE
    peft = (cfg.get("peft") or {}).get("name") or "none"
    plan = resolve(speed, train, available=False, peft=peft)  # a vllm run trained elsewhere is described, not refused
    settings = _read_json(run_dir / SETTINGS_FILE) or {}
    from grpo_exp.training.run_dir import renamed

    resolved = {k[len(RESOLVED):]: v for k, v in renamed(settings).items() if k.startswith(RESOLVED)}
    changes = {k[len("speed."):]: v for k, v in resolved.items() if k.startswith("speed.") and k[6:] in names}
    if "train.precision" in resolved:
        changes["precision"] = resolved["train.precision"]
    if changes:
        return dataclasses.replace(plan, **changes), f"{SETTINGS_FILE} (resolved.*), the rest resolved now"
    return plan, "resolved now, on this machine (the run recorded no speed plan)"


def reward_weights(cfg: DictConfig) -> list[float]:
    funcs = list(cfg.reward.funcs)
    return [float(w) for w in cfg.reward.weights] if cfg.reward.weights is not None else [1.0] * len(funcs)


def report_to(cfg: DictConfig) -> list[str]:
    """What the run's trainer reported to (training/stage: the logger's name, unless the logger is off)."""
    name = OmegaConf.select(cfg, "logger.name") or "none"
    mode = OmegaConf.select(cfg, "logger.mode") or "offline"
    return [] if name == "none" or mode == "disabled" else [str(name)]


# --- the export --------------------------------------------------------------------------------------------

def build(path: str | Path, output_dir: str | None = None) -> Export:
    """Everything the YAML file holds, for the run at `path`."""
    from grpo_exp.training.trainer import grpo_config_kwargs

    run_dir, cfg, curriculum = load_run(path)
    train = train_node(cfg)
    plan, source = speed_plan(run_dir, cfg, train)
    method = str(train.get("method") or "grpo")
    if method == "sft":
        from grpo_exp.training.sft import sft_config_kwargs

        # an SFT run's speed_plan.json holds its precision and device only; the rollout plan never applied
        kwargs = sft_config_kwargs(train, output_dir or f"{run_dir.name}-trl", plan.precision, report_to(cfg),
                                   use_cpu=plan.device == "cpu")
    else:
        kwargs = grpo_config_kwargs(train, output_dir or f"{run_dir.name}-trl", reward_weights(cfg), report_to(cfg),
                                    plan)
        if "use_cpu" not in (train.extra or {}):
            kwargs["use_cpu"] = plan.device == "cpu"  # the run's device, not this machine's
    notes: list[str] = []
    return Export(run_dir, cfg, plan, source, curriculum, kwargs, method, script_keys(cfg, notes, method),
                  model_keys(cfg, plan, notes), env_keys(cfg), notes)


def _importable(func) -> str | None:
    """`module.name` of a reward function TRL's script can import, or None (a function defined in a script)."""
    import importlib

    module, name = getattr(func, "__module__", None), getattr(func, "__name__", None)
    if not module or not name or module == "__main__":
        return None
    try:
        return f"{module}.{name}" if getattr(importlib.import_module(module), name, None) is func else None
    except ImportError:
        return None


def script_keys(cfg: DictConfig, notes: list[str], method: str = "grpo") -> dict[str, Any]:
    """TRL's ScriptArguments (the dataset) and GRPOScriptArguments (the reward functions; none for SFT)."""
    if method == "sft":
        notes.append(f"dataset: the {cfg.stage.name} stage's training problems with their worked solutions as "
                     f"completions (conversational prompt-completion rows, grpo_exp.training.sft.sft_dataset; seed "
                     f"{cfg.train.seed}); TRL cannot generate them. Build that dataset (prompt: the chat messages, "
                     f"completion: the assistant's worked solution) and set dataset_name (or `datasets:`) to it. The "
                     f"loss is the completion's tokens only (completion_only_loss)")
        keys: dict[str, Any] = {"dataset_name": None, "dataset_config": None, "dataset_train_split": "train"}
    else:
        keys = _grpo_script_keys(cfg, notes)
    if cfg.reward.system_prompt:
        notes.append("system prompt: grpo-exp put reward.system_prompt before every question; TRL's prompts must "
                     "carry it: " + json.dumps(str(cfg.reward.system_prompt)))
    return keys


def _grpo_script_keys(cfg: DictConfig, notes: list[str]) -> dict[str, Any]:
    """A GRPO run's dataset and reward-function keys, with their notes."""
    from grpo_exp.core import rewards

    stage = cfg.stage
    keys: dict[str, Any] = {"dataset_name": None, "dataset_config": None, "dataset_train_split": "train"}
    if stage.dataset == "prompts":
        if not stage.path:
            keys.update(dataset_name=str(stage.hub_id), dataset_config=str(stage.hub_config) or None)
        notes.append(f"dataset: {stage.path or stage.hub_id}, a `prompt` column as TRL reads it. grpo-exp held a "
                     f"validation ({stage.validation_fraction:g}) and a test ({stage.test_fraction:g}) share out by a "
                     f"seeded hash of each prompt (stage.split_seed), and put the system prompt before prompts without "
                     f"one; TRL trains on the whole " + ("split" if not stage.path else "file: write the training split "
                     f"with `grpo-data stage={stage.name} stage.path={stage.path} split=train out={stage.name}_train.jsonl` "
                     f"and set dataset_name (or `datasets:`) to it"))
    elif stage.dataset == "gsm8k" and not stage.path:
        keys.update(dataset_name=str(stage.hub_id), dataset_config=str(stage.hub_config))
        notes.append(f"dataset: {stage.hub_id} ({stage.hub_config}). grpo-exp held a validation share "
                     f"({stage.validation_fraction:g}) out of its train split by a seeded hash (train.seed={cfg.train.seed}) "
                     f"and turned each question into a chat prompt; TRL trains on the whole split and needs a "
                     f"`prompt` column (GSM8K has `question` and `answer`)")
    else:
        where = f"the GSM8K files at {stage.path}" if stage.dataset == "gsm8k" else \
            f"problems grpo-exp generates (the {stage.dataset} level, {stage.num_train} of them, seed {cfg.train.seed})"
        notes.append(f"dataset: {where}; TRL cannot generate them. Write the training split with `grpo-data "
                     f"stage={stage.name} split=train train.seed={cfg.train.seed} out={stage.name}_train.jsonl`, "
                     f"add a `prompt` column (the chat messages) and set dataset_name (or `datasets:`) to it")
    names = list(cfg.reward.funcs)
    paths = [_importable(rewards.REGISTRY.get(n)) if n in rewards.REGISTRY else None for n in names]
    if all(paths):
        keys["reward_funcs"] = paths
    weights = ", ".join(f"{n} x {w:g}" for n, w in zip(names, reward_weights(cfg)))
    notes.append(f"reward functions: grpo-exp's registry names {weights} (reward_weights holds the weights). "
                 + ("reward_funcs names them by import path for TRL's script, which needs grpo-exp installed and a "
                    "dataset with an `answer` column" if all(paths) else
                    "Some are not importable by path (defined in a script), so reward_funcs is left out: give TRL "
                    "their import paths"))
    return keys


def model_keys(cfg: DictConfig, plan: SpeedPlan, notes: list[str]) -> dict[str, Any]:
    """TRL's ModelConfig: the model to start from, its dtype and attention, and LoRA."""
    model = cfg.model
    start = base_model(model)
    if model.source == "pretrained" and model.id and not start:
        start = str(model.id)  # a local directory
    keys: dict[str, Any] = {"model_name_or_path": start}
    if model.get("revision"):
        keys["model_revision"] = str(model.revision)
    if model.source == "packaged_gguf":
        notes.append(f"model: grpo-exp trained the pip package {model.package}'s GGUF, dequantized to fp32; "
                     f"model_name_or_path names the release it was made from, whose weights differ by the "
                     f"quantization error")
    elif model.source == "tiny_random":
        notes.append("model: tiny_random is a random test model grpo-exp builds in code; there is no checkpoint "
                     "to name, so model_name_or_path is empty")
    init_from = cfg.get("init_from")
    if init_from:
        keys["model_name_or_path"] = str(Path(str(init_from)) / "model") if (Path(str(init_from)) / "model").is_dir() \
            else str(init_from)
        notes.append(f"init_from: the run continued {init_from}; model_name_or_path is its model")
    keys["dtype"] = "float32"  # grpo-exp loads fp32 weights; bf16 below is autocast, as in the run
    if plan.attention in ("sdpa", "eager"):
        keys["attn_implementation"] = plan.attention
    if cfg.peft.name == "lora":
        targets = cfg.peft.target_modules
        keys.update(use_peft=True, lora_r=int(cfg.peft.r), lora_alpha=cfg.peft.alpha, lora_dropout=cfg.peft.dropout,
                    lora_target_modules=[targets] if isinstance(targets, str) else list(targets))
        if float(cfg.peft.alpha) == int(cfg.peft.alpha):
            keys["lora_alpha"] = int(cfg.peft.alpha)  # TRL's ModelConfig types it int
    return keys


def env_keys(cfg: DictConfig) -> dict[str, str]:
    """Environment variables TrlParser sets from the file's `env:` (wandb offline, as the run logged)."""
    if OmegaConf.select(cfg, "logger.name") == "wandb" and OmegaConf.select(cfg, "logger.mode") == "offline":
        return {"WANDB_MODE": "offline"}
    return {}


def cannot_express(export: Export) -> list[str]:
    """What the run did that TRL's GRPOTrainer cannot be told in its config."""
    cfg, plan, lines = export.cfg, export.plan, []
    if cfg.ewc["lambda"] > 0:
        lines.append(f"EWC: the run added an elastic-weight-consolidation penalty (ewc.lambda={cfg.ewc['lambda']:g}, "
                     f"gamma={cfg.ewc['gamma']:g}) anchored to the previous stage's weights and Fisher; TRL has no such "
                     f"loss term")
    train = train_node(cfg)
    sft = export.method == "sft"
    if sft:
        lines.append("supervised fine-tuning: the run trained with TRL's SFTTrainer on worked solutions "
                     "(train.method=sft), the continual-learning study's supervised arm; generation, rewards and the "
                     "KL term did not apply, so the file holds SFTConfig keys for `trl sft`")
    if train.dynamic_sampling and not sft:
        lines.append(f"dynamic sampling: the run refilled groups whose completions were all right or all wrong from "
                     f"extra generation rounds (DAPO's filter_groups, train.dynamic_sampling, at most "
                     f"{train.dynamic_sampling_max_draws} extra rounds a step); TRL's GRPOTrainer has no such option")
    if train.get("stop_at_accuracy") is not None:
        lines.append(f"early stop: the run ended at the first periodic validation evaluation whose accuracy reached "
                     f"{train.stop_at_accuracy:g} (train.stop_at_accuracy), train.max_steps at most; TRL stops at "
                     f"max_steps: set max_steps to the step in metrics.json's stop_at_accuracy")
    mixed = trained_on(cfg)
    if cfg.curriculum.mode == "adaptive":
        lines.append(f"training data: {mixed}; TRL samples a fixed dataset: a dataset of these stages' prompts is the "
                     f"nearest, without the pass-rate weights")
    elif mixed:
        lines.append(f"training data: {mixed}; TRL trains on the dataset it is given: build that mixed dataset "
                     f"(grpo-data writes each stage's split) and keep a `stage` column for the rewards")
    if export.curriculum is not None and cfg.curriculum.mode != "adaptive":
        lines.append(f"curriculum: this is the {cfg.stage.name} stage of the curriculum {export.curriculum}; TRL "
                     f"trains one stage: export each stage and run them in order, each from the previous one's output")
    if not sft:  # an SFT stage neither samples nor scores: no rollout or speed plan applied
        lines += _speed_plan_lines(plan)
    if cfg.on_nonfinite == "skip":
        lines.append("on_nonfinite=skip: the run skipped updates with a NaN/inf loss or reward; TRL stops or trains on")
    return lines


def _speed_plan_lines(plan: SpeedPlan) -> list[str]:
    """What the speed plan computed that TRL's own path does not."""
    lines = []
    if plan.generation == "engine":
        lines.append(f"rollout engine: grpo-exp sampled completions with its own engine (a {plan.rollout_dtype} copy "
                     f"of the policy, old log-probs from the {plan.old_logps}); TRL samples with `generate`. The "
                     f"vllm_importance_sampling_* keys below are what the engine set; TRL applies them only with "
                     f"use_vllm=true")
    shortcuts = [name for name, on in (("shared-prefix scoring", plan.shared_prefix),
                                       ("lean saved tensors", plan.saved_tensors == "lean"),
                                       ("a bf16 KL reference", plan.lean_reference),
                                       ("the embedding gradient as rows", plan.embedding_grad)) if on]
    if plan.attention == "grouped" or plan.logprob_kernel == "autocast" or shortcuts:
        parts = ([f"{plan.attention} attention"] if plan.attention == "grouped" else []) + \
            (["its LM-head log-prob kernel"] if plan.logprob_kernel == "autocast" else []) + shortcuts
        lines.append(f"speed plan: grpo-exp computed with {', '.join(parts)} (same recipe, other arithmetic); TRL "
                     f"uses transformers' attention and its own kernels")
    return lines


# --- the file ----------------------------------------------------------------------------------------------

def groups(export: Export) -> list[tuple[str, dict[str, Any]]]:
    """The GRPOConfig keys in three commented groups: the recipe (train.*, train.extra.*), what grpo-exp sets
    for every run, and the speed plan's."""
    train = train_node(export.cfg)
    recipe = {f.name for f in dataclasses.fields(TrainConfig)} | {"activation_checkpointing"} | set(train.extra or {})
    # the sampler's keys the plan set (a train.extra.vllm_* key stays with the recipe, where it was given)
    speed = {k for k in export.grpo if k.startswith("vllm_") or k == "use_vllm"} - recipe
    trainer = "SFTConfig" if export.method == "sft" else "GRPOConfig"
    out = [(f"the {export.method.upper()} recipe (train.* and train.extra.*, by {trainer}'s names)",
            {k: v for k, v in export.grpo.items() if k in recipe}),
           (f"set by grpo-exp for every run (bf16: train.precision as the run resolved it; use_cpu: its device; "
            f"the run wrote its checkpoints to {export.run_dir / 'checkpoints'})",
            {k: v for k, v in export.grpo.items() if k not in recipe | speed}),
           ("the speed plan's vLLM and importance-sampling settings",
            {k: v for k, v in export.grpo.items() if k in speed})]
    return [(title, keys) for title, keys in out if keys]


def _dump(mapping: dict) -> str:
    return yaml.safe_dump(mapping, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)


def _comment(text: str, width: int = 116) -> list[str]:
    import textwrap

    return [f"# {line}" for line in textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)] or ["#"]


def to_yaml(export: Export) -> str:
    """The file: a header saying where it came from and what TRL cannot express, then the keys."""
    from importlib import metadata

    trainer, command = ("SFTConfig", "sft") if export.method == "sft" else ("GRPOConfig", "grpo")
    header = [f"{trainer} of the grpo-exp run {export.run_dir}, written by grpo-export-trl (grpo-exp "
              f"{commit.AT_START or 'unknown'}, TRL {metadata.version('trl')}) from its recorded config and speed plan "
              f"({export.plan_source}).",
              f"Train it with TRL: trl {command} --config <this file> (TRL reads {trainer}, ScriptArguments and "
              f"ModelConfig keys from it)."]
    lines = [line for text in header for line in _comment(text)]
    missing = cannot_express(export) + export.notes
    if missing:
        lines += ["#", "# What TRL cannot be told here (or needs from you):"]
        for text in missing:
            wrapped = _comment(text, 112)
            lines += ["# - " + wrapped[0][2:], *("#   " + w[2:] for w in wrapped[1:])]
    if export.env:
        lines += ["", "# environment TRL sets before training (the run logged to wandb offline)", _dump({"env": export.env}).rstrip()]
    lines += ["", "# model (TRL's ModelConfig)", _dump(export.model).rstrip(),
              "", "# dataset (TRL's ScriptArguments)" if export.method == "sft" else
              "# dataset and rewards (TRL's ScriptArguments / GRPOScriptArguments)", _dump(export.script).rstrip()]
    for title, keys in groups(export):
        lines += [""] + _comment(f"{trainer}: {title}") + [_dump(keys).rstrip()]
    return "\n".join(lines) + "\n"


def write(path: str | Path, out: str | Path, output_dir: str | None = None) -> Export:
    """Export the run at `path` to the YAML file `out`."""
    from grpo_exp.base.io import write_text

    export = build(path, output_dir)
    write_text(out, to_yaml(export))
    return export
