"""The compute curve (analysis/compute_curve.py): periodic validation accuracy against the training compute in
history.jsonl, ScaleRL's saturating curve fitted per run, an arm's figures over its seeds, and its plot."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_exp.analysis import aggregates, compute_curve


def _job(r0: float, a: float, b: float, mid: float, seconds_per_step: float = 30.0, noise: float = 0.0,
         seed: int = 0, every: int = 10, steps: int = 120, stage: str = "basic") -> dict:
    """A job's files as the report loads them: history rows with cpu_s_total, periodic evaluations on the curve."""
    rng = np.random.default_rng(seed)
    history = []
    for step in range(1, steps + 1):
        row = {"step": step, "cpu_s_total": step * seconds_per_step}
        if step % every == 0:
            core_min = step * seconds_per_step / 60
            acc = float(compute_curve.curve(np.array([core_min]), r0, a, b, mid)[0]) + noise * rng.standard_normal()
            row.update({f"eval/{stage}/accuracy": round(acc, 4), f"eval/{stage}/n": 200})
        history.append(row)
    return {"row": {"stage": stage}, "history": history, "periodic": aggregates.periodic_accuracy(history),
            "before_after": {"validation_before": {"set": stage, "accuracy": r0, "n": 200}}}


def test_the_fit_recovers_the_curve_it_was_drawn_from():
    job = _job(r0=0.15, a=0.55, b=1.5, mid=20.0)
    r0, found = compute_curve.points(job, "basic")
    assert r0 == 0.15 and len(found) == 12 and found[0] == (5.0, pytest.approx(found[0][1]))
    fitted = compute_curve.fit(r0, found)
    assert fitted["asymptote"] == pytest.approx(0.55, abs=0.01)
    assert fitted["efficiency"] == pytest.approx(1.5, rel=0.1)
    assert fitted["mid_core_min"] == pytest.approx(20.0, rel=0.1)
    assert fitted["rmse"] < 1e-3 and fitted["max_core_min"] == 60.0


def test_a_run_with_too_few_evaluations_or_no_compute_record_is_not_fitted():
    short = _job(0.1, 0.5, 1.0, 10.0, steps=30)  # 3 evaluations
    assert compute_curve.fit(*compute_curve.points(short, "basic")) is None
    unrecorded = _job(0.1, 0.5, 1.0, 10.0)
    for row in unrecorded["history"]:
        row.pop("cpu_s_total")
    assert compute_curve.points(unrecorded, "basic") is None


def test_an_arms_figures_are_over_its_seeds_and_the_plot_is_drawn(tmp_path):
    jobs = [_job(0.15, 0.55, 1.5, 20.0, noise=0.01, seed=s) for s in range(3)]
    jobs += [_job(0.15, 0.45, 1.0, 10.0, noise=0.01, seed=s) for s in range(2)]
    labels = ["ablation=none"] * 3 + ["ablation=gens_8"] * 2
    table = compute_curve.curve_table(jobs, labels)
    assert list(table["variant"]) == ["ablation=none", "ablation=gens_8"] and list(table["seeds"]) == [3, 2]
    mean, interval = table.loc[0, "asymptote A"].split(" ", 1)
    low, high = (float(x) for x in interval.strip("[]").split(", "))
    assert low < float(mean) < high and abs(float(mean) - 0.55) < 0.05
    assert compute_curve.plot(jobs, labels, tmp_path / "compute_curve.png").stat().st_size > 10_000
    assert compute_curve.plot([], [], tmp_path / "none.png") is None


def test_the_plot_follows_the_stage_the_jobs_trained_on():
    jobs = [_job(0.1, 0.4, 1.0, 10.0, seed=s, stage="two_step") for s in range(2)]
    assert compute_curve.trained_set(jobs) == "two_step" and compute_curve.trained_set([]) == "basic"
    assert compute_curve.fits(jobs, ["a", "a"], "basic") == []
    assert len(compute_curve.fits(jobs, ["a", "a"], compute_curve.trained_set(jobs))) == 2


def test_the_budget_and_target_read_off_each_fit():
    fitted = {"start": 0.15, "asymptote": 0.55, "efficiency": 1.5, "mid_core_min": 20.0}
    reach = compute_curve.compute_to_reach(fitted, 0.50)
    assert compute_curve.at(fitted, reach) == pytest.approx(0.50)
    assert compute_curve.at(fitted, 20.0) == pytest.approx(0.35)  # half the gain at the midpoint
    assert compute_curve.compute_to_reach(fitted, 0.10) == 0.0
    assert compute_curve.compute_to_reach({**fitted, "asymptote": 0.45}, 0.50) is None
    assert compute_curve.compute_to_reach({**fitted, "asymptote": 0.50}, 0.50) is None


def test_the_table_says_on_how_many_seeds_the_target_is_never_reached():
    jobs = [_job(0.15, 0.60, 1.5, 20.0, seed=s) for s in range(2)] + [_job(0.15, 0.40, 1.0, 10.0)]
    jobs += [_job(0.15, 0.60, 1.5, 20.0, seed=5)]
    labels = ["ablation=none", "ablation=none", "ablation=gens_8", "ablation=gens_8"]
    table = compute_curve.curve_table(jobs, labels, budget_core_min=20.0, target=0.5)
    reached = table.loc[0, "core-min to 0.50"]
    reach = compute_curve.compute_to_reach({"start": 0.15, "asymptote": 0.60, "efficiency": 1.5, "mid_core_min": 20.0},
                                           0.5)
    assert reach < 60 and float(reached.split(" ")[0]) == pytest.approx(reach, rel=0.1)
    assert "extrapolated" not in reached  # the runs trained 60 core-minutes
    short = compute_curve.curve_table(jobs[:2], labels[:2], target=0.58)  # reached past the compute trained
    assert short.loc[0, "core-min to 0.58"].endswith("(extrapolated on 2 of 2 seeds)")
    assert table.loc[1, "core-min to 0.50"] == "not reached: asymptote <= 0.50 on 1 of 2 seeds"
    assert float(table.loc[0, "fitted at 20 core-min"].split(" ")[0]) == pytest.approx(0.375, abs=0.01)


def test_an_arms_line_is_the_mean_of_its_seeds_evaluations_up_to_the_fewest():
    jobs = [_job(0.1, 0.5, 1.0, 10.0, seconds_per_step=30.0, seed=0),
            _job(0.2, 0.5, 1.0, 10.0, seconds_per_step=60.0, seed=1, steps=60)]
    fitted = compute_curve.fits(jobs, ["a", "a"], "basic")
    xs, ys, seeds = compute_curve.arm_means(fitted)["a"]
    assert seeds == 2 and len(xs) == len(ys) == 1 + 6  # the start and the six evaluations both seeds have
    assert xs[0] == 0.0 and ys[0] == pytest.approx(0.15)
    assert xs[1] == pytest.approx((5.0 + 10.0) / 2)  # step 10 at 30 and at 60 core-seconds a step
    first = [fitted[0][1][1][0][1], fitted[1][1][1][0][1]]
    assert ys[1] == pytest.approx(sum(first) / 2)
