"""EWC is real: the Fisher matches a brute-force computation, the penalty and its gradient are
exact, gradient accumulation does not change it, and a large lambda really holds parameters back."""

from __future__ import annotations

import re

import pytest
import torch

from grpo_exp.training import ewc
from tests.conftest import compose_cfg


def _sequences(tokenizer, model, temperature=1.0):
    prompts = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(1, 2), (30, 4), (7, 75)]]
    return ewc.sample_sequences(model, tokenizer, prompts, max_new_tokens=6, temperature=temperature, batch_size=2,
                                seed=3)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fisher_matches_brute_force(tiny_model, temperature):
    """At T != 1 the samples come from pi_T, and the gradient is of log pi_T (logits / T): one distribution."""
    model, tokenizer = tiny_model
    sequences = _sequences(tokenizer, model, temperature)
    fisher = ewc.fisher_from_sequences(model, sequences, include_embeddings=True, progress=False,
                                       temperature=temperature)

    # Brute force, independently: log-softmax by hand, torch.autograd.grad per sequence.
    params = dict(model.named_parameters())
    expected = {name: torch.zeros_like(p) for name, p in params.items()}
    for ids, prompt_len in sequences:
        logits = model(input_ids=ids).logits[0]
        logp = 0.0
        for t in range(prompt_len, ids.shape[1]):
            logp = logp + (logits[t - 1] / temperature).log_softmax(-1)[ids[0, t]]
        grads = torch.autograd.grad(logp, list(params.values()), allow_unused=True)
        for (name, _), g in zip(params.items(), grads):
            if g is not None:
                expected[name] += g ** 2
    for name in fisher:
        torch.testing.assert_close(fisher[name], expected[name] / len(sequences), rtol=1e-4, atol=1e-10)

    values = torch.cat([f.flatten() for f in fisher.values()])
    assert (values >= 0).all() and values.std() > 0 and values.max() > 0
    if temperature != 1.0:  # the untempered gradient is a different quantity: the test can tell them apart
        untempered = ewc.fisher_from_sequences(model, sequences, include_embeddings=True, progress=False)
        assert any(not torch.allclose(untempered[n], fisher[n], rtol=1e-3) for n in fisher)


def test_estimate_differentiates_at_the_sampling_temperature(tiny_model, monkeypatch):
    """ewc.estimate passes its temperature to both the sampler and the gradient."""
    model, tokenizer = tiny_model
    seen = {}
    real = ewc.fisher_sums

    def spy(model, sequences, include_embeddings=False, progress=True, temperature=1.0):
        seen["temperature"] = temperature
        return real(model, sequences, include_embeddings, progress=False, temperature=temperature)

    monkeypatch.setattr(ewc, "fisher_sums", spy)
    prompts = [[{"role": "user", "content": "What is 1 + 2?"}]]
    ewc.estimate(model, tokenizer, prompts, samples=2, max_new_tokens=4, temperature=0.7, batch_size=2, seed=0,
                 include_embeddings=False)
    assert seen["temperature"] == 0.7


def test_the_shards_of_a_data_parallel_run_sample_what_one_process_samples(tiny_model):
    """Process i of n samples the batches i, i + n, ...; each batch is seeded by its position, so the shards
    together are the one-process sample (tests/training/test_ddp.py checks the all-reduced Fisher)."""
    model, tokenizer = tiny_model
    prompts = [[{"role": "user", "content": f"What is {i} + 2?"}] for i in range(5)]
    kwargs = dict(max_new_tokens=4, temperature=1.0, batch_size=2, seed=3)
    whole = ewc.sample_sequences(model, tokenizer, prompts, **kwargs)
    shards = [ewc.sample_sequences(model, tokenizer, prompts, shard=(i, 2), **kwargs) for i in range(2)]
    # batches [0, 1] and [4] on process 0, [2, 3] on process 1
    regathered = [*shards[0][:2], *shards[1], *shards[0][2:]]
    assert len(regathered) == len(whole) == 5
    for (ids, plen), (want, want_len) in zip(regathered, whole):
        assert plen == want_len and torch.equal(ids, want)


def test_embeddings_can_be_left_out(tiny_model):
    model, _ = tiny_model
    names = ewc.fisher_parameters(model, include_embeddings=False)
    assert names and not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert any("embed_tokens" in n for n in ewc.fisher_parameters(model, include_embeddings=True))


def _state_for(model, scale=1.0):
    fisher = {n: torch.rand_like(p.detach()) * scale for n, p in ewc.fisher_parameters(model, False).items()}
    return ewc.EwcState(fisher, ewc.current_parameters(model, fisher.keys()), ["basic"])


