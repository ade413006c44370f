"""The speed config (`speed=auto|trl`, `speed.*`) and the one function that turns it into a frozen plan.

Every `auto` of the speed settings is resolved here, once per run, against the precision, the machine and the
settings that decide who can sample (peft, TRL's generation settings): `plan_for(cfg)` (`resolve`) returns a
`SpeedPlan` whose fields hold only concrete choices. training/plan_fit.fit then fits it, once, to the loaded model
(what the model rules out) before the trainer is built; the settings record (training/run_dir), speed_plan.json,
the trainer and the rollout engine all read that one plan, so what is recorded is what ran.
Speed changes how fast a run computes, never the GRPO recipe (train.*). `speed=trl` is plain TRL's path:
TRL's `generate`, sdpa attention, TRL's log-prob kernel, none of grpo-exp's kernels. `speed.generation=vllm` is
TRL's vLLM in colocate mode (one vLLM engine in each training process, on its GPU), which needs CUDA and the vllm
package: an explicit `vllm` without them fails here in one line, before any model loads. `auto` does not take it
(TRL's `generate` on CUDA) until its GPU test has passed (VLLM_AUTO below).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from grpo_exp.base import cpu
from grpo_exp.base.errors import ConfigError
from grpo_exp.config.rules import require, require_choice

GENERATIONS = ("auto", "trl", "engine", "vllm")
ATTENTIONS = ("auto", "sdpa", "grouped", "eager")
ATTENTION_DECODES = ("cache_axis", "last_axis")
LOGPROB_KERNELS = ("auto", "trl", "autocast")
ROLLOUT_DTYPES = ("auto", "autocast", "bf16", "fp32")
ROLLOUT_SAMPLERS = ("cdf", "multinomial")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
OLD_LOGPS = ("auto", "policy", "sampler")
TRISTATE = ("auto", True, False)
VLLM_MEMORY_TRL = 0.3  # TRL's default vllm_gpu_memory_utilization (GRPOConfig), for train.extra.use_vllm

# the speed switches that were train.* keys: an override of one of them fails naming its new key
MOVED = {
    "rollout": "speed.generation", "attention": "speed.attention", "attention_decode": "speed.attention_decode",
    "logprob_kernel": "speed.logprob_kernel", "rollout_dtype": "speed.rollout_dtype",
    "rollout_compile": "speed.rollout_compile", "rollout_sampler": "speed.rollout_sampler",
    "rollout_is_correction": "speed.is_correction", "rollout_is_mode": "speed.is_mode",
    "rollout_is_cap": "speed.is_cap", "rollout_old_logps": "speed.old_logps",
    # the five that compute the same numbers by other means are one switch now
    "shared_prefix": "speed.exact_shortcuts", "saved_tensors": "speed.exact_shortcuts",
    "rollout_prepack": "speed.exact_shortcuts", "rollout_scoring": "speed.exact_shortcuts",
    "lean_reference": "speed.exact_shortcuts",
}


def _choice(key: str, value: Any, choices: tuple) -> None:
    if choices != TRISTATE:
        require_choice(f"speed.{key}", value, choices)
        return
    # 1 == True in Python: a tri-state takes "auto" or a real bool, nothing else
    require(value == "auto" or isinstance(value, bool),
            f"speed.{key}={value!r} is not valid; choose one of: auto, true, false")


@dataclass
class SpeedConfig:
    """How a run computes (conf/speed/): which sampler, attention and kernels, never what it trains."""

    name: str = "auto"
    # who samples the completions: engine (training/rollout: a rollout copy of the policy, static KV cache, compiled
    # decoding step), trl (TRL's `generate`), vllm (TRL's vLLM, colocated: CUDA and the vllm package), auto (the
    # engine on a CPU, trl on CUDA; vllm once its GPU test has passed: VLLM_AUTO)
    generation: str = "auto"
    # the trained policy's attention: grouped (kernels/attention.py), sdpa or eager (transformers'), auto (grouped
    # on a CPU, sdpa on CUDA)
    attention: str = "auto"
    # how grouped attention lays out a decoding step's scores: cache_axis, or last_axis (other bf16 rounding)
    attention_decode: str = "cache_axis"
    # the LM head's log-probs in the shared-prefix scoring: autocast (kernels/logprob_head.py), trl (TRL's
    # chunked kernel), auto (autocast on a CPU, trl on CUDA)
    logprob_kernel: str = "auto"
    # the engine's copy of the policy: bf16, fp32, autocast (bf16 Linear weights under bf16 autocast), auto
    # (bf16 where the hardware computes it natively, else fp32)
    rollout_dtype: str = "auto"
    # torch.compile the engine's decoding step: auto (where a C++ compiler is), true, false
    rollout_compile: Any = "auto"
    # cdf: one uniform number per row; multinomial: generate's draws (the same tokens under the same seed)
    rollout_sampler: str = "cdf"
    # PPO's old log-probs on the engine's path: policy (a scoring forward, with the correction below), sampler
    # (the copy's own, no forward, no correction), auto (sampler where the copy computes what the policy does)
    old_logps: str = "auto"
    # weigh each token's loss by pi_train / pi_sampler (TRL's vLLM correction), capped at is_cap
    is_correction: bool = True
    is_mode: str = "token_truncate"
    is_cap: float = 3.0
    # Shortcuts that compute the same numbers by other means (tests hold each): each distinct prompt scored once
    # (training/shared_prefix.py), lean saved tensors under bf16 (kernels/lean_saved.py), packed rollout weights
    # (kernels/packed_linear.py), old log-probs from each batch's own training forward, a bf16 KL reference
    # (kernels/lean_reference.py), the tied embedding's gradient as rows (kernels/embedding_grad.py). false: TRL's
    # own way for all six.
    exact_shortcuts: bool = True
    # speed.generation=vllm: the share of each GPU's memory vLLM's colocated engine takes (its weights and KV cache;
    # TRL's vllm_gpu_memory_utilization). TRL's default, 0.3, leaves the rest to training
    vllm_memory: float = 0.3

    @staticmethod
    def check(speed: Any) -> None:
        _choice("generation", speed.generation, GENERATIONS)
        _choice("attention", speed.attention, ATTENTIONS)
        _choice("attention_decode", speed.attention_decode, ATTENTION_DECODES)
        _choice("logprob_kernel", speed.logprob_kernel, LOGPROB_KERNELS)
        _choice("rollout_dtype", speed.rollout_dtype, ROLLOUT_DTYPES)
        _choice("rollout_compile", speed.rollout_compile, TRISTATE)
        _choice("rollout_sampler", speed.rollout_sampler, ROLLOUT_SAMPLERS)
        _choice("old_logps", speed.old_logps, OLD_LOGPS)
        _choice("is_mode", speed.is_mode, IS_MODES)
        require(math.isfinite(speed.is_cap) and speed.is_cap >= 1,
                 f"speed.is_cap={speed.is_cap} must be a finite number >= 1 (the largest weight pi_train / pi_sampler "
                 f"a token or sequence keeps)")
        require(0 < speed.vllm_memory < 1, f"speed.vllm_memory={speed.vllm_memory} must be a share of the GPU's memory "
                                           f"between 0 and 1 (vLLM's weights and KV cache; training needs the rest)")


@dataclass(frozen=True)
class SpeedPlan:
    """Every speed choice of a run, resolved: no field holds `auto`."""

    precision: str  # bf16 | fp32: what training computes in
    device: str  # cpu | cuda
    generation: str  # engine | trl | vllm
    attention: str  # grouped | sdpa | eager
    attention_decode: str
    logprob_kernel: str  # autocast | trl
    shared_prefix: bool
    saved_tensors: str  # lean | plain
    lean_reference: bool
    embedding_grad: bool  # the tied input embedding's gradient as the rows its tokens touch
    scoring: str  # batch | round: where the engine's old log-probs of a round's batches come from
    # the engine's, None on TRL's path
    rollout_dtype: str | None
    rollout_compile: bool
    rollout_prepack: bool
    rollout_sampler: str
    old_logps: str | None  # policy | sampler
    is_correction: bool
    is_mode: str
    is_cap: float
    vllm_memory: float | None = None  # vLLM's share of each GPU's memory; None off vLLM (recorded runs predate it)

    def record(self) -> dict[str, Any]:
        """The plan as flat `speed.<field>` keys (the settings record and speed_plan.json)."""
        return {f"speed.{k}": v for k, v in dataclasses.asdict(self).items()}

    def summary(self) -> str:
        """The plan in a few words, for the one line a run starts with (speed_plan.json holds it whole)."""
        who = {"engine": f"rollout engine ({self.rollout_dtype} copy{', compiled' if self.rollout_compile else ''})",
               "trl": "TRL's generate", "vllm": "TRL's vLLM"}[self.generation]
        return f"{self.precision} on {self.device}, sampling with {who}"

    def weight_dtype(self):
        """The torch dtype of the rollout copy's Linear weights: fp32 for the fp32 copy, else bf16."""
        import torch

        return torch.float32 if self.rollout_dtype == "fp32" else torch.bfloat16


