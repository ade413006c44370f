"""Model options load as plain trainable models; the packaged GGUF is converted once and cached."""

from __future__ import annotations

import time

import pytest
import torch

from grpo_exp.core import models
from grpo_exp.base.errors import ConfigError
from tests.conftest import compose_cfg


def test_default_model_loads_from_the_package_and_generates(tmp_path):
    cfg = compose_cfg([], tmp_path)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir)
    assert getattr(model, "hf_quantizer", None) is None  # trainable, not a GGUF-quantized wrapper
    assert next(model.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) > 100e6
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(text.strip()) > 0
    # The converted directory is reused: a second resolution does no conversion.
    start = time.perf_counter()
    again = models.model_dir(cfg.model, cfg.paths.cache_dir)
    assert time.perf_counter() - start < 2 and (models.Path(again) / "model.safetensors").exists()


def test_tiny_random_is_small_and_seeded(tmp_path):
    cfg = compose_cfg(["model=tiny_random"], tmp_path)
    a, tok = models.load(cfg.model, cfg.paths.cache_dir, seed=1)
    b, _ = models.load(cfg.model, cfg.paths.cache_dir, seed=1)
    c, _ = models.load(cfg.model, cfg.paths.cache_dir, seed=2)
    assert sum(p.numel() for p in a.parameters()) < 5e6
    assert a.config.vocab_size == len(tok)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_missing_package_and_bad_paths_are_clear(tmp_path):
    cfg = compose_cfg(["model=custom", f"model.id={tmp_path}"], tmp_path)
    with pytest.raises(ConfigError, match="without config.json"):
        models.check_available(cfg.model, cfg.paths.cache_dir)
    with pytest.raises(ConfigError, match="not installed"):
        models.find_gguf("no_such_model_package_xyz", tmp_path)
