"""Seed-level statistics: the unit is the training run, not the problem."""

from __future__ import annotations

import pytest

from grpo_exp.evaluation import seed_stats


def test_t_test_matches_a_known_value():
    # per-seed differences of the example: +0.010, -0.050, -0.095 (mean -0.045, sd 0.0527, t 1.48, df 2)
    p = seed_stats.t_test_p([0.010, -0.050, -0.095])
    assert p == pytest.approx(0.277, abs=0.005)
    assert seed_stats.t_test_p([0.1]) is None
    assert seed_stats.t_test_p([0.0, 0.0]) == 1.0


def test_under_five_seeds_nothing_is_claimed_and_pooled_is_labelled():
    # three seeds, each moving 60 of 200 problems the same way: pooled McNemar is tiny, the seeds are 3
    pairs = [([0] * 200, [1] * 60 + [0] * 140) for _ in range(3)]
    result = seed_stats.seed_level(pairs)
    assert result["seeds"] == 3 and result["diff"] == pytest.approx(0.3)
    assert result["verdict"].startswith("not yet shown")
    assert result["pooled"]["p"] < 1e-10 and result["pooled_label"] == "given these trained models"
    assert "not yet shown" in seed_stats.cell(result) and "given these trained models" in seed_stats.pooled_cell(result)


def test_five_seeds_separate_a_steady_gain_from_a_noisy_one():
    steady = [([0] * 100, [1] * (20 + k) + [0] * (80 - k)) for k in range(5)]
    assert seed_stats.seed_level(steady)["verdict"] == "beyond seed noise"
    # the same pooled gain, but one seed gains everything and the others lose a little
    noisy = [([0] * 100, [1] * 60 + [0] * 40)] + [([1] * 5 + [0] * 95, [0] * 100) for _ in range(4)]
    result = seed_stats.seed_level(noisy)
    assert result["verdict"] == "within seed noise"
    low, high = result["bootstrap_ci95"]
    assert low < 0 < high  # resampling seeds sees the spread the pooled test does not
    assert result["pooled"]["p"] < 0.01