def vllm_installed() -> bool:
    """Whether the vllm package can be imported here (found, not imported: importing it starts CUDA work)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_missing(device: str) -> str | None:
    """Why TRL's colocated vLLM cannot sample on this machine (`device`: cuda or cpu), or None where it can."""
    if device != "cuda":
        return "this machine has no CUDA device"
    if not vllm_installed():
        return "the vllm package is not installed (pip install 'grpo-exp[vllm]')"
    return None


def check_generation(generation: str, device: str | None = None) -> None:
    """One line, before any model loads, for speed.generation=vllm on a machine without CUDA or vllm."""
    if generation != "vllm":
        return
    why = vllm_missing(device or _device())
    if why:
        runnable = [g for g in GENERATIONS if g != "vllm"]  # the choices that run on this machine
        raise ConfigError(f"speed.generation=vllm needs CUDA and the vllm package; {why}; choose one of: "
                          f"{', '.join(runnable)}")


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# Whether speed.generation=auto may pick TRL's colocated vLLM on CUDA: only once its GPU test
# (tests/training/test_vllm.py, `pytest -m gpu`) has passed on a GPU, recorded with where and when in
# docs/scale-out.md ("vLLM on a GPU"). Until then auto keeps TRL's generate there, and vllm is an explicit choice.
VLLM_AUTO = False

