"""Replay (curriculum.replay, grpo_exp/training/curriculum/replay.py): a later stage's training set holds the asked share of
earlier stages' training prompts, each with its own answer and stage; the curriculum asks for it from the second
stage on only; a short run on such a set logs each stage's share of every round."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from grpo_exp.core import data, rewards
from grpo_exp.training.curriculum.overrides import stage_overrides
from grpo_exp.training.curriculum.replay import mix_stages, mixed_examples, replay_mix
from tests.conftest import compose_cfg

FAST = ["debug=smoke", "logger=none", "train.max_completion_length=8", "train.save_steps=100",
        "eval.after_train=false", "eval.every_steps=null"]


def _examples(stage: str, size: int, seed: int = 42) -> list[dict]:
    return data.build_examples(stage, "train", size=size, seed=seed)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.3, 0.5])
def test_the_replayed_share_is_the_fraction_and_each_example_keeps_its_answer(fraction):
    own = _examples("advanced", 100)
    earlier = {"basic": _examples("basic", 60), "intermediate": _examples("intermediate", 60)}
    mixed = replay_mix(own, "advanced", earlier, fraction, seed=42)
    counts = Counter(ex["stage"] for ex in mixed)
    assert len(mixed) == len(own)
    assert counts["basic"] + counts["intermediate"] == round(100 * fraction)
    assert abs(counts["basic"] - counts["intermediate"]) <= 1  # an equal share from each earlier stage
    answers = {(name, ex["question"]): ex["answer"] for name, pool in [("advanced", own), *earlier.items()]
               for ex in pool}
    for ex in mixed:  # drawn from its own stage's training set, with that set's answer
        assert answers[(ex["stage"], ex["question"])] == ex["answer"]
    assert len({(ex["stage"], ex["question"]) for ex in mixed}) == len(mixed)  # no example twice
    assert replay_mix(own, "advanced", earlier, fraction, seed=42) == mixed  # seeded by train.seed
    assert replay_mix(own, "advanced", earlier, fraction, seed=1) != mixed
    # spread over the epoch, not appended at its end
    assert {ex["stage"] for ex in mixed[: len(mixed) // 2]} == {"advanced", "basic", "intermediate"}


def test_a_replayed_example_is_rewarded_against_its_own_answer():
    mixed = replay_mix(_examples("intermediate", 20), "intermediate", {"basic": _examples("basic", 20)}, 0.5, seed=0)
    dataset = data.to_dataset(mixed, "", stage_column=True)
    assert Counter(dataset["stage"]) == {"intermediate": 10, "basic": 10}
    # what TRL hands the reward: each row's own answer column; a completion stating it scores 1, another 0
    right = [f"The answer is {a}." for a in dataset["answer"]]
    wrong = [f"The answer is {float(a) + 1}." for a in dataset["answer"]]
    assert rewards.correctness(right, dataset["answer"]) == [1.0] * 20
    assert rewards.correctness(wrong, dataset["answer"]) == [0.0] * 20


def test_a_stage_config_with_replay_builds_the_mixed_set_from_the_pools_given(tmp_path):
    cfg = compose_cfg([*FAST, "stage=intermediate", "curriculum.replay=0.25", "curriculum.replay_from=[basic]"],
                      tmp_path)
    pools = {"basic": compose_cfg([*FAST, "stage=basic", "stage.num_train=12"], tmp_path).stage}
    own = _examples("intermediate", 16)
    mixed = mixed_examples(cfg, own, pools)
    assert Counter(ex["stage"] for ex in mixed) == {"intermediate": 12, "basic": 4}
    basic = {ex["question"] for ex in data.build_examples("basic", "train", size=12, seed=cfg.train.seed)}
    assert {ex["question"] for ex in mixed if ex["stage"] == "basic"} <= basic  # the pool the curriculum passed
    assert mix_stages(cfg) == ["basic", "intermediate"]
    # replay 0, or a stage on its own: its training set as before, with no stage column
    plain = compose_cfg([*FAST, "stage=intermediate"], tmp_path)
    assert mixed_examples(plain, own) is None and mix_stages(plain) is None


def test_the_curriculum_asks_for_replay_from_the_second_stage_on(tmp_path):
    first = stage_overrides([], "basic", tmp_path / "1", None, replay=0.2, replay_from=[])
    later = stage_overrides(["curriculum.replay=0.2"], "advanced", tmp_path / "3", "prev", replay=0.2,
                            replay_from=["basic", "intermediate"])
    # the first stage replays nothing, whatever a method file or experiment set for the curriculum as a whole
    assert [o for o in first if o.startswith("curriculum.replay")] == ["curriculum.replay=0", "curriculum.replay_from=[]"]
    assert "curriculum.replay=0.2" in later and "curriculum.replay_from=[basic,intermediate]" in later
    assert later.count("curriculum.replay=0.2") == 1  # the user's own is replaced, not repeated
    # replay 0: the overrides a stage got before replay existed
    assert stage_overrides([], "advanced", tmp_path / "3", "prev") == stage_overrides(
        [], "advanced", tmp_path / "3", "prev", replay=0.0, replay_from=["basic"])


@pytest.mark.slow
def test_a_short_run_with_replay_logs_each_stages_share(tmp_path):
    from grpo_exp.training.stage import train

    cfg = compose_cfg([*FAST, "stage=intermediate", "curriculum.replay=0.5", "curriculum.replay_from=[basic]",
                       "train.max_steps=2", "completions_every=1"], tmp_path)
    metrics = train(cfg, pools={"basic": compose_cfg(FAST, tmp_path / "b").stage})
    assert metrics["steps"] == 2
    rows = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2
    for row in steps:
        shares = [row["curriculum/mix/basic"], row["curriculum/mix/intermediate"]]
        assert sum(shares) == pytest.approx(1.0) and all(0 <= s <= 1 for s in shares)
    completions = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert completions and {c["stage"] for c in completions} <= {"basic", "intermediate"}


def test_the_curriculum_hands_each_later_stage_its_replay_and_pools(tmp_path, monkeypatch, caplog):
    """run_curriculum's wiring, with training and scoring stubbed: stage i gets curriculum.replay and the stages
    before it, and the pools as the curriculum composed them; the first stage trains without replay."""
    from grpo_exp.training.curriculum import record, sequential

    calls = []

    def fake_train(cfg, step_offset=0, pools=None):
        calls.append((cfg.stage.name, cfg.curriculum.replay, list(cfg.curriculum.replay_from), pools))
        return {"steps": 1, "reward_mean_first": 0.0, "reward_mean_last": 0.0}

    def fake_scores(model_cfg, cache_dir, model_dir, stage_cfgs, limit, batch_size, seed):
        return [({"accuracy": 0.0}, [0] * limit) for _ in stage_cfgs]

    monkeypatch.setattr(sequential, "train", fake_train)
    monkeypatch.setattr(record, "evaluate_dir", fake_scores)
    monkeypatch.setattr(sequential.cpu, "apply", lambda cpu_cfg: {})  # the session's threads stay as they are
    # each stage's own completion length (debug=smoke would give every stage 16)
    overrides = ["logger=none", "curriculum=progressive", "curriculum.stages=[advanced,basic,intermediate]",
                 "curriculum.replay=0.4", "curriculum.eval_limit=2"]
    caplog.set_level("WARNING", logger="grpo_exp")
    result = sequential.run_curriculum(compose_cfg(overrides, tmp_path), overrides)
    assert [c[:3] for c in calls] == [("advanced", 0.0, []), ("basic", 0.4, ["advanced"]),
                                      ("intermediate", 0.4, ["advanced", "basic"])]
    assert calls[0][3] is None and sorted(calls[2][3]) == ["advanced", "basic"]
    assert calls[2][3]["advanced"].name == "advanced"
    assert result["replay"] == 0.4 and result["mode"] == "sequential"
    # advanced (128 tokens) replayed into basic (48) and intermediate (64): named, since its answers are cut
    assert "stage basic replays advanced" in caplog.text and "stage intermediate replays advanced" in caplog.text
