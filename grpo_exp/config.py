"""Structured-config schemas (registered in Hydra's ConfigStore) and the semantic checks run at start.

Types and key names are enforced by OmegaConf through these dataclasses, so a typo such as
`train.max_stepz=3` or `train.max_steps=abc` fails while the config is composed. Rules that span
several values (GRPO batch divisibility, known reward names, existing paths) live in `validate`,
which every entrypoint calls before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from grpo_exp.errors import ConfigError

MODEL_SOURCES = ("packaged_gguf", "pretrained", "tiny_random")
DATASETS = ("basic", "intermediate", "advanced", "gsm8k")
PRECISIONS = ("auto", "bf16", "fp32")
# OMP_WAIT_POLICY choices; "default" leaves OpenMP's own (grpo_exp/cpu.py)
WAIT_POLICIES = ("default", "passive", "active")
QUANT_METHODS = ("none", "dynamic_int8")
LOGGERS = ("none", "wandb")


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


@dataclass
class StageConfig:
    name: str = MISSING
    dataset: str = "basic"
    path: Optional[str] = None
    hub_id: str = "openai/gsm8k"
    hub_config: str = "main"
    num_train: int = 2000
    num_test: int = 200
    # held-out share: of the expression space (generated levels) or of a single GSM8K file
    test_fraction: float = 0.2


@dataclass
class RewardConfig:
    name: str = MISSING
    funcs: List[str] = field(default_factory=lambda: ["correctness"])
    weights: Optional[List[float]] = None
    system_prompt: str = ""


@dataclass
class QuantizationConfig:
    method: str = "none"


@dataclass
class CpuConfig:
    # "auto" (all cores this process may use) or a positive integer
    threads: Any = "auto"
    interop_threads: int = 1
    # default | passive | active: OMP_WAIT_POLICY, set before torch loads (see grpo_exp/cpu.py)
    omp_wait_policy: str = "default"


@dataclass
class TrainConfig:
    """GRPO hyperparameters, named as TRL's GRPOConfig names them."""

    max_steps: int = 60
    num_generations: int = 4
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    generation_batch_size: Optional[int] = None
    steps_per_generation: Optional[int] = None
    num_iterations: int = 1
    max_completion_length: int = 64
    learning_rate: float = 1e-5
    lr_scheduler_type: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    mask_truncated_completions: bool = False
    seed: int = 42
    # auto: bf16 autocast where the hardware computes bf16 natively (CUDA, AVX512-BF16, AMX), else fp32
    precision: str = "auto"
    gradient_checkpointing: bool = False
    # Score each distinct prompt once per batch instead of once per completion (grpo_exp/shared_prefix.py):
    # the same log-probs and gradients as TRL's forward, with less work. Off when gradient checkpointing is on.
    shared_prefix: bool = True
    logging_steps: int = 1
    save_steps: int = 50
    save_total_limit: Optional[int] = 2
    # Any other GRPOConfig field, passed through after a name check
    extra: Any = field(default_factory=dict)


@dataclass
class LoggerConfig:
    name: str = "none"
    project: str = "grpo-exp"
    entity: Optional[str] = None
    mode: str = "offline"
    group: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class EvalConfig:
    """Ground-truth evaluation (grpo_exp.evaluate, and training runs with after_train=true)."""

    # after training: evaluate the trained model and the base model it started from on the same
    # held-out problems, and print a before/after table with a paired McNemar test
    after_train: bool = True
    # names from conf/stage (basic, intermediate, advanced, gsm8k); empty: the current stage
    sets: List[str] = field(default_factory=list)
    limit: int = 200  # problems per set: a fixed seeded subset of the held-out split
    batch_size: int = 32
    max_new_tokens: Optional[int] = None  # None: each set's stage max_completion_length
    do_sample: bool = False  # greedy by default
    temperature: float = 1.0
    seed: int = 0
    # pass@k (unbiased estimator, Chen et al. 2021) from `num_samples` completions per problem sampled
    # at eval.temperature, beside the greedy accuracy; e.g. eval.pass_k=[1,8]. Empty: greedy only.
    pass_k: List[int] = field(default_factory=list)
    num_samples: Optional[int] = None  # None: the largest k
    # during training: greedy accuracy on the first `every_limit` held-out problems every N steps
    # (eval/<set>/accuracy in history.jsonl and wandb); null turns it off
    every_steps: Optional[int] = 20
    every_limit: int = 50