# The attention head widths every vLLM attention backend serves (its paged-attention kernels' list; FlashAttention
# serves more): speed.generation=vllm on a model with another width is refused before the model loads.
VLLM_HEAD_WIDTHS = (32, 64, 80, 96, 112, 120, 128, 192, 256)


def auto_generation(device: str) -> str:
    """What speed.generation=auto samples with: the engine on a CPU; on CUDA TRL's generate (TRL's vLLM once
    VLLM_AUTO says its GPU test passed, where vllm is installed)."""
    if device != "cuda":
        return "engine"
    return "vllm" if VLLM_AUTO and vllm_missing(device) is None else "trl"


def check_vllm_head(head_width: int | None, model_name: str) -> None:
    """One line for speed.generation=vllm on a model whose attention heads vLLM's backends do not all serve."""
    if head_width is not None and head_width not in VLLM_HEAD_WIDTHS:
        widths = ", ".join(map(str, VLLM_HEAD_WIDTHS))
        raise ConfigError(f"speed.generation=vllm: model {model_name} has {head_width}-wide attention heads, which "
                          f"vLLM's attention backends do not all serve (widths {widths}); choose "
                          f"speed.generation=trl or engine")


def copy_kind(rollout_dtype: str, native: str) -> str:
    """The rollout copy `speed.rollout_dtype` asks for. auto: the machine's native dtype (`native`: bf16 where the
    hardware computes it natively, else fp32), whatever precision training runs in. The autocast copy is faster
    under bf16 training (its log-probs replace TRL's scoring forward) but is not auto's choice: in its seeds check
    one of the default run's seeds collapsed (docs/log.md)."""
    if rollout_dtype != "auto":
        return rollout_dtype
    return "bf16" if native == "bf16" else "fp32"


def old_logps_source(choice: str, kind: str, precision: str) -> str:
    """Where PPO's old log-probs come from on the engine's path: auto takes the sampler's own where the copy
    computes what the policy computes (an fp32 copy under fp32 training, an autocast copy under bf16), else a
    scoring forward of the policy with the importance-sampling correction."""
    if choice != "auto":
        return choice
    return "sampler" if (kind, precision) in {("fp32", "fp32"), ("autocast", "bf16")} else "policy"


def _prepack(kind: str, device: str, shortcuts: bool) -> bool:
    """Packed Linear weights in the rollout copy, where the machine supports them (kernels/packed_linear.py)."""
    if not shortcuts or device != "cpu":
        return False
    import torch

    from grpo_exp.kernels import packed_linear

    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    return packed_linear.unsupported_reason(dtype, torch.device("cpu")) is None


def trl_setting(train: Any, key: str, default: Any = None) -> Any:
    """A GRPOConfig setting as the run gives it: train.extra.<key> over train.<key> (training/trainer.grpo_config
    applies train.extra last)."""
    extra = getattr(train, "extra", None) or {}
    return extra[key] if key in extra else getattr(train, key, default)


