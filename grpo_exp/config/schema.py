"""Typed config schemas, one dataclass per config group, with each group's checks beside its fields.

OmegaConf enforces types and key names from these dataclasses while Hydra composes the config, so
`train.max_stepz=3` or `train.max_steps=abc` fails at composition. Each group's `check(node)` holds
the value rules of that group (ranges, choices) next to the fields they constrain, in the style of
verl's dataclass configs; `grpo_exp.config.checks.validate` runs them all, plus the rules that span
groups, once at the entry and before any model loads. Defaults live here and in conf/*.yaml only
where a group option sets them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, ListConfig, OmegaConf

from grpo_exp.base.cpu import resolve_malloc, resolve_threads, resolve_wait_policy
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.log import LEVELS
from grpo_exp.config.curriculum_schema import CurriculumConfig  # noqa: F401  (re-exported)
from grpo_exp.config.ewc_schema import EWC_FISHER_NORMS, EWC_FISHERS, EwcConfig  # noqa: F401  (re-exported)
from grpo_exp.config.recipe import TrainConfig
from grpo_exp.config.rules import require, require_choice, require_positive
from grpo_exp.config.speed import SpeedConfig
from grpo_exp.core import data


@dataclass
class ModelConfig:
    name: str = MISSING
    # packaged_gguf: a GGUF inside a pip package; pretrained: hub id or local dir; tiny_random: built in code
    source: str = "pretrained"
    id: Optional[str] = None
    package: Optional[str] = None
    revision: Optional[str] = None
    instruct: bool = True
    # tiny_random only: a few-layer Llama that shares the SmolLM2 tokenizer
    tiny_layers: int = 2
    tiny_hidden: int = 64
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_intermediate: int = 128

    SOURCES = ("packaged_gguf", "pretrained", "tiny_random")

    @staticmethod
    def check(model: Any) -> None:
        require_choice("model.source", model.source, ModelConfig.SOURCES)
        if model.source == "pretrained":
            require(bool(model.id), "model.id is empty; give a hub id (org/name) or a local model directory")
        if model.source == "packaged_gguf":
            require(bool(model.package), "model.package is empty; name the pip package that holds the GGUF")
        if model.source == "tiny_random":
            for key in ("tiny_layers", "tiny_hidden", "tiny_heads", "tiny_kv_heads", "tiny_intermediate"):
                require(isinstance(model[key], int) and model[key] >= 1,
                        f"model.{key}={model[key]} must be a positive integer")
            # the shapes transformers' Llama refuses after the run directory is written
            require(model.tiny_hidden % model.tiny_heads == 0,
                    f"model.tiny_heads={model.tiny_heads} must divide model.tiny_hidden={model.tiny_hidden}")
            require(model.tiny_heads % model.tiny_kv_heads == 0,
                    f"model.tiny_kv_heads={model.tiny_kv_heads} must divide model.tiny_heads={model.tiny_heads}")


@dataclass
class StageConfig:
    name: str = MISSING
    dataset: str = "basic"
    path: Optional[str] = None
    hub_id: str = "openai/gsm8k"
    hub_config: str = "main"
    num_train: int = 2000  # GSM8K: 0 means the whole train split
    # held-out sets: validation (periodic evaluation, every choice of a setting) and test (reported once)
    num_validation: int = 200
    num_test: int = 200
    # held-out shares of the computations (generated levels) or of a single GSM8K file's questions; GSM8K's
    # validation share is cut from its train split, its test split is its own
    test_fraction: float = data.TEST_FRACTION
    validation_fraction: float = data.VALIDATION_FRACTION
    # draws the train / validation / test bands and the held-out sets: fixed, so every training seed
    # (train.seed) of a sweep scores the same problems; 42 is the seed that drew them before this key existed
    split_seed: int = 42
    # prompts only: the reward (a reward.funcs name or an import path) whose score decides held-out accuracy, a
    # problem counting as solved where it reaches eval_threshold; null: the first of reward.funcs
    eval_reward: Optional[str] = None
    eval_threshold: float = 1.0

    DATASETS = data.DATASETS  # the generated levels, gsm8k and prompts (a TRL-shaped dataset of one's own)

    @staticmethod
    def check(stage: Any) -> None:
        require_choice("stage.dataset", stage.dataset, StageConfig.DATASETS)
        if stage.dataset == "gsm8k" and stage.path:
            require(Path(stage.path).exists(),
                    f"stage.path={stage.path} does not exist; give a GSM8K JSONL file or a directory "
                    f"with train.jsonl/test.jsonl, or leave it empty to load {stage.hub_id} from the hub")
        if stage.dataset == "prompts":
            StageConfig.check_prompts(stage)
        elif stage.eval_reward is not None:
            raise ConfigError(f"stage.eval_reward={stage.eval_reward} scores the held-out sets of stage.dataset=prompts; "
                              f"a {stage.dataset} stage is scored by its answer (the correctness reward): drop it")
        if stage.dataset in data.LEVELS:
            require(stage.num_train >= 1, f"stage.num_train={stage.num_train} must be >= 1")
        else:
            require(stage.num_train >= 0, f"stage.num_train={stage.num_train} must be >= 0 (0: the whole train split)")
        for key in ("test_fraction", "validation_fraction"):
            require(0 < stage[key] < 1, f"stage.{key}={stage[key]} must be between 0 and 1 (exclusive)")
        require(stage.test_fraction + stage.validation_fraction < 1,
                f"stage.test_fraction + stage.validation_fraction = "
                f"{stage.test_fraction + stage.validation_fraction:g} leaves nothing to train on; keep it below 1")
        require(stage.num_validation >= 1 and stage.num_test >= 1,
                f"stage.num_validation={stage.num_validation} and stage.num_test={stage.num_test} must be >= 1")

    @staticmethod
    def check_prompts(stage: Any) -> None:
        """A prompts stage: where its rows are, and the reward and threshold its held-out accuracy is read from."""
        require(bool(stage.path) or bool(stage.hub_id),
                "stage=prompts needs its data: stage.path=<JSONL file with a prompt column, or a directory of .jsonl "
                "files>, or stage.hub_id=<hub dataset id>")
        if stage.path:
            require(Path(stage.path).exists(),
                    f"stage.path={stage.path} does not exist; give a JSONL file with a prompt column, a directory of "
                    f".jsonl files, or stage.hub_id=<hub dataset id> with stage.path=null")
        if stage.eval_reward is not None:
            from grpo_exp.core import rewards

            try:
                rewards.resolve(str(stage.eval_reward), key="stage.eval_reward")
            except rewards.RewardConfigError as err:
                raise ConfigError(str(err)) from None
        require(math.isfinite(stage.eval_threshold),
                f"stage.eval_threshold={stage.eval_threshold} must be a finite number (the score that counts as solved)")


@dataclass
class RewardConfig:
    name: str = MISSING
    funcs: List[str] = field(default_factory=lambda: ["correctness"])
    weights: Optional[List[float]] = None
    system_prompt: str = ""

    @staticmethod
    def check(reward: Any) -> None:
        from grpo_exp.core import rewards

        try:
            rewards.build(list(reward.funcs), None if reward.weights is None else list(reward.weights))
        except rewards.RewardConfigError as err:
            raise ConfigError(str(err)) from None


@dataclass
class QuantizationConfig:
    method: str = "none"

    METHODS = ("none", "dynamic_int8")

    @staticmethod
    def check(quantization: Any) -> None:
        require_choice("quantization.method", quantization.method, QuantizationConfig.METHODS)


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (training/lora.py): `none` trains every weight of the policy, `lora`
    trains low-rank adapters (peft) on the projections named in target_modules and freezes the rest."""

    name: str = "none"
    r: int = 16  # adapter rank
    alpha: float = 32.0  # peft's lora_alpha: the update is scaled by alpha / r
    # 0: GRPO's importance ratio compares log-probs of the same policy from two forwards; adapter dropout
    # would make them differ by noise alone
    dropout: float = 0.0
    # the attention and MLP projections, named alike in Llama, Qwen2 and Gemma 3; or "all-linear" (peft's
    # every Linear except the LM head)
    target_modules: Any = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"])

    NAMES = ("none", "lora")

    @staticmethod
    def check(peft: Any) -> None:
        require_choice("peft.name", peft.name, PeftConfig.NAMES)
        if peft.name == "none":
            return
        # bool is an int in Python; peft.r=true must not pass as rank 1
        require(isinstance(peft.r, int) and not isinstance(peft.r, bool) and peft.r >= 1,
                f"peft.r={peft.r!r} must be a positive integer (the adapter rank)")
        require(isinstance(peft.alpha, (int, float)) and math.isfinite(peft.alpha) and peft.alpha > 0,
                f"peft.alpha={peft.alpha!r} must be a positive number")
        require(0 <= peft.dropout < 1, f"peft.dropout={peft.dropout!r} must be in [0, 1)")
        targets = peft.target_modules
        if isinstance(targets, str):
            require(targets == "all-linear", f"peft.target_modules={targets!r} must be a list of module names "
                                             f"or 'all-linear'")
        else:
            names = list(targets) if isinstance(targets, (list, tuple, ListConfig)) else None
            require(bool(names) and all(isinstance(n, str) and n for n in names),
                    f"peft.target_modules={names if names is not None else targets!r} must be a non-empty list "
                    f"of module names or 'all-linear'")
            # TRL scores with lm_head.weight directly, so an adapter there would never train
            require("lm_head" not in names, "peft.target_modules names lm_head; TRL computes log-probs from "
                                            "lm_head.weight directly, so an adapter there would never train")
        import importlib.util

        require(importlib.util.find_spec("peft") is not None,
                "peft=lora needs the peft package; install it with pip install -e '.[lora]'")


