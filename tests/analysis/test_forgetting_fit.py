"""Forgetting against KL: the points read from curriculum.json and each stage's history, and the fitted line."""

import json
import math

import pytest

from grpo_exp.analysis import forgetting_fit, tables
from grpo_exp.evaluation.continual import transfer_metrics


def _job(root, seed: int, a_after_b: float, drift: float, method: str | None = None) -> dict:
    """Two stages a -> b: a at 0.75 after a, `a_after_b` after b; b logged its drift and the KL on a's prompts."""
    matrix = [[0.75, 0.25], [a_after_b, 1.0]]
    rows = [[[1, 1, 1, 0], [1, 0, 0, 0]], [[1, 0, 0, 0], [1, 1, 1, 1]]]
    cur = {"stages": ["a", "b"], "seed": seed, "matrix": matrix, "ewc_lambda": 0, "replay": 0,
           "correct": {"base": [[0, 0, 0, 0]] * 2, "rows": rows}, **transfer_metrics(matrix),
           **({"method": method} if method else {})}
    job_dir = root / f"{method or 'grpo'}{seed}"
    (job_dir / "2_b").mkdir(parents=True)
    history = [{"global_step": 5, "drift/b/kl": drift / 2, "forgetting/a/kl": 0.1},
               {"global_step": 10, "drift/b/kl": drift, "forgetting/a/kl": 0.2}]
    (job_dir / "2_b" / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history) + '{"torn')
    return {"curriculum": cur, "row": {"dir": str(job_dir)}}


def test_each_later_stage_gives_a_point_per_earlier_stage_with_its_last_kl(tmp_path):
    table = forgetting_fit.points([_job(tmp_path, 1, 0.25, 3.0)], ["x"])
    assert len(table) == 1
    point = table.iloc[0]
    assert (point["stage"], point["earlier"], point["family"]) == ("b", "a", "GRPO")
    assert point["forgetting"] == pytest.approx(0.5)  # 0.75 when b began, 0.25 when it ended
    assert point["drift"] == 3.0 and point["kl_earlier"] == 0.2  # the stage's last values


def test_a_stage_without_drift_gives_nan_not_a_guess(tmp_path):
    job = _job(tmp_path, 1, 0.25, 3.0)
    (tmp_path / "grpo1" / "2_b" / "history.jsonl").write_text('{"global_step": 10, "loss": 0.1}\n')
    point = forgetting_fit.points([job], ["x"]).iloc[0]
    assert math.isnan(point["drift"]) and math.isnan(point["kl_earlier"])


def test_the_line_recovers_an_exact_slope_and_says_r2():
    fit = forgetting_fit.line_fit([1.0, 2.0, 3.0, 4.0], [0.1, 0.2, 0.3, 0.4])
    assert fit["slope"] == pytest.approx(0.1) and fit["intercept"] == pytest.approx(0.0, abs=1e-12)
    assert fit["r2"] == pytest.approx(1.0) and fit["n"] == 4
    noisy = forgetting_fit.line_fit([1.0, 2.0, 3.0, 4.0, 5.0], [0.1, 0.3, 0.2, 0.5, 0.4])
    low, high = noisy["slope_ci95"]
    assert low < noisy["slope"] < high and noisy["r2"] < 1.0
    assert forgetting_fit.line_fit([1.0, 1.0, 1.0], [0.1, 0.2, 0.3]) is None  # no spread in x
    assert forgetting_fit.line_fit([1.0, 2.0], [0.1, 0.2]) is None  # two points


def test_grpo_and_sft_get_a_line_each_and_one_together(tmp_path):
    jobs = [_job(tmp_path, s, 0.75 - 0.1 * d, d) for s, d in ((1, 1.0), (2, 2.0), (3, 3.0))]
    jobs += [_job(tmp_path, s, 0.75 - 0.05 * d, d, method="sft") for s, d in ((1, 2.0), (2, 4.0), (3, 6.0))]
    labels = ["grpo"] * 3 + ["sft"] * 3
    fits = forgetting_fit.fit_table(forgetting_fit.points(jobs, labels))
    drift = fits[fits["x"] == forgetting_fit.KL_AXES["drift"]]
    assert list(drift["family"]) == ["GRPO", "SFT", "all"]
    assert drift.iloc[0]["slope [95% t CI]"].startswith("+0.1 ") and drift.iloc[0]["R^2"] == "1.00"
    assert drift.iloc[1]["slope [95% t CI]"].startswith("+0.05 ")
    names = [s.name for s in tables.continual_sections(jobs, labels)]
    assert "forgetting_kl" in names
    assert forgetting_fit.plot(forgetting_fit.points(jobs, labels), tmp_path / "f.png").is_file()
