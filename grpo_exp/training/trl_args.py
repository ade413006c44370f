"""TRL's and peft's argument objects built from the config in the entrypoint's pre-check, before any model
loads or the run directory is written: their own value checks (an unknown `lr_scheduler_type`, `optim` or
`report_to`, a LoRA setting peft refuses) then fail in one line naming the key the user set, rather than in a
traceback after the model has loaded."""

from __future__ import annotations

import tempfile

from omegaconf import OmegaConf

from grpo_exp.base.errors import ConfigError
from grpo_exp.base.text import one_line


def check(cfg) -> None:
    """Build GRPOConfig (and LoraConfig with peft=lora) the way the trainer will; ConfigError on refusal."""
    from grpo_exp.config.speed import resolve
    from grpo_exp.training import lora
    from grpo_exp.training.trainer import grpo_config

    plan = resolve(cfg.speed, cfg.train, peft=cfg.peft.name)
    weights = list(cfg.reward.weights) if cfg.reward.get("weights") else [1.0] * len(cfg.reward.funcs)
    with tempfile.TemporaryDirectory(prefix="grpo-exp-args-check-") as scratch:  # nothing is written there
        try:
            grpo_config(cfg.train, scratch, weights, [], plan)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{_named(cfg.train, 'train', err)}: {one_line(err, 400)}") from None
    if lora.enabled(cfg):
        try:
            lora.lora_config(cfg.peft)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{_named(cfg.peft, 'peft', err)}: {one_line(err, 400)}") from None


def _named(node, prefix: str, err: BaseException) -> str:
    """The setting TRL refused, as the user wrote it: the key whose value the message quotes (train.extra's
    keys included), or the group when none is quoted."""
    values = OmegaConf.to_container(node, resolve=True)
    extra = values.pop("extra", None) or {}
    flat = {f"{prefix}.{k}": v for k, v in values.items()}
    flat.update({f"{prefix}.extra.{k}": v for k, v in extra.items()})
    text = str(err)
    quoted = [(k, v) for k, v in flat.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)
              and str(v) and str(v) in text]
    named = [(k, v) for k, v in quoted if k.rsplit(".", 1)[-1] in text] or quoted
    if not named:
        return f"{prefix}.*"
    key, value = max(named, key=lambda kv: len(str(kv[1])))
    return f"{key}={value}"