@dataclass
class CpuConfig:
    # "auto" (all cores this process may use) or a positive integer
    threads: Any = "auto"
    interop_threads: int = 1
    # default | passive | active: OMP_WAIT_POLICY, set before torch loads (see grpo_exp/base/cpu.py)
    omp_wait_policy: str = "default"
    # auto | retain | glibc: what glibc does with freed memory (retain: reuse it, never unmap or trim; auto:
    # retain where the C library is glibc; see grpo_exp/base/cpu.py apply_malloc)
    malloc: str = "auto"

    @staticmethod
    def check(cpu: Any) -> None:
        resolve_threads(cpu.threads)
        require(cpu.interop_threads >= 1, f"cpu.interop_threads={cpu.interop_threads} must be >= 1")
        resolve_wait_policy(cpu.omp_wait_policy)
        resolve_malloc(cpu.malloc)


@dataclass
class LoggerConfig:
    name: str = "none"
    # wandb project, or trackio project (also its SQLite file name: <dir>/<project>.db)
    project: str = "grpo-exp"
    entity: Optional[str] = None  # wandb only
    # wandb: offline/online/disabled; trackio is local only: offline, or disabled to turn it off
    mode: str = "offline"
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)
    # trackio storage directory; None: <sweep dir>/trackio for a multirun, <curriculum run>/trackio
    # for curriculum stages, else <run dir>/trackio (wandb always writes under the run directory)
    dir: Optional[str] = None

    NAMES = ("none", "wandb", "trackio")
    MODES = ("offline", "online", "disabled")
    TRACKIO_MODES = ("offline", "disabled")

    @staticmethod
    def check(logger: Any) -> None:
        require_choice("logger.name", logger.name, LoggerConfig.NAMES)
        require_choice("logger.mode", logger.mode, LoggerConfig.MODES)
        if logger.name == "trackio":
            # trackio writes a local SQLite database here; logging to a Space would need a network and a login
            require(logger.mode in LoggerConfig.TRACKIO_MODES,
                    f"logger.mode={logger.mode!r} is not valid with logger=trackio (it logs locally); "
                    f"choose one of: {', '.join(LoggerConfig.TRACKIO_MODES)}")
            # trackio names the database after the project, dropping other characters and refusing registry-*
            project = str(logger.project)
            require(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", project) is not None
                    and not project.startswith("registry-"),
                    f"logger.project={project!r} is not a valid trackio project name; use letters, digits, "
                    "'-' and '_' (not starting with 'registry-')")
            require(logger.dir is None or str(logger.dir).strip() != "",
                    "logger.dir must be a directory path, or null for the run or sweep directory")