@dataclass
class PathsConfig:
    output_dir: str = MISSING
    cache_dir: str = MISSING


EWC_DEFAULTS = {
    "lambda": 0.0,  # 0 = no EWC: no penalty and no Fisher estimate
    "gamma": 1.0,  # online EWC decay of the old Fisher: F <- gamma * F_old + F_new
    "fisher_samples": 32,  # sampled completions (one gradient each) per Fisher estimate
    "fisher_batch_size": 8,  # prompts per sampling batch (gradients are still per sequence)
    "fisher_max_new_tokens": None,  # None: the stage's train.max_completion_length
    "include_embeddings": False,  # the tied embedding/LM head dominates parameter count; leave it out by default
}


@dataclass
class CurriculumConfig:
    name: str = "none"
    # stage option names run in order, each continuing from the last; empty: a single-stage run
    stages: List[str] = field(default_factory=list)
    eval_limit: int = 100  # held-out problems per stage in the accuracy matrix
    eval_batch_size: int = 16
    eval_base: bool = True  # also evaluate the starting model (row "base" of the matrix)


@dataclass
class RunConfig:
    task_name: str = "train"
    model: ModelConfig = MISSING
    stage: StageConfig = MISSING
    reward: RewardConfig = MISSING
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    cpu: CpuConfig = field(default_factory=CpuConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    # `lambda` is a Python keyword, so this node is a checked dict rather than a dataclass
    ewc: Any = field(default_factory=lambda: dict(EWC_DEFAULTS))
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    # a run directory (or its model/) to continue from, with its EWC state when ewc.lambda > 0
    init_from: Optional[str] = None
    # false, true (continue the run in paths.output_dir = hydra.run.dir) or the run directory to continue
    resume: Any = False
    # a NaN/inf loss or reward: stop (keeping the last checkpoint) or skip that batch's update
    on_nonfinite: str = "stop"
    # rows of prompts/completions/rewards kept in completions.jsonl, every `completions_every` steps
    completions_every: int = 5


@dataclass
class EvaluateRunConfig(RunConfig):
    """Root of `python -m grpo_exp.evaluate`: the training config plus the model to evaluate."""

    task_name: str = "evaluate"
    # a run directory holding model/, or a model directory; None: the base model of the `model` option
    checkpoint: Optional[str] = None


def register_configs() -> None:
    """Make the schemas available to the defaults lists as `train_schema` and `evaluate_schema`."""
    ConfigStore.instance().store(name="train_schema", node=RunConfig)
    ConfigStore.instance().store(name="evaluate_schema", node=EvaluateRunConfig)


register_configs()


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}")


def resolve_threads(threads: Any) -> int:
    """`auto` means every core this process may run on."""
    if str(threads) == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        n = int(threads)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(n) != str(threads).strip():
        raise ConfigError(f"cpu.threads={threads!r} is not valid; use 'auto' or a positive integer")
    return n


def resolve_wait_policy(policy: Any) -> str | None:
    """OMP_WAIT_POLICY for cpu.omp_wait_policy; None for "default" (leave OpenMP's own)."""
    _choice("cpu.omp_wait_policy", policy, WAIT_POLICIES)
    return None if policy == "default" else str(policy).upper()


def resolve_precision(precision: str) -> str:
    """bf16 only pays where the hardware has bf16 arithmetic: without it (AVX2-only CPUs) torch
    emulates bf16 matmuls and a training step runs tens of times slower than in fp32."""
    if precision != "auto":
        return precision
    import torch

    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bf16" if native else "fp32"


def generation_batch(train: Any) -> tuple[int, int]:
    """(completions per generation round, per-device batches it feeds), as GRPOConfig derives them. The
    second is TRL's steps_per_generation: optimizer steps only when gradient_accumulation_steps is 1."""
    per_step = train.per_device_train_batch_size
    if train.generation_batch_size is not None and train.steps_per_generation is not None:
        raise ConfigError(
            "set only one of train.generation_batch_size and train.steps_per_generation, not both"
        )
    if train.generation_batch_size is not None:
        if train.generation_batch_size % per_step:
            raise ConfigError(
                f"train.generation_batch_size={train.generation_batch_size} must be a multiple of "
                f"train.per_device_train_batch_size={per_step}"
            )
        return train.generation_batch_size, train.generation_batch_size // per_step
    spg = train.steps_per_generation or train.gradient_accumulation_steps
    return per_step * spg, spg