def engine_declined(train: Any, peft: str = "none") -> str | None:
    """Why the rollout engine cannot sample for a run of these settings (None when it can), as far as the config
    says; what the loaded model rules out is training/plan_fit's."""
    if peft != "none":
        return "a PEFT model (the rollout copy would need the adapter merged)"
    if trl_setting(train, "use_vllm") or trl_setting(train, "use_transformers_continuous_batching"):
        return "use_vllm or continuous batching (another generation backend)"
    penalty = trl_setting(train, "repetition_penalty", 1.0)
    if penalty != 1.0:
        return f"repetition_penalty={penalty}"
    if trl_setting(train, "min_p") is not None:
        return f"min_p={trl_setting(train, 'min_p')}"
    unhonoured = set(trl_setting(train, "generation_kwargs") or {}) - {"min_new_tokens"}  # the one it honours
    if unhonoured:
        return f"generation_kwargs {sorted(unhonoured)}"
    return None


def plan_for(cfg: Any, device: str | None = None) -> SpeedPlan:
    """The plan of a run's config (cfg.speed for cfg.train and cfg.peft) on this machine."""
    peft = getattr(getattr(cfg, "peft", None), "name", None) or "none"
    return resolve(cfg.speed, cfg.train, device=device, peft=peft)


def resolve(speed: Any, train: Any, device: str | None = None, available: bool = True,
            peft: str = "none") -> SpeedPlan:
    """The plan of `speed` (the speed node) for training `train` (train.precision, gradient_checkpointing, the
    generation settings) with `peft` (peft.name) on this machine (`device`: cuda where torch sees one, else cpu).
    `available=False` describes a run made elsewhere (grpo-export-trl): an explicit vllm is planned even where this
    machine could not run it."""
    device = device or _device()
    if available:
        check_generation(speed.generation, device)
    precision = cpu.resolve_precision(train.precision)
    checkpointing = bool(train.gradient_checkpointing)
    shortcuts = bool(speed.exact_shortcuts)
    generation = speed.generation if speed.generation != "auto" else auto_generation(device)
    vllm_memory = float(speed.vllm_memory) if generation == "vllm" else None
    if trl_setting(train, "use_vllm") and generation != "vllm":
        # train.extra.use_vllm (vLLM's server mode, say): TRL's vLLM samples, not the engine or generate
        generation, vllm_memory = "vllm", float(trl_setting(train, "vllm_gpu_memory_utilization", VLLM_MEMORY_TRL))
    elif generation == "engine" and engine_declined(train, peft):
        generation = "trl"  # training/plan_fit logs why
    engine = generation == "engine"
    # the copy's auto dtype is the machine's, not the training's: an fp32 run on a bf16 machine samples from bf16
    kind = copy_kind(speed.rollout_dtype, cpu.resolve_precision("auto")) if engine else None
    if speed.rollout_compile == "auto":
        compile_step = engine and (device != "cpu" or cpu.compiler_missing() is None)
    else:
        compile_step = engine and bool(speed.rollout_compile)
    return SpeedPlan(
        precision=precision, device=device, generation=generation,
        attention=speed.attention if speed.attention != "auto" else ("sdpa" if device == "cuda" else "grouped"),
        attention_decode=speed.attention_decode,
        logprob_kernel=(speed.logprob_kernel if speed.logprob_kernel != "auto"
                        else ("trl" if device == "cuda" else "autocast")),
        shared_prefix=shortcuts and not checkpointing,
        saved_tensors="lean" if shortcuts and precision == "bf16" and not checkpointing else "plain",
        lean_reference=shortcuts, embedding_grad=shortcuts, scoring="batch" if shortcuts else "round",
        rollout_dtype=kind, rollout_compile=compile_step,
        rollout_prepack=engine and _prepack(kind, device, shortcuts),
        rollout_sampler=speed.rollout_sampler,
        old_logps=old_logps_source(speed.old_logps, kind, precision) if engine else None,
        is_correction=bool(speed.is_correction), is_mode=speed.is_mode, is_cap=float(speed.is_cap),
        vllm_memory=vllm_memory)


def check_moved(overrides: list[str]) -> None:
    """One line for an override that names a speed switch by its old train.* key."""
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0]
        moved = MOVED.get(key.removeprefix("train.")) if key.startswith("train.") else None
        if moved:
            raise ConfigError(f"{key} has moved: set {moved} instead (speed=trl is plain TRL's path; "
                              f"docs/performance.md, 'Speed switches')")
