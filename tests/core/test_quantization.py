"""INT8 copies for evaluation: Linear layers become int8 dynamic Linear, the tied LM head stays fp32,
the copy still generates, its size is counted from the packed weights, and the original is untouched."""

from __future__ import annotations

import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

from grpo_exp.base.errors import ConfigError
from grpo_exp.evaluation.generate import model_size_mb
from grpo_exp.core.quantization import quantize_for_eval, quantized_linear_count


def _linears(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, DynamicQuantizedLinear))}


def test_dynamic_int8_replaces_linears_and_leaves_the_original_alone(tiny_model):
    model, tokenizer = tiny_model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    linear_names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]

    qmodel = quantize_for_eval(model, "dynamic_int8")

    assert qmodel is not model
    layers = model.config.num_hidden_layers
    assert quantized_linear_count(qmodel) == 7 * layers  # q, k, v, o, gate, up, down per layer
    for name, module in _linears(qmodel).items():
        expected = torch.nn.Linear if name == "lm_head" else DynamicQuantizedLinear
        assert type(module) is expected, name
    # The LM head stays fp32 and tied to the embedding, in the copy as in the original.
    assert qmodel.lm_head.weight is qmodel.model.embed_tokens.weight
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # The original keeps its float Linear layers and exactly its weights.
    assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n in linear_names)
    assert quantized_linear_count(model) == 0
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_int8_copy_generates_and_is_smaller(tiny_model):
    model, tokenizer = tiny_model
    qmodel = quantize_for_eval(model, "dynamic_int8")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = qmodel.generate(**ids, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == ids["input_ids"].shape[1] + 5
    # int8 weights: 1 byte instead of 4 for every quantized Linear weight (Llama Linear layers have no bias).
    linear_bytes = sum(m.weight.numel() for n, m in model.named_modules()
                       if type(m) is torch.nn.Linear and n != "lm_head")
    assert model_size_mb(qmodel) == pytest.approx(model_size_mb(model) - 3 * linear_bytes / 2**20, rel=1e-3)


def test_none_is_the_model_itself_and_unknown_methods_fail(tiny_model):
    model, _ = tiny_model
    assert quantize_for_eval(model, "none") is model
    with pytest.raises(ConfigError, match="dynamic_int8"):
        quantize_for_eval(model, "int4")