def validate_train(train: Any) -> None:
    positive = ("max_steps", "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
                "num_iterations", "max_completion_length", "logging_steps", "save_steps")
    for key in positive:
        value = getattr(train, key)
        _require(value >= 1, f"train.{key}={value} must be a positive integer")
    _require(train.num_generations >= 2,
             f"train.num_generations={train.num_generations} must be at least 2 (GRPO compares completions within a group)")
    _require(math.isfinite(train.learning_rate) and train.learning_rate > 0,
             f"train.learning_rate={train.learning_rate} must be a positive number")
    _require(train.temperature > 0, f"train.temperature={train.temperature} must be > 0")
    _require(0 < train.top_p <= 1, f"train.top_p={train.top_p} must be in (0, 1]")
    _require(train.beta >= 0, f"train.beta={train.beta} must be >= 0")
    _choice("train.precision", train.precision, PRECISIONS)
    _choice("train.loss_type", train.loss_type,
            ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"))
    _choice("train.scale_rewards", train.scale_rewards, ("group", "batch", "none"))
    gen_batch, _ = generation_batch(train)
    if gen_batch % train.num_generations:
        divisors = [d for d in range(2, gen_batch + 1) if gen_batch % d == 0]
        raise ConfigError(
            f"train.num_generations={train.num_generations} does not divide the generation batch of {gen_batch} "
            f"completions (train.per_device_train_batch_size x steps_per_generation); use one of "
            f"{', '.join(map(str, divisors))} or change the batch size"
        )
    extra = OmegaConf.to_container(train.extra) if isinstance(train.extra, DictConfig) else dict(train.extra or {})
    if extra:
        from trl import GRPOConfig

        known = {f.name for f in dataclasses.fields(GRPOConfig)}
        unknown = sorted(set(extra) - known)
        _require(not unknown, f"train.extra has keys that GRPOConfig does not know: {', '.join(unknown)}")
        clash = sorted(set(extra) & {f.name for f in dataclasses.fields(TrainConfig)})
        _require(not clash, f"set {', '.join(clash)} as train.<name>, not inside train.extra")


def validate_ewc(ewc: Any) -> None:
    keys = set(ewc.keys())
    unknown = sorted(keys - set(EWC_DEFAULTS))
    _require(not unknown, f"unknown ewc key(s) {', '.join(unknown)}; valid keys: {', '.join(EWC_DEFAULTS)}")
    for key in ("lambda", "gamma"):
        value = ewc.get(key, EWC_DEFAULTS[key])
        _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                 and value >= 0, f"ewc.{key}={value!r} must be a finite number >= 0")
    for key in ("fisher_samples", "fisher_batch_size"):
        value = ewc.get(key, EWC_DEFAULTS[key])
        _require(isinstance(value, int) and value >= 1, f"ewc.{key}={value!r} must be a positive integer")


def ewc_settings(cfg: Any) -> dict:
    """The ewc node with defaults filled in, as plain Python values."""
    values = OmegaConf.to_container(cfg.ewc, resolve=True) if isinstance(cfg.ewc, DictConfig) else dict(cfg.ewc)
    return {**EWC_DEFAULTS, **values}


def validate_eval(ev: Any) -> None:
    """The eval node: known set names (options of conf/stage) and sane sizes."""
    from grpo_exp.cli import group_options

    valid = group_options("stage")
    for name in ev.sets:
        _require(name in valid, f"unknown eval set '{name}' in eval.sets; valid sets: {', '.join(valid)}")
    for key in ("limit", "batch_size"):
        value = getattr(ev, key)
        _require(value >= 1, f"eval.{key}={value} must be a positive integer")
    _require(ev.max_new_tokens is None or ev.max_new_tokens >= 1,
             f"eval.max_new_tokens={ev.max_new_tokens} must be a positive integer or null (the stage's length)")
    _require(math.isfinite(ev.temperature) and ev.temperature > 0, f"eval.temperature={ev.temperature} must be > 0")
    _require(ev.every_steps is None or ev.every_steps >= 1,
             f"eval.every_steps={ev.every_steps} must be a positive integer (or null to turn it off)")
    _require(ev.every_limit >= 1, f"eval.every_limit={ev.every_limit} must be a positive integer")
    for k in ev.pass_k:
        _require(k >= 1, f"eval.pass_k has k={k}; every k must be a positive integer")
    samples = pass_k_samples(ev)
    _require(samples is None or samples >= 1, f"eval.num_samples={ev.num_samples} must be a positive integer")
    for k in ev.pass_k:
        _require(k <= samples, f"eval.pass_k has k={k}, above the {samples} samples per problem "
                               f"(eval.num_samples={samples}); raise eval.num_samples or lower k")


