"""Lean saved tensors (kernels/lean_saved.py): the same log-probs and gradients, bit for bit, as autocast's own
forward and backward, with the weights' bf16 casts no longer held from the forward to the backward."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_exp.kernels import attention, lean_saved
from grpo_exp.training import shared_prefix


@pytest.fixture(scope="module")
def llama():
    """A small Llama whose Linear weights outweigh its activations on a short batch, tied head as SmolLM2's."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).train()
    attention.use(model, "grouped")
    return model


def batch(rows_per_prompt: int = 3, prompt_len: int = 5, completion_len: int = 6):
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (2, prompt_len), generator=gen).repeat_interleave(rows_per_prompt, 0)
    ids = torch.cat([prompts, torch.randint(0, 256, (prompts.size(0), completion_len), generator=gen)], 1)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0  # a shorter completion
    return ids, mask, completion_len


def shared_prefix_scoring(model, ids, mask, keep):
    return shared_prefix.completion_logps(model, ids, mask, keep, 0.7, True, "autocast")[0]


def shared_prefix_scoring_trl_head(model, ids, mask, keep):
    """With TRL's LM-head kernel, which speed.logprob_kernel=auto picks on CUDA."""
    return shared_prefix.completion_logps(model, ids, mask, keep, 0.7, True, "trl")[0]


def trl_path(model, ids, mask, keep):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -keep:, None]).squeeze(-1)


def forward_backward(model, score, lean: bool, device: str = "cpu"):
    model.zero_grad(set_to_none=True)
    ids, mask, keep = batch()
    ids, mask = ids.to(device), mask.to(device)
    with lean_saved.lean_forward(model) if lean else contextlib.nullcontext():
        with torch.autocast(device, dtype=torch.bfloat16):
            logps = score(model, ids, mask, keep)
    (logps * torch.linspace(-1, 1, logps.numel(), device=device).view_as(logps)).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("score", [shared_prefix_scoring, trl_path], ids=["shared_prefix", "trl_forward"])
def test_log_probs_and_gradients_equal_autocasts_bit_for_bit(llama, score):
    plain_logps, plain_grads = forward_backward(llama, score, lean=False)
    lean_logps, lean_grads = forward_backward(llama, score, lean=True)
    assert torch.equal(lean_logps, plain_logps)
    assert plain_grads.keys() == lean_grads.keys()
    for name, grad in plain_grads.items():
        assert grad.abs().sum() > 0, name  # every weight takes part
        assert torch.equal(lean_grads[name], grad), name
    assert all("forward" not in m.__dict__ for m in llama.modules())  # the Linear layers have their own forward back


@pytest.fixture(scope="module")
def llama_cuda(llama):
    return copy.deepcopy(llama).cuda()


@pytest.fixture
def deterministic_cuda(monkeypatch):
    """torch's deterministic CUDA kernels for one test. Without them index_select's backward (the shared prefix's
    cache gather) and sdpa's memory-efficient backward add with atomics, in an order that changes from run to run,
    and a bit-for-bit comparison would see that order instead of the hooks. torch refuses cuBLAS in that mode unless
    CUBLAS_WORKSPACE_CONFIG names a fixed workspace (it matters where streams share one; the test runs on one)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn", ["sdpa", "grouped"])  # speed.attention=auto's choice on CUDA, and on a CPU
@pytest.mark.parametrize("score", [shared_prefix_scoring, shared_prefix_scoring_trl_head, trl_path],
                         ids=["shared_prefix", "shared_prefix_trl_head", "trl_forward"])
def test_log_probs_and_gradients_equal_autocasts_bit_for_bit_on_cuda(llama_cuda, deterministic_cuda, score, attn):
    """The plan's saved tensors are lean under bf16 on CUDA too: the same check where CUDA's autocast, cuBLAS and
    kernels compute, the recast weights' products included."""
    assert attention.use(llama_cuda, attn)
    plain_logps, plain_grads = forward_backward(llama_cuda, score, lean=False, device="cuda")
    lean_logps, lean_grads = forward_backward(llama_cuda, score, lean=True, device="cuda")
    assert lean_logps.is_cuda and torch.equal(lean_logps, plain_logps)
    assert plain_grads.keys() == lean_grads.keys()
    for name, grad in plain_grads.items():
        assert grad.abs().sum() > 0, name  # every weight takes part
        assert torch.equal(lean_grads[name], grad), name
    assert all("forward" not in m.__dict__ for m in llama_cuda.modules())