@dataclass
class EvalConfig:
    """Ground-truth evaluation (grpo_exp.evaluate, and training runs with after_train=true)."""

    # after training: evaluate the trained model and the model it started from on the same held-out
    # problems, and print a before/after table with a paired McNemar test
    after_train: bool = True
    # the held-out split scored after training and by grpo_exp.evaluate: test (report it once) or validation
    # (what sweeps rank on); periodic and forgetting evaluations during training always use validation
    split: str = "test"
    # names from conf/stage (basic, intermediate, two_step, three_step, multi_step, advanced, gsm8k); empty: the
    # current stage
    sets: List[str] = field(default_factory=list)
    limit: int = 200  # problems per set: a fixed seeded subset of the held-out split
    batch_size: int = 32  # problems per batch through generate (and sampled completions' prompts per batch)
    # the engine path (greedy, eval.decode) decodes as many problems together as their KV cache (fp32 keys and
    # values of every layer, at the call's cache length) fits in this many MiB: its answers do not depend on how many
    # (evaluation/fast_decode.py), and each step's weights then serve more rows. The default model at basic's
    # lengths takes about 6 MiB a row (200 problems in one batch), at GSM8K's about 20.
    engine_cache_mb: float = 1536
    max_new_tokens: Optional[int] = None  # None: each set's stage max_completion_length
    do_sample: bool = False  # greedy by default
    # how greedy completions are decoded (evaluation/generate.decode_path): auto (the engine path,
    # evaluation/fast_decode.py, where it serves the model: fp32 on the CPU, no adapters or quantized layers; else
    # HF generate), engine (an error where it cannot), generate (HF generate, which published figures used).
    # Sampled completions (do_sample, pass_k, maj_k) always decode through generate.
    decode: str = "auto"
    temperature: float = 1.0
    # sampling filters, as train.top_k/top_p: 0 and 1.0 sample the whole vocabulary, as TRL's rollouts do
    # (HF generate alone would apply top_k=50, a sharper sampler than the one training learns from)
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # pass@k (unbiased estimator, Chen et al. 2021) from `num_samples` completions per problem sampled
    # at eval.temperature, beside the greedy accuracy; e.g. eval.pass_k=[1,8]. Empty: greedy only.
    pass_k: List[int] = field(default_factory=list)
    # maj@k: the majority vote of the parsed answers of each problem's first k sampled completions (ties: the
    # answer given first; unparsable answers never vote), e.g. eval.maj_k=[8]. Sampled as pass@k is, from the
    # same completions; with either, pass@1 estimated from the samples and bootstrap intervals are reported too.
    maj_k: List[int] = field(default_factory=list)
    num_samples: Optional[int] = None  # None: the largest k of pass_k and maj_k
    # during training: greedy accuracy on the first `every_limit` held-out problems every N steps
    # (eval/<set>/accuracy in history.jsonl and wandb); null turns it off
    every_steps: Optional[int] = 20
    every_limit: int = 50
    # a later stage (init_from set): every `every_steps`, the KL from init_from's policy on these earlier
    # stages' prompts (forgetting/<set>/kl) and greedy accuracy there (eval/<set>/accuracy); the
    # curriculum fills it with the stages before the current one (curriculum.track_forgetting)
    forgetting_sets: List[str] = field(default_factory=list)

    SPLITS = ("validation", "test")  # the training split is never scored as held-out
    DECODES = ("auto", "engine", "generate")

    @staticmethod
    def check(ev: Any) -> None:
        from grpo_exp.config.options import group_options

        require_choice("eval.split", ev.split, EvalConfig.SPLITS)
        require_choice("eval.decode", ev.decode, EvalConfig.DECODES)
        valid = group_options("stage")
        for name in ev.sets:
            require(name in valid, f"unknown eval set '{name}' in eval.sets; valid sets: {', '.join(valid)}")
        for name in ev.forgetting_sets:
            require(name in valid, f"unknown stage '{name}' in eval.forgetting_sets; valid stages: {', '.join(valid)}")
        require_positive("eval", ev, "limit", "batch_size", "engine_cache_mb", "every_limit")
        require(ev.max_new_tokens is None or ev.max_new_tokens >= 1,
                f"eval.max_new_tokens={ev.max_new_tokens} must be a positive integer or null (the stage's length)")
        require(math.isfinite(ev.temperature) and ev.temperature > 0, f"eval.temperature={ev.temperature} must be > 0")
        require(ev.top_k >= 0, f"eval.top_k={ev.top_k} must be >= 0 (0: no top-k filter)")
        require(0 < ev.top_p <= 1, f"eval.top_p={ev.top_p} must be in (0, 1]")
        require(ev.every_steps is None or ev.every_steps >= 1,
                f"eval.every_steps={ev.every_steps} must be a positive integer (or null to turn it off)")
        for key in ("pass_k", "maj_k"):
            for k in ev[key]:
                require(k >= 1, f"eval.{key} has k={k}; every k must be a positive integer")
        samples = pass_k_samples(ev)
        require(samples is None or samples >= 1, f"eval.num_samples={ev.num_samples} must be a positive integer")
        for key in ("pass_k", "maj_k"):
            for k in ev[key]:
                require(k <= samples, f"eval.{key} has k={k}, above the {samples} samples per problem "
                                      f"(eval.num_samples={samples}); raise eval.num_samples or lower k")