def pass_k_samples(ev: Any) -> int | None:
    """Completions sampled per problem for pass@k: eval.num_samples, or the largest k."""
    if ev.num_samples is not None:
        return ev.num_samples
    return max(ev.pass_k) if ev.pass_k else None


def validate(cfg: Any) -> None:
    """Semantic checks that need no model: raise ConfigError with a one-line message on the first problem."""
    from grpo_exp import rewards

    _choice("model.source", cfg.model.source, MODEL_SOURCES)
    if cfg.model.source == "pretrained":
        _require(bool(cfg.model.id), "model.id is empty; give a hub id (org/name) or a local model directory")
    if cfg.model.source == "packaged_gguf":
        _require(bool(cfg.model.package), "model.package is empty; name the pip package that holds the GGUF")
    _choice("stage.dataset", cfg.stage.dataset, DATASETS)
    if cfg.stage.dataset == "gsm8k" and cfg.stage.path:
        _require(Path(cfg.stage.path).exists(),
                 f"stage.path={cfg.stage.path} does not exist; give a GSM8K JSONL file or a directory "
                 f"with train.jsonl/test.jsonl, or leave it empty to load {cfg.stage.hub_id} from the hub")
    if cfg.stage.dataset != "gsm8k":  # for GSM8K, 0 means the whole split
        _require(cfg.stage.num_train >= 1, f"stage.num_train={cfg.stage.num_train} must be >= 1")
    _require(0 < cfg.stage.test_fraction < 1,
             f"stage.test_fraction={cfg.stage.test_fraction} must be between 0 and 1 (exclusive)")
    if cfg.stage.dataset != "gsm8k" and cfg.eval.after_train and cfg.eval.limit > cfg.stage.num_test:
        raise ConfigError(f"eval set '{cfg.stage.name}' holds {cfg.stage.num_test} held-out problems (stage.num_test) "
                          f"but {cfg.eval.limit} were asked for (eval.limit={cfg.eval.limit}); lower the limit or "
                          f"raise stage.num_test")
    _choice("quantization.method", cfg.quantization.method, QUANT_METHODS)
    _choice("logger.name", cfg.logger.name, LOGGERS)
    _choice("logger.mode", cfg.logger.mode, ("offline", "online", "disabled"))
    resolve_threads(cfg.cpu.threads)
    _require(cfg.cpu.interop_threads >= 1, f"cpu.interop_threads={cfg.cpu.interop_threads} must be >= 1")
    resolve_wait_policy(cfg.cpu.omp_wait_policy)
    _choice("on_nonfinite", cfg.on_nonfinite, ("stop", "skip"))
    _require(isinstance(cfg.resume, bool) or (isinstance(cfg.resume, str) and Path(cfg.resume).is_dir()),
             f"resume={cfg.resume!r} must be true, false or an existing run directory")
    _require(cfg.completions_every >= 1, f"completions_every={cfg.completions_every} must be >= 1")
    validate_train(cfg.train)
    validate_ewc(cfg.ewc)
    validate_eval(cfg.eval)
    if cfg.curriculum.stages:
        from grpo_exp.cli import group_options

        for stage in cfg.curriculum.stages:
            _choice("curriculum.stages entry", stage, tuple(group_options("stage")))
        _require(cfg.curriculum.eval_limit >= 1, f"curriculum.eval_limit={cfg.curriculum.eval_limit} must be >= 1")
    if cfg.init_from:
        _require(Path(cfg.init_from).exists(), f"init_from={cfg.init_from} does not exist; give the run directory "
                 f"of an earlier stage (it holds model/)")
    try:
        rewards.build(list(cfg.reward.funcs), None if cfg.reward.weights is None else list(cfg.reward.weights))
    except rewards.RewardConfigError as err:
        raise ConfigError(str(err)) from None
