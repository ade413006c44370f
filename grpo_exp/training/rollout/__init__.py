"""grpo-exp's own rollout (`speed.generation=engine`): GRPO's sampling without HF `generate`, one idea a module.

engine      the rollout copy of the policy, its static KV cache, compiled decoding step and sampling
importance  the importance weights pi_train / pi_sampler and the sampler's mismatch figures
old_logps   where PPO's old log-probs come from: the sampler's own, or the policy's scoring forward
trl_hook    how the engine is plugged into TRL's GRPOTrainer (rollout_func, and its vLLM correction path)

What callers use is re-exported here, so `rollout.X` keeps naming it.
"""

from grpo_exp.base.cpu import compiler_missing, native_dtype
from grpo_exp.training.rollout.engine import RolloutEngine, _cache_kwarg, model_unsupported_reason, rollout_copy
from grpo_exp.training.rollout.importance import (
    MISMATCH_TOTALS, is_weights, mismatch_from_totals, mismatch_metrics, mismatch_totals)
from grpo_exp.training.rollout.old_logps import padded_logps
from grpo_exp.training.rollout.trl_hook import build_engine, enable_is_correction, unsupported_reason

__all__ = ["MISMATCH_TOTALS", "RolloutEngine", "_cache_kwarg", "build_engine", "compiler_missing",
           "enable_is_correction", "is_weights", "mismatch_from_totals", "mismatch_metrics", "mismatch_totals",
           "model_unsupported_reason", "native_dtype", "padded_logps",
           "rollout_copy", "unsupported_reason"]
