"""The `ewc` group's schema: elastic weight consolidation across stages (training/ewc.py), its fields and checks.

Its key `lambda` (the literature's name) is a Python keyword, so the dataclass is built from a field table."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from grpo_exp.config.rules import require, require_choice, require_positive


def _keyword_dataclass(name: str, doc: str, fields: dict[str, tuple[Any, Any]], check) -> type:
    """A dataclass whose field names may be Python keywords (`ewc.lambda`, the literature's name).

    dataclasses generates __init__/__repr__/__eq__ source that would not compile with a keyword, so
    those are off; OmegaConf reads only the fields, so typing and unknown-key errors still hold."""
    namespace = {"__doc__": doc, "__annotations__": {k: t for k, (t, _) in fields.items()},
                 **{k: default for k, (_, default) in fields.items()}, "check": staticmethod(check)}
    return dataclass(init=False, repr=False, eq=False)(type(name, (), namespace))


def _check_ewc(ewc: Any) -> None:
    for key in ("lambda", "gamma"):
        value = ewc[key]
        require(math.isfinite(value) and value >= 0, f"ewc.{key}={value!r} must be a finite number >= 0")
    require(ewc["gamma"] <= 1, f"ewc.gamma={ewc['gamma']!r} must be in [0, 1] (the decay of the old Fisher)")
    require_positive("ewc", ewc, "fisher_samples", "fisher_batch_size")
    require_choice("ewc.fisher_norm", ewc["fisher_norm"], EWC_FISHER_NORMS)
    require_choice("ewc.fisher", ewc["fisher"], EWC_FISHERS)


# mean: each stage's Fisher divided by its mean over the parameters it covers (mean 1, whatever the completion
# length and the model: lambda carries across them); none: the raw Fisher, the scale of runs before the option
EWC_FISHER_NORMS = ("mean", "none")
# sampled: the diagonal Fisher of the policy's own samples (EWC); uniform: every entry 1, an L2 pull to the
# previous stage's weights (Anchored Weight Decay, the ablation that shows whether the Fisher matters)
EWC_FISHERS = ("sampled", "uniform")


EwcConfig = _keyword_dataclass("EwcConfig", "Elastic weight consolidation across stages (training/ewc.py).", {
    "lambda": (float, 0.0),  # penalty strength; 0 = no EWC: no penalty and no Fisher estimate
    "gamma": (float, 1.0),  # online EWC decay of the old Fisher: F <- gamma * F_old + F_new
    "fisher_samples": (int, 32),  # sampled completions (one gradient each) per Fisher estimate
    "fisher_batch_size": (int, 8),  # prompts per sampling batch (gradients are still per sequence)
    "fisher_max_new_tokens": (Optional[int], None),  # None: the stage's train.max_completion_length
    # the tied embedding/LM head dominates parameter count; left out by default
    "include_embeddings": (bool, False),
    "fisher_norm": (str, "mean"),  # EWC_FISHER_NORMS; `none` reproduces runs from before the option
    "fisher": (str, "sampled"),  # EWC_FISHERS; `uniform` skips the Fisher estimate
}, _check_ewc)