def test_penalty_is_zero_at_anchor_and_its_gradient_is_exact(tiny_model):
    model, _ = tiny_model
    state = _state_for(model)
    lam = 7.0
    penalty = ewc.EwcPenalty(state, lam)
    assert float(penalty(model).detach()) == 0.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in state.fisher:
                p.add_(torch.randn_like(p) * 0.01)
    try:
        model.zero_grad()
        value = penalty(model)
        value.backward()
        params = dict(model.named_parameters())
        for name, f in state.fisher.items():
            expected = lam * f * (params[name].detach() - state.anchor[name])
            torch.testing.assert_close(params[name].grad, expected, rtol=1e-5, atol=1e-8)
        manual = sum((f * (params[n].detach() - state.anchor[n]) ** 2).sum() for n, f in state.fisher.items())
        torch.testing.assert_close(value.detach(), 0.5 * lam * manual)
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in state.anchor:
                    p.copy_(state.anchor[name])
        model.zero_grad()


def test_online_consolidation_and_save_load(tmp_path, tiny_model):
    model, _ = tiny_model
    first = _state_for(model)
    second_fisher = {n: torch.ones_like(f) for n, f in first.fisher.items()}
    merged = first.consolidate(second_fisher, first.anchor, gamma=0.5, stage="intermediate")
    name = next(iter(first.fisher))
    torch.testing.assert_close(merged.fisher[name], 0.5 * first.fisher[name] + 1.0)
    assert merged.stages == ["basic", "intermediate"]
    merged.save(tmp_path)
    loaded = ewc.EwcState.load(tmp_path)
    torch.testing.assert_close(loaded.fisher[name], merged.fisher[name])
    assert loaded.stages == merged.stages


def test_online_ewc_keeps_an_entry_the_new_fisher_lacks():
    old = ewc.EwcState({"a": torch.full((2,), 4.0), "b": torch.full((2,), 2.0)},
                       {"a": torch.zeros(2), "b": torch.ones(2)}, ["basic"])
    new = old.consolidate({"a": torch.full((2,), 1.0)}, {"a": torch.full((2,), 5.0)}, gamma=0.5, stage="intermediate")
    assert torch.equal(new.fisher["a"], torch.full((2,), 3.0)) and torch.equal(new.anchor["a"], torch.full((2,), 5.0))
    # "b" is not in the new estimate: its decayed Fisher and its old anchor stay
    assert torch.equal(new.fisher["b"], torch.full((2,), 1.0)) and torch.equal(new.anchor["b"], torch.ones(2))
    assert new.stages == ["basic", "intermediate"]


def test_non_finite_fisher_is_refused_and_names_the_tensor(tmp_path, tiny_model):
    model, _ = tiny_model
    state = _state_for(model)
    name = sorted(state.fisher)[0]
    state.fisher[name][0] = float("nan")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        state.save(tmp_path)
    assert not (tmp_path / ewc.FISHER_FILE).exists()


def test_missing_ewc_state_is_a_clear_error(tmp_path):
    from grpo_exp.base.errors import ConfigError

    with pytest.raises(ConfigError, match="fisher.safetensors"):
        ewc.EwcState.load(tmp_path)


def test_ewc_config_is_typed_under_its_literature_name(tmp_path):
    from grpo_exp.base.errors import ConfigError
    from grpo_exp.config.checks import validate

    cfg = compose_cfg(["ewc.lambda=5", "ewc.gamma=0.9"], tmp_path)
    assert cfg.ewc["lambda"] == 5.0 and cfg.ewc.gamma == 0.9 and cfg.ewc.fisher_samples == 32
    assert (cfg.ewc.fisher_norm, cfg.ewc.fisher) == ("mean", "sampled")
    with pytest.raises(Exception, match="lambdx"):  # unknown keys fail at composition
        compose_cfg(["ewc.lambdx=5"], tmp_path)
    with pytest.raises(Exception, match="abc"):  # so do values of the wrong type
        compose_cfg(["ewc.lambda=abc"], tmp_path)
    for bad, needle in (("ewc.lambda=-1", "ewc.lambda=-1.0 must be a finite number >= 0"),
                        ("ewc.gamma=1.5", "ewc.gamma=1.5 must be in [0, 1]"),
                        ("ewc.fisher_norm=sum", "ewc.fisher_norm='sum' is not valid; choose one of: mean, none"),
                        ("ewc.fisher=flat", "ewc.fisher='flat' is not valid; choose one of: sampled, uniform")):
        with pytest.raises(ConfigError, match=re.escape(needle)):
            validate(compose_cfg([bad], tmp_path))
