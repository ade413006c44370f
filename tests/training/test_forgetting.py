"""The forgetting signal: the KL estimator against an exact computation, and its bad input."""

from __future__ import annotations

import pytest
import torch

from grpo_exp.base.errors import ConfigError
from grpo_exp.config.checks import validate
from grpo_exp.training.forgetting import ForgettingCallback, completion_logps, kl_from_reference, sample_reference
from tests.conftest import compose_cfg

QUESTIONS = [f"What is {a} + {b}?" for a in range(1, 9) for b in range(1, 9)]  # 64 prompts


def _reference(model, tokenizer):
    return sample_reference(model, tokenizer, QUESTIONS, system_prompt="", max_new_tokens=12, seed=0, batch_size=32)


def test_kl_is_zero_for_the_reference_policy_itself(tiny_model):
    model, tokenizer = tiny_model
    ref = _reference(model, tokenizer)
    assert ref.completion_mask.sum() > 0
    assert kl_from_reference(model, ref)["kl"] == pytest.approx(0.0, abs=1e-6)


def test_kl_estimate_matches_the_exact_token_kl(tiny_model):
    """k3 over the sampled tokens estimates sum_v p_prev log(p_prev / p_now) at the same positions."""
    model, tokenizer = tiny_model
    ref = _reference(model, tokenizer)
    moved = type(model)(model.config)
    moved.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head = moved.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=generator) * head.std() * 3.0)
    estimate = kl_from_reference(moved, ref)

    width = ref.completion_mask.shape[1]
    with torch.no_grad():
        prev = torch.log_softmax(model(input_ids=ref.input_ids, attention_mask=ref.attention_mask).logits[:, -width - 1:-1].float(), -1)
        now = torch.log_softmax(moved(input_ids=ref.input_ids, attention_mask=ref.attention_mask).logits[:, -width - 1:-1].float(), -1)
    exact = ((prev.exp() * (prev - now)).sum(-1) * ref.completion_mask).sum() / ref.completion_mask.sum()
    assert exact > 0.01  # the perturbation moved the policy
    assert estimate["kl_per_token"] == pytest.approx(exact.item(), rel=0.25)
    # the stored log-probs are the reference policy's own
    assert torch.allclose(completion_logps(model, ref), ref.logps, atol=1e-5)


def test_completion_log_probs_are_the_whole_log_softmax_s(tiny_model):
    """The lean path (the head on the completion's positions, logit minus log-sum-exp a few rows at a time) gives
    the log-probs of the whole sequence's log-softmax, with and without logits_to_keep."""
    from grpo_exp.training import forgetting

    model, tokenizer = tiny_model
    ref = _reference(model, tokenizer)
    width = ref.completion_mask.shape[1]
    with torch.no_grad():
        whole = torch.log_softmax(model(input_ids=ref.input_ids, attention_mask=ref.attention_mask).logits.float(), -1)
    expected = whole[:, -width - 1:-1].gather(-1, ref.input_ids[:, -width:].unsqueeze(-1)).squeeze(-1)
    assert forgetting._keeps_logits(type(model))
    assert torch.allclose(completion_logps(model, ref, batch_size=7), expected, atol=1e-5)

    class NoKeep(type(model)):  # a model whose forward takes no logits_to_keep
        def forward(self, input_ids=None, attention_mask=None):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask)

    plain = NoKeep(model.config)
    plain.load_state_dict(model.state_dict())
    assert not forgetting._keeps_logits(NoKeep)
    assert torch.allclose(completion_logps(plain, ref), expected, atol=1e-5)


def test_sampling_the_reference_leaves_the_training_random_state_as_it_found_it(tiny_model):
    """The reference is sampled after the trainer is built and before its first step: a run that tracks forgetting
    must train the model a run without it trains, so the sampling's seeding may not leak into the global state."""
    model, tokenizer = tiny_model
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    ref = _reference(model, tokenizer)
    assert torch.equal(torch.get_rng_state(), state)
    again = _reference(model, tokenizer)  # its own seed: the same samples, whatever the state around it
    assert torch.equal(again.input_ids, ref.input_ids)


def test_completion_mask_stops_after_eos(tiny_model):
    model, tokenizer = tiny_model
    ref = _reference(model, tokenizer)
    eos = tokenizer.eos_token_id
    completions = ref.input_ids[:, -ref.completion_mask.shape[1]:]
    for row, mask in zip(completions, ref.completion_mask):
        hits = (row == eos).nonzero()
        if len(hits):
            first = hits[0].item()
            assert mask[: first + 1].all() and not mask[first + 1:].any()


def test_forgetting_without_a_previous_stage_is_one_line(tmp_path):
    cfg = compose_cfg(["debug=smoke", "eval.forgetting_sets=[basic]"], tmp_path)
    with pytest.raises(ConfigError, match=r"forgetting_sets=\['basic'\].*set init_from=") as err:
        validate(cfg)
    assert "\n" not in str(err.value)