def pass_k_samples(ev: Any) -> int | None:
    """Completions sampled per problem for pass@k and maj@k: eval.num_samples, or the largest k of either."""
    if ev.num_samples is not None:
        return ev.num_samples
    ks = [*ev.pass_k, *ev.get("maj_k", [])]
    return max(ks) if ks else None


@dataclass
class PathsConfig:
    output_dir: str = MISSING
    cache_dir: str = MISSING


@dataclass
class RunConfig:
    task_name: str = "train"
    model: ModelConfig = MISSING
    stage: StageConfig = MISSING
    reward: RewardConfig = MISSING
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    ewc: EwcConfig = field(default_factory=EwcConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    # a run directory (or its model/) to continue from, with its EWC state when ewc.lambda > 0
    init_from: Optional[str] = None
    # keys an experiment cannot run without and the command line must give (`requires: [init_from]`): a Hydra `???`
    # merged onto a schema default silently keeps the default, so an experiment names them here instead
    requires: List[str] = field(default_factory=list)
    # false, true (continue the run in paths.output_dir = hydra.run.dir) or the run directory to continue
    resume: Any = False
    # resume even where the training settings differ from the run's first start (named in a warning)
    resume_allow_changes: bool = False
    # a NaN/inf loss or reward: stop (keeping the last checkpoint) or skip that batch's update
    on_nonfinite: str = "stop"
    # rows of prompts/completions/rewards kept in completions.jsonl, every `completions_every` steps
    completions_every: int = 5
    # level of the grpo_exp loggers: WARNING quiets a run, DEBUG says more
    log_level: str = "INFO"
    # after training, upload model/ (and adapter/ with peft=lora) to the hub repo hub_model_id (training/hub.py);
    # checked before training: the hub reachable, a token present
    push_to_hub: bool = False
    hub_model_id: Optional[str] = None  # "org/name" or "name" (under the token's user)
    hub_private: Optional[bool] = None  # a repo created by the push: private or not; None: the hub's default
    # a sweep (-m): every job's config checked before any starts (`before`), or each inside its own job (`in_job`:
    # for a cluster whose jobs see files, models or data the submitting machine does not)
    sweep_check: str = "before"

    NONFINITE_POLICIES = ("stop", "skip")
    SWEEP_CHECKS = ("before", "in_job")

    @staticmethod
    def check(cfg: Any) -> None:
        require_choice("on_nonfinite", cfg.on_nonfinite, RunConfig.NONFINITE_POLICIES)
        require_choice("log_level", cfg.log_level, LEVELS)
        require_choice("sweep_check", cfg.get("sweep_check", "before"), RunConfig.SWEEP_CHECKS)
        require(isinstance(cfg.resume, bool) or (isinstance(cfg.resume, str) and Path(cfg.resume).is_dir()),
                f"resume={cfg.resume!r} must be true, false or an existing run directory")
        require(cfg.completions_every >= 1, f"completions_every={cfg.completions_every} must be >= 1")
        for key in cfg.get("requires") or []:
            require(OmegaConf.select(cfg, key) not in (None, ""),
                    f"{key} is not set and this experiment needs it (requires={list(cfg.requires)}): add {key}=<value>")
        if cfg.init_from:
            require(Path(cfg.init_from).exists(), f"init_from={cfg.init_from} does not exist; give the run directory "
                                                  f"of an earlier stage (it holds model/)")
        hub_id = cfg.get("hub_model_id")
        if cfg.get("push_to_hub"):
            require(bool(hub_id), "push_to_hub=true needs hub_model_id=<org/name> (the hub repo to upload model/ to)")
        if hub_id:
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(str(hub_id))
            except HFValidationError as err:
                raise ConfigError(f"hub_model_id={hub_id!r} is not a hub repo id ({str(err).splitlines()[0]}); "
                                  f"give org/name or name") from None


@dataclass
class EvaluateRunConfig(RunConfig):
    """Root of `python -m grpo_exp.evaluate`: the training config plus the model to evaluate."""

    task_name: str = "evaluate"
    # a run directory holding model/, or a model directory; None: the base model of the `model` option
    checkpoint: Optional[str] = None


# group name -> schema, in the order validate checks them
GROUPS = {"model": ModelConfig, "stage": StageConfig, "quantization": QuantizationConfig, "peft": PeftConfig,
          "logger": LoggerConfig, "cpu": CpuConfig, "train": TrainConfig, "speed": SpeedConfig, "ewc": EwcConfig, "eval": EvalConfig,
          "curriculum": CurriculumConfig, "reward": RewardConfig}


def register_configs() -> None:
    """Make the schemas available to the defaults lists as `train_schema` and `evaluate_schema`."""
    ConfigStore.instance().store(name="train_schema", node=RunConfig)
    ConfigStore.instance().store(name="evaluate_schema", node=EvaluateRunConfig)


register_configs()
