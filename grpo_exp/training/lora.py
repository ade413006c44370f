"""LoRA through peft (`peft=lora`): wrap the policy in trainable low-rank adapters, save the adapter and the
merged model, and continue an adapter run in a later stage.

A LoRA run's directory holds `adapter/` (the adapter alone, with the tokenizer and the peft settings it was
trained with) and `model/` (the adapter merged into the base weights: an ordinary model directory that
`AutoModelForCausalLM.from_pretrained`, evaluation and the curriculum's accuracy matrix load as they load a
fully fine-tuned one). Intermediate checkpoints hold the adapter only (HF Trainer's own PEFT checkpoints),
and resume loads it back.

`init_from` a LoRA run with `peft=lora` continues that run's adapter on the base it was trained on (as its
adapter_config.json records it): its EWC state covers exactly those adapter parameters, so the penalty stays
meaningful. (A fresh adapter on the merged model would start from random A matrices that the old Fisher and
anchor know nothing about.) For a fresh adapter on a merged model, use `model=custom model.id=<run>/model`
instead of init_from.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from grpo_exp.base import log
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import publish_dir, save_model_dir
from grpo_exp.base.run_files import PEFT_SETTINGS_FILE  # the peft.* settings and model the adapter was trained with

logger = log.get_logger(__name__)

ADAPTER_DIR = "adapter"
ADAPTER = "default"  # peft's name for the adapter being trained (TRL adds a frozen "ref" copy when beta > 0)
# what must match for a later stage to continue an adapter: the adapter's shape and where it applies
_CONTINUE_KEYS = ("r", "alpha", "target_modules")


def enabled(cfg) -> bool:
    return cfg.peft.name == "lora"


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def adapter_of(run_dir: Path) -> Path | None:
    """`<run dir>/adapter/` when that run trained a LoRA adapter, else None."""
    path = Path(run_dir) / ADAPTER_DIR
    return path if (path / "adapter_config.json").is_file() else None


def _settings(cfg) -> dict[str, Any]:
    peft = OmegaConf.to_container(cfg.peft, resolve=True)
    return {"model": cfg.model.name, **{k: peft[k] for k in ("name", "r", "alpha", "dropout", "target_modules")}}


def check_init(cfg, init: tuple[Path, Path] | None) -> Path | None:
    """One-line errors for an init_from this stage cannot continue, without loading a model. Returns the
    adapter directory this stage continues (peft=lora and init_from trained one), else None."""
    if not init:
        return None
    adapter = adapter_of(init[1])
    lam = cfg.ewc["lambda"]
    if adapter is not None and not enabled(cfg) and lam > 0:
        raise ConfigError(f"init_from={cfg.init_from} trained a LoRA adapter and its EWC state covers only the "
                          f"adapter's parameters, which a full fine-tuning stage does not have; continue with "
                          f"peft=lora, or with ewc.lambda=0")
    if adapter is None and enabled(cfg) and lam > 0:
        raise ConfigError(f"init_from={cfg.init_from} was fully fine-tuned and its EWC state covers the base "
                          f"weights, which peft=lora freezes; continue with peft=none, or with ewc.lambda=0")
    if adapter is None or not enabled(cfg):
        return None  # peft=none from a LoRA run trains the merged model/ in full; no adapter continues
    recorded_path = adapter / PEFT_SETTINGS_FILE
    recorded = json.loads(recorded_path.read_text()) if recorded_path.is_file() else {}
    now = _settings(cfg)
    differ = [f"{k} ({recorded[k]!r} -> {now[k]!r})" for k in ("model", *_CONTINUE_KEYS)
              if k in recorded and recorded[k] != now[k]]
    if differ:
        raise ConfigError(f"init_from={cfg.init_from} holds a LoRA adapter this stage cannot continue: "
                          f"{'; '.join(differ)}; use that run's model and peft settings, or start a fresh adapter "
                          f"from its merged model with model=custom model.id={init[0]}")
    return adapter


def lora_config(peft_cfg):
    from peft import LoraConfig

    targets = peft_cfg.target_modules
    targets = targets if isinstance(targets, str) else list(targets)
    return LoraConfig(r=int(peft_cfg.r), lora_alpha=float(peft_cfg.alpha), lora_dropout=float(peft_cfg.dropout),
                      target_modules=targets, bias="none", task_type="CAUSAL_LM")


def wrap(model, peft_cfg, continue_from: Path | None = None):
    """The policy with a trainable adapter: a fresh one (B = 0, so the wrapped model computes exactly what the
    base does) or the one in `continue_from`. Every base weight is frozen."""
    from peft import LoraConfig, PeftModel, get_peft_model

    with warnings.catch_warnings():
        # peft calls transformers' deprecated is_gradient_checkpointing; nothing for a user to act on
        warnings.simplefilter("ignore", FutureWarning)
        if continue_from is None:
            wrapped = get_peft_model(model, lora_config(peft_cfg), adapter_name=ADAPTER)
        else:
            # the saved shape and targets (checked against peft.* by check_init); this stage's dropout
            config = LoraConfig.from_pretrained(str(continue_from))
            config.lora_dropout = float(peft_cfg.dropout)
            wrapped = PeftModel.from_pretrained(model, str(continue_from), adapter_name=ADAPTER, is_trainable=True,
                                                config=config)
    counts = parameter_counts(wrapped)
    logger.info("peft=lora: %s adapter (r=%s, alpha=%s) on %s; %d of %d parameters train (%.2f%%)",
                "continuing the" if continue_from else "a fresh", wrapped.peft_config[ADAPTER].r,
                wrapped.peft_config[ADAPTER].lora_alpha, peft_cfg.target_modules, counts["trainable_params"],
                counts["total_params"], 100 * counts["trainable_params"] / counts["total_params"])
    return wrapped


def load_base(cfg, adapter: Path):
    """(model, tokenizer) an adapter continues on: the base it was trained on, as its adapter_config.json
    records it. A local directory (a converted or tiny model in the cache, or the model/ of a fully fine-tuned
    run the adapter started from) is loaded from there; otherwise (a hub id) the `model` option loads it,
    which must then be that base: an adapter means nothing on other weights."""
    from grpo_exp.core import models

    trained_on = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if trained_on and Path(str(trained_on)).expanduser().is_dir():
        model, tokenizer = models.load_pretrained(Path(str(trained_on)).expanduser())
        return model, models.prepare_tokenizer(tokenizer)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed)
    here = getattr(model, "name_or_path", None)
    if trained_on and str(here) != str(trained_on):
        raise ConfigError(f"the LoRA adapter in {adapter} was trained on {trained_on}, which is not here, and "
                          f"this stage's base model is {here}; continue where that base is, or start a fresh "
                          f"adapter from the run's merged model with model=custom model.id={adapter.parent / 'model'}")
    return model, tokenizer


def parameter_counts(model) -> dict[str, int]:
    params = list(model.parameters())  # tied weights appear once
    return {"trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "total_params": sum(p.numel() for p in params)}


def save_adapter(model, tokenizer, target: Path, cfg) -> Path:
    """The trained adapter alone (TRL's frozen "ref" copy left out), its tokenizer and peft settings, published
    atomically like model/."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, selected_adapters=[ADAPTER])
        tokenizer.save_pretrained(tmp)
        (tmp / PEFT_SETTINGS_FILE).write_text(json.dumps(_settings(cfg), indent=2) + "\n")
        publish_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def merge_and_save(model, tokenizer, target: Path) -> torch.nn.Module:
    """Merge the adapter into the base weights and save the result as an ordinary model directory.

    The merge is in place (W <- W + alpha/r B A): it comes after the adapter is saved and the Fisher is
    estimated, when nothing trains the adapter any more, and a merged copy would hold the whole model twice.
    Returns the merged plain model (the wrapper must not be used afterwards)."""
    merged = model.merge_and_unload(adapter_names=[ADAPTER])
    save_model_dir(merged, tokenizer, target)
    return merged