def test_forgetting_of_an_unknown_stage_is_one_line(tmp_path):
    cfg = compose_cfg(["debug=smoke", "eval.forgetting_sets=[expert]"], tmp_path)
    with pytest.raises(ConfigError, match="'expert' in eval.forgetting_sets; valid stages: .*basic"):
        validate(cfg)


def test_an_earlier_stage_is_scored_on_its_own_runs_split(tmp_path):
    """init_from's run, recorded before stage.split_seed existed, drew basic's split with its train.seed=42;
    scoring basic under another split seed would include problems it trained on, so that is refused. Its split
    seed, whatever this run's training seed, passes."""
    earlier = tmp_path / "basic_run"
    (earlier / ".hydra").mkdir(parents=True)
    (earlier / ".hydra" / "config.yaml").write_text("train:\n  seed: 42\nstage:\n  name: basic\n")
    args = ["debug=smoke", "stage=intermediate", f"init_from={earlier}", "eval.forgetting_sets=[basic]"]
    with pytest.raises(ConfigError, match=r"trained basic on the split of split seed 42.*set stage.split_seed=42") as err:
        validate(compose_cfg([*args, "stage.split_seed=7"], tmp_path))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="stage.split_seed=42"):
        validate(compose_cfg(["debug=smoke", "stage=intermediate", f"init_from={earlier}", "eval.sets=[intermediate,basic]",
                              "stage.split_seed=7"], tmp_path))
    validate(compose_cfg([*args, "train.seed=1"], tmp_path))  # the training seed no longer moves the split
    validate(compose_cfg(["debug=smoke", "stage=intermediate", f"init_from={earlier}", "stage.split_seed=7"], tmp_path))


def _recorded_run(path, stage: str, seed: int, init_from=None, split_seed=None):
    """A run directory as a finished run leaves it, as far as the checks read it: its .hydra/config.yaml."""
    (path / ".hydra").mkdir(parents=True)
    earlier = f"init_from: {init_from}\n" if init_from else ""
    split = f"  split_seed: {split_seed}\n" if split_seed is not None else ""
    (path / ".hydra" / "config.yaml").write_text(f"{earlier}train:\n  seed: {seed}\nstage:\n  name: {stage}\n{split}")
    return path


def test_the_whole_init_from_chain_is_checked(tmp_path):
    """basic (split seed 5) -> two_step (split seed 42, from basic's model/) -> a third stage that scores
    basic only: basic's split was cut two runs back (the last run trained two_step), and scoring it under
    split seed 42 is refused; under 5 it passes."""
    basic = _recorded_run(tmp_path / "1_basic", "basic", 1, split_seed=5)
    two_step = _recorded_run(tmp_path / "2_two_step", "two_step", 1, init_from=basic / "model", split_seed=42)
    args = ["debug=smoke", "stage=intermediate", f"init_from={two_step}", "eval.forgetting_sets=[basic]"]
    with pytest.raises(ConfigError, match=rf"init_from={two_step} continues {basic}/model, which trained basic on "
                                          rf"the split of split seed 5.*set stage.split_seed=5") as err:
        validate(compose_cfg(args, tmp_path))
    assert "\n" not in str(err.value)
    validate(compose_cfg([*args, "stage.split_seed=5", "train.seed=3"], tmp_path))
    # scoring only the stages cut with this run's split seed passes
    _recorded_run(tmp_path / "3_two_step", "two_step", 1, init_from=basic, split_seed=42)
    validate(compose_cfg(["debug=smoke", "stage=intermediate", f"init_from={tmp_path / '3_two_step'}",
                          "eval.forgetting_sets=[two_step]", "train.seed=9"], tmp_path))


def test_a_looping_init_from_chain_ends(tmp_path):
    """Copied configs that name each other: the chain is read once round, not forever."""
    first, second = tmp_path / "a", tmp_path / "b"
    _recorded_run(first, "basic", 42, init_from=second)
    _recorded_run(second, "two_step", 42, init_from=first)
    validate(compose_cfg(["debug=smoke", "stage=intermediate", f"init_from={second}", "eval.forgetting_sets=[basic]",
                          "train.seed=3"], tmp_path))
    with pytest.raises(ConfigError, match="trained basic on the split of split seed 42"):
        validate(compose_cfg(["debug=smoke", "stage=intermediate", f"init_from={second}",
                              "eval.forgetting_sets=[basic]", "stage.split_seed=3"], tmp_path))

def test_the_drift_on_the_stages_own_prompts_is_logged_beside_the_earlier_stages_forgetting(tiny_model):
    """drift/<stage>/kl: the same estimator on the prompts the stage trains for (no accuracy: the stage's own
    periodic evaluation has it); zero for the policy the samples came from."""
    model, tokenizer = tiny_model
    callback = ForgettingCallback({}, [], 5, system_prompt="", batch_size=8, own=("two_step", _reference(model, tokenizer)))
    row = callback.measure(model, tokenizer)
    assert set(row) == {"drift/two_step/kl", "drift/two_step/kl_per_token"}
    assert row["drift/two_step/kl"] == pytest.approx(0.0, abs=1e-6)