def bytes_held_after_forward(model, lean: bool) -> int:
    """Net bytes the shared-prefix forward allocated and did not free: what it keeps for the backward."""
    ids, mask, keep = batch()
    context = lean_saved.lean_forward(model) if lean else contextlib.nullcontext()
    with context:  # measured before it ends: the casts must be gone after their last use, not only at its end
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logps = shared_prefix_scoring(model, ids, mask, keep)
    held = sum(event.self_cpu_memory_usage for event in prof.events())
    logps.sum().backward()  # the graph was usable
    model.zero_grad(set_to_none=True)
    return held


def test_the_forward_keeps_no_bf16_weights_and_no_output_it_can_compute_again(llama):
    linear_bytes = sum(m.weight.numel() * 2 for m in llama.model.layers.modules() if type(m) is torch.nn.Linear)
    # positions through the layers: the 2 distinct prompts once, then every row's completion
    ids, _, keep = batch()
    positions = 2 * (ids.size(1) - keep) + ids.size(0) * keep
    config, layers = llama.config, llama.config.num_hidden_layers
    recomputed = layers * positions * (2 * config.hidden_size * 4  # two RMSNorms' normed x, fp32
                                       + config.intermediate_size * 2)  # silu(gate), bf16
    plain, lean = bytes_held_after_forward(llama, False), bytes_held_after_forward(llama, True)
    assert plain > linear_bytes + recomputed  # the plain forward holds all of them, and the rest of its activations
    assert plain - lean >= 0.95 * (linear_bytes + recomputed), (plain, lean, linear_bytes, recomputed)


class TwoTied(torch.nn.Module):
    """Two Linear layers holding one weight, used in one pass: the cast must be shared, as autocast's cache
    shares it, or the two bf16 gradients would be summed in fp32 instead of bf16."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16, bias=False)
        self.b = torch.nn.Linear(16, 16, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("last_pass", [False, True])
def test_a_weight_two_layers_hold_is_cast_once_per_forward(last_pass):
    torch.manual_seed(0)
    model, x = TwoTied(), torch.randn(8, 16)
    grads = []
    for lean in (False, True):
        model.zero_grad(set_to_none=True)
        with lean_saved.lean_forward(model) if lean else contextlib.nullcontext(), \
                torch.autocast("cpu", dtype=torch.bfloat16), \
                lean_saved.last_pass() if last_pass else contextlib.nullcontext():
            y = model(x)
        (y.float() ** 2).sum().backward()
        grads.append(model.a.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


class CalledTwice(torch.nn.Module):
    """One Linear layer run twice per pass (as PEFT's DoRA runs its lora_B)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.a(torch.relu(self.a(x)))


def test_a_layer_run_twice_in_each_of_two_passes_shares_one_cast():
    """Two passes, the second marked last, as the shared-prefix scoring runs them: the cast must live until the
    second pass's second use, or that use would cast again and the gradients would be summed in another order."""
    torch.manual_seed(0)
    model, x1, x2 = CalledTwice(), torch.randn(4, 16), torch.randn(8, 16)
    grads = []
    for lean in (False, True):
        model.zero_grad(set_to_none=True)
        with lean_saved.lean_forward(model) if lean else contextlib.nullcontext(), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            first = model(x1)
            with lean_saved.last_pass():
                second = model(x2)
        ((first.float() ** 2).sum() + (second.float() ** 3).sum()).backward()
        grads.append(model.a.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_a_weight_changed_in_place_before_the_backward_is_an_error():
    """Autograd refuses a backward through a tensor modified since the forward; the hooks must refuse too."""
    model, x = CalledTwice(), torch.randn(4, 16)
    with lean_saved.lean_forward(model), torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    with torch.no_grad():
        model.a.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.float().sum().backward()


def test_outside_autocast_or_without_gradients_nothing_changes(llama):
    ids, mask, keep = batch()
    with torch.no_grad():
        expected = trl_path(llama, ids, mask, keep)
        with lean_saved.lean_forward(llama):
            assert torch.equal(trl_path(llama, ids, mask, keep), expected)
