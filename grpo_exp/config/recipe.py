"""The GRPO recipe (`train.*`): TrainConfig, named as TRL's GRPOConfig names its fields, with its checks, and the
generation batch GRPOConfig derives from it. How a run computes is the speed group's (config/speed.py)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from grpo_exp.base import dist
from grpo_exp.base.cpu import PRECISIONS
from grpo_exp.base.errors import ConfigError
from grpo_exp.config.rules import require, require_choice, require_positive


@dataclass
class TrainConfig:
    """GRPO hyperparameters, named as TRL's GRPOConfig names them. MISSING here: the value is in
    conf/train/default.yaml (one place for each default); the rest default here."""

    max_steps: int = MISSING
    num_generations: int = MISSING
    per_device_train_batch_size: int = MISSING
    gradient_accumulation_steps: int = MISSING
    generation_batch_size: Optional[int] = None
    steps_per_generation: Optional[int] = MISSING
    num_iterations: int = 1
    max_completion_length: int = MISSING
    learning_rate: float = MISSING
    lr_scheduler_type: str = "linear"  # conf/train/default.yaml says the recipe; TRL's own default
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    beta: float = MISSING
    epsilon: float = 0.2
    # The policy-loss options below keep TRL's defaults, so a run that leaves them alone builds the GRPOConfig it
    # built when they were reachable only as train.extra.*. DAPO's clip-higher: the ratio's upper clip is
    # 1 + epsilon_high (null: epsilon); with loss_type=cispo it is the cap on the ratio itself (ScaleRL: 5.0)
    epsilon_high: Optional[float] = None
    # GSPO: one ratio per completion (the mean of its tokens' log-ratios), not one per token
    importance_sampling_level: str = "token"
    # an entropy bonus: the loss less entropy_coef x the mean entropy of the tokens the policy loss trains on
    entropy_coef: float = 0.0
    # "Beyond the 80/20 rule": only this share of the batch's tokens, highest entropy first, carry policy gradient
    top_entropy_quantile: float = 1.0
    loss_type: str = MISSING
    scale_rewards: str = MISSING
    temperature: float = MISSING
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    mask_truncated_completions: bool = False
    seed: int = MISSING
    # auto: bf16 autocast where the hardware computes bf16 natively (CUDA, AVX512-BF16, AMX), else fp32
    precision: str = MISSING
    gradient_checkpointing: bool = False
    logging_steps: int = 1
    save_steps: int = MISSING
    save_total_limit: Optional[int] = MISSING
    # a completed stage's checkpoints/ is removed once metrics.json marks it done (run_dir.drop_checkpoints)
    keep_final_checkpoint: bool = MISSING
    # DAPO's filter_groups (training/dynamic_sampling.py): groups whose correctness is all equal are dropped
    # and replaced by groups of newly drawn prompts, for at most dynamic_sampling_max_draws extra rounds
    dynamic_sampling: bool = False
    dynamic_sampling_max_draws: int = 3
    # grpo: TRL's GRPOTrainer; sft: TRL's SFTTrainer on the stage's worked solutions at the same optimizer settings
    # (training/sft.py: the continual-learning study's supervised arm)
    method: str = "grpo"
    # stop the stage at the first periodic validation evaluation (eval.every_steps, on the first eval.every_limit
    # validation problems) whose greedy accuracy reaches this, train.max_steps at most; null trains every step.
    # The continual study's SFT run matched to GRPO's accuracy (curriculum.match_accuracy_of) sets it per stage
    stop_at_accuracy: Optional[float] = None
    # every evaluated step must be a valid stopping point (a compute curve, a probe read step by step): the
    # learning-rate schedule may not decay towards train.max_steps, so only ANYTIME_SCHEDULES are accepted
    anytime: bool = False
    # Any other GRPOConfig field, passed through after a name check
    extra: Any = field(default_factory=dict)

    METHODS = ("grpo", "sft")
    # schedules whose rate at a step does not depend on where the run ends
    ANYTIME_SCHEDULES = ("constant", "constant_with_warmup", "inverse_sqrt")
    LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
    IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
    REWARD_SCALINGS = ("group", "batch", "none")

    @staticmethod
    def check(train: Any) -> None:
        require_positive("train", train, "max_steps", "num_generations", "per_device_train_batch_size",
                         "gradient_accumulation_steps", "num_iterations", "max_completion_length",
                         "logging_steps", "save_steps")
        require(train.num_generations >= 2, f"train.num_generations={train.num_generations} must be at least 2 "
                                            f"(GRPO compares completions within a group)")
        require(math.isfinite(train.learning_rate) and train.learning_rate > 0,
                f"train.learning_rate={train.learning_rate} must be a positive number")
        require(train.temperature > 0, f"train.temperature={train.temperature} must be > 0")
        require(0 < train.top_p <= 1, f"train.top_p={train.top_p} must be in (0, 1]")
        require(train.beta >= 0, f"train.beta={train.beta} must be >= 0")
        # a warm-up as long as the run never reaches the learning rate it was given
        require(0 <= train.warmup_steps < train.max_steps,
                f"train.warmup_steps={train.warmup_steps} must be >= 0 and below train.max_steps={train.max_steps} "
                f"(the warm-up would not end within the run)")
        _check_policy_loss(train)
        if train.get("anytime"):
            require(train.lr_scheduler_type in TrainConfig.ANYTIME_SCHEDULES,
                    f"train.lr_scheduler_type={train.lr_scheduler_type} decays towards train.max_steps, so the curve's "
                    f"earlier points are not valid stopping points (train.anytime=true); choose one of: "
                    f"{', '.join(TrainConfig.ANYTIME_SCHEDULES)}")
        require(train.dynamic_sampling_max_draws >= 1,
                f"train.dynamic_sampling_max_draws={train.dynamic_sampling_max_draws} must be >= 1 (extra "
                f"generation rounds a step may draw; train.dynamic_sampling=false turns dynamic sampling off)")
        require_choice("train.precision", train.precision, PRECISIONS)
        require_choice("train.method", train.get("method", "grpo"), TrainConfig.METHODS)
        target = train.get("stop_at_accuracy")
        require(target is None or (math.isfinite(target) and 0 <= target <= 1),
                f"train.stop_at_accuracy={target!r} must be an accuracy in [0, 1], or null (train every step)")
        require_choice("train.loss_type", train.loss_type, TrainConfig.LOSS_TYPES)
        require_choice("train.scale_rewards", train.scale_rewards, TrainConfig.REWARD_SCALINGS)
        gen_batch, _ = generation_batch(train)
        if gen_batch % train.num_generations:
            divisors = [d for d in range(2, gen_batch + 1) if gen_batch % d == 0]
            processes = f" x {dist.world_size()} processes" if dist.is_distributed() else ""
            raise ConfigError(
                f"train.num_generations={train.num_generations} does not divide the generation batch of {gen_batch} "
                f"completions (train.per_device_train_batch_size x steps_per_generation{processes}); use one of "
                f"{', '.join(map(str, divisors))} or change the batch size")
        extra = OmegaConf.to_container(train.extra) if isinstance(train.extra, DictConfig) else dict(train.extra or {})
        # before TRL is imported: the old spelling of a key that is a train.* key now fails fast with its new one
        clash = sorted(set(extra) & {f.name for f in dataclasses.fields(TrainConfig)})
        require(not clash, "; ".join(f"train.extra.{k} is a train.* key: set train.{k}={_override_value(extra[k])} "
                                     f"instead of +train.extra.{k}" for k in clash))
        if extra:
            from trl import GRPOConfig

            known = {f.name for f in dataclasses.fields(GRPOConfig)}
            unknown = sorted(set(extra) - known)
            require(not unknown, f"train.extra has keys that GRPOConfig does not know: {', '.join(unknown)}")


def _finite_at_least_0(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _check_policy_loss(train: Any) -> None:
    """The clip range, the ratio's level and the entropy options: values TRL would take without complaint but that
    mean nothing (a negative clip, a share of tokens outside (0, 1]) fail here, before any model loads."""
    require(_finite_at_least_0(train.epsilon), f"train.epsilon={train.epsilon} must be a finite number >= 0 (the "
                                               f"ratio is clipped to [1 - epsilon, 1 + epsilon_high])")
    require(train.epsilon_high is None or _finite_at_least_0(train.epsilon_high),
            f"train.epsilon_high={train.epsilon_high} must be a finite number >= 0 (the upper clip is "
            f"1 + epsilon_high; DAPO's clip-higher uses 0.28) or null (train.epsilon's value)")
    require_choice("train.importance_sampling_level", train.importance_sampling_level,
                   TrainConfig.IMPORTANCE_SAMPLING_LEVELS)
    require(_finite_at_least_0(train.entropy_coef),
            f"train.entropy_coef={train.entropy_coef} must be a finite number >= 0 (the weight of the entropy bonus; "
            f"0 turns it off)")
    q = train.top_entropy_quantile
    require(isinstance(q, (int, float)) and 0 < q <= 1,
            f"train.top_entropy_quantile={q} must be in (0, 1] (the share of tokens, highest entropy first, that "
            f"carry policy gradient; 1 keeps every token, the paper's choice is 0.2)")


def _override_value(value: Any) -> str:
    """`value` as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def generation_batch(train: Any, world_size: int | None = None) -> tuple[int, int]:
    """(completions per generation round over all processes, per-device batches it feeds), as GRPOConfig
    derives them. The second is TRL's steps_per_generation: optimizer steps only when
    gradient_accumulation_steps is 1.

    `world_size`: the processes of a data-parallel run (default: as the launcher's environment says). As in
    TRL, per_device_train_batch_size is per process, so N processes train on N times its completions, and an
    explicit train.generation_batch_size is the round's total, split across them."""
    processes = dist.world_size() if world_size is None else world_size
    per_step = train.per_device_train_batch_size
    if train.generation_batch_size is not None and train.steps_per_generation is not None:
        raise ConfigError("set only one of train.generation_batch_size and train.steps_per_generation, not both")
    if train.generation_batch_size is not None:
        gen = train.generation_batch_size
        if processes > 1 and gen % (per_step * processes):
            fits = [m for m in range(per_step * processes, 4 * max(gen, per_step * processes) + 1,
                                     per_step * processes)][:3]
            raise ConfigError(f"{processes} processes do not divide the generation batch of {gen} completions "
                              f"(train.generation_batch_size) into per-process batches of "
                              f"train.per_device_train_batch_size={per_step}; use a multiple of {processes} x "
                              f"{per_step} (e.g. {', '.join(map(str, fits))}) or another number of processes")
        if gen % per_step:
            raise ConfigError(f"train.generation_batch_size={gen} must be a multiple of "
                              f"train.per_device_train_batch_size={per_step}")
        return gen, gen // (per_step * processes)
    spg = train.steps_per_generation or train.gradient_accumulation_steps
    return per_step * spg * processes, spg
