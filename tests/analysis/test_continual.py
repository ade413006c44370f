"""The continual-learning table from curriculum.json files: gains pooled over seeds, spreads, and each method
against the first, paired problem by problem."""

import pytest

from grpo_exp.analysis import continual, tables
from grpo_exp.evaluation.stats import mcnemar_exact_p
from grpo_exp.evaluation.continual import forward_transfer, transfer_metrics, turnover


def _curriculum(seed: int, base: list[list[int]], rows: list[list[list[int]]]) -> dict:
    acc = lambda bits: sum(bits) / len(bits)  # noqa: E731
    matrix = [[acc(b) for b in row] for row in rows]
    return {"stages": ["a", "b"], "seed": seed, "base": [acc(b) for b in base], "matrix": matrix,
            "correct": {"base": base, "rows": rows}, **transfer_metrics(matrix)}


def _job(cur: dict) -> dict:
    return {"curriculum": cur, "row": {"dir": f"job{cur['seed']}"}}


# four problems per stage; stage a learned from 1 to 3 right, stage b from 1 (after a) to 4
PLAIN = [_curriculum(s, [[1, 0, 0, 0], [0, 0, 0, 0]], [[[1, 1, 1, 0], [1, 0, 0, 0]], [[1, 0, 0, 0], [1, 1, 1, 1]]])
         for s in (1, 2)]
KEEP = [_curriculum(s, [[1, 0, 0, 0], [0, 0, 0, 0]], [[[1, 1, 1, 0], [1, 0, 0, 0]], [[1, 1, 1, 0], [1, 1, 1, 1]]])
        for s in (1, 2)]


def test_gains_are_seed_level_and_the_pooled_test_is_labelled():
    table = continual.continual_table([_job(c) for c in PLAIN], ["plain", "plain"])
    row = table.iloc[0]
    assert row["seeds"] == "1 2"
    # stage b: before it (after a) 1 of 4 right on each seed, after it 4 of 4: +0.75 on each of two seeds
    assert row["b gain"].startswith("+0.750 [t ") and row["b gain"].endswith("2 seeds: not yet shown")
    # pooled over the 8 problems (6 flips): only as the figure given these trained models
    assert row["b gain, pooled"] == f"+0.750 p {mcnemar_exact_p(0, 6):.2g} (given these trained models)"
    assert row["a final"] == "0.250 [t 0.250, 0.250]"  # mean [t interval] over the two seeds
    assert row["max forgetting"] == "0.500 [t 0.500, 0.500]"


def test_each_metric_is_a_mean_over_seeds_with_its_t_interval_and_is_drawn_per_seed(tmp_path):
    from grpo_exp.analysis.plots import plot_continual_metrics
    from grpo_exp.evaluation.stats import mean_interval

    # seed 2 keeps the two problems of stage a that seed 1 loses: average accuracy 0.625 and 0.875
    varied = [PLAIN[0], KEEP[1]]
    values = continual.seed_metrics(varied)
    assert values["average accuracy"] == [0.625, 0.875]
    assert values["max forgetting"] == [0.5, 0.0]
    assert set(values) == set(continual.METRICS)
    low, high = mean_interval([0.625, 0.875])
    row = continual.continual_table([_job(c) for c in varied], ["m", "m"]).iloc[0]
    assert row["average accuracy"] == f"0.750 [t {low:.3f}, {high:.3f}]" and low < 0.625 and high > 0.875
    assert continual.continual_table([_job(PLAIN[0])], ["m"]).iloc[0]["average accuracy"] == "0.625"  # one seed
    path = plot_continual_metrics({"plain": continual.seed_metrics(PLAIN), "m": values}, tmp_path / "m.png")
    assert path.stat().st_size > 5000
    assert plot_continual_metrics({"plain": {}}, tmp_path / "none.png") is None


def test_methods_are_compared_with_the_first_on_the_same_seeds():
    jobs = [_job(c) for c in PLAIN + KEEP]
    versus = continual.against_baseline(jobs, ["plain", "plain", "ewc", "ewc"])
    assert list(versus["method"]) == ["ewc"] and versus.iloc[0]["against"] == "plain"
    # the final model keeps two more problems of stage a per seed: +0.5 over 8, 4 flips, none the other way
    assert versus.iloc[0]["a final, difference"].startswith("+0.500 [")
    assert versus.iloc[0]["b final, difference"].startswith("+0.000")


def test_every_metric_is_compared_with_plain_grpo_paired_by_seed():
    """average accuracy, BWT, FWT, forgetting and turnover: the per-seed differences to the baseline's same seed,
    their mean with the seed-level t interval, p and verdict."""
    from grpo_exp.evaluation import seed_stats

    # seed 2 of the method keeps stage a (KEEP), seed 1 loses it as plain GRPO does
    method = [PLAIN[0], KEEP[1]]
    versus = continual.against_baseline([_job(c) for c in PLAIN + method], ["plain", "plain", "m", "m"]).iloc[0]
    # average accuracy: 0.625 and 0.875 against 0.625 and 0.625: differences 0 and +0.25
    expected = seed_stats.paired_difference([0.625, 0.625], [0.625, 0.875])
    assert expected["per_seed"] == [0.0, 0.25] and expected["diff"] == 0.125
    assert versus["average accuracy, difference"] == seed_stats.cell(expected)
    assert versus["average accuracy, difference"].startswith("+0.125 [t ") and "2 seeds: not yet shown" in \
        versus["average accuracy, difference"]
    assert versus["max forgetting, difference"].startswith("-0.250 [t ")
    assert versus["earlier solved, lost, difference"].startswith("-")
    assert versus["FWT, difference"].startswith("+0.000")
    # five seeds that all move the same way are beyond seed noise; a sign flip is within it
    assert seed_stats.paired_difference([0.5] * 5, [0.6, 0.62, 0.61, 0.63, 0.6])["verdict"] == "beyond seed noise"
    assert seed_stats.paired_difference([0.5] * 5, [0.6, 0.4, 0.55, 0.45, 0.5])["verdict"] == "within seed noise"


def test_runs_without_per_problem_results_make_no_table():
    old = {k: v for k, v in PLAIN[0].items() if k != "correct"}
    assert continual.continual_table([_job(old)], ["x"]).empty
    assert tables.continual_sections([_job(old)], ["x"]) == []
    names = [s.name for s in tables.continual_sections([_job(c) for c in PLAIN + KEEP], ["p", "p", "e", "e"])]
    assert names == ["stage_gains", "continual", "continual_vs_baseline"]


def test_gains_by_job_list_each_stage_with_the_jobs_minutes(tmp_path):
    (tmp_path / "status.json").write_text('{"status": "completed", "duration_s": 1800}')
    job = {"curriculum": PLAIN[0], "row": {"dir": str(tmp_path)}}
    table = continual.gains_by_job([job], ["plain"])
    assert list(table["stage"]) == ["a", "b"]
    assert list(table["before"]) == ["0.250", "0.250"] and list(table["after"]) == ["0.750", "1.000"]
    assert list(table["job minutes"]) == ["30.0", ""]


@pytest.mark.parametrize("name", ["stage_gains", "continual", "continual_vs_baseline"])
def test_tables_are_named_for_grpo_report(name):
    assert name in tables.NAMES


def test_where_a_branch_took_its_first_stage_is_not_part_of_its_method():
    import pandas as pd

    from grpo_exp.analysis.report import seed_labels

    df = pd.DataFrame([{"job": str(i), "override:train.seed": seed, "override:ewc.lambda": lam,
                        "override:curriculum.branch_from": src}
                       for i, (seed, lam, src) in enumerate([("42", "1000", None), ("1", "1000", None),
                                                             ("42", "0", "out/0"), ("1", "0", "out/1")])])
    assert seed_labels(df) == ["ewc.lambda=1000"] * 2 + ["ewc.lambda=0"] * 2


def test_a_method_is_named_by_what_its_curriculum_ran():
    ran = lambda lam, replay, mode="sequential": {"ewc_lambda": lam, "replay": replay, "mode": mode}  # noqa: E731
    assert continual.method_label(ran(0.0, None), "ewc.lambda=0") == "plain GRPO"
    assert continual.method_label(ran(1000.0, 0.0), "(defaults)") == "EWC lambda 1000"
    assert continual.method_label(ran(1000.0, 0.0), "all") == "EWC lambda 1000"  # a sweep of seeds alone
    assert continual.method_label(ran(1000.0, 0.2), "curriculum.replay=0.2") == "EWC lambda 1000 + replay 0.2"
    assert continual.method_label(ran(0.0, 0.2), "ewc.lambda=0, curriculum.replay=0.2, train.beta=0") == \
        "replay 0.2, train.beta=0"
    assert continual.method_label(ran(0.0, 0.0, "adaptive"), "curriculum=adaptive") == \
        "plain GRPO (adaptive curriculum)"
    assert continual.method_label({}, "x") == "x"  # a record that does not say what it ran keeps its label
    sft = {**ran(0.0, 0.0), "method": "sft"}
    assert continual.method_label(sft, "train.method=sft") == "SFT"
    assert continual.method_label({**sft, "ewc_lambda": 1.0}, "train.method=sft, ewc.lambda=1") == "SFT + EWC lambda 1"
    uniform = {**ran(10.0, 0.0), "ewc_fisher": "uniform", "method": "grpo"}
    assert continual.method_label(uniform, "ewc.fisher=uniform, ewc.lambda=10") == "uniform-Fisher L2 lambda 10"


def test_plain_grpo_is_the_baseline_wherever_it_comes_in_the_list():
    ewc = [{**c, "ewc_lambda": 1000.0} for c in KEEP]
    plain = [{**c, "ewc_lambda": 0.0} for c in PLAIN]
    versus = continual.against_baseline([_job(c) for c in ewc + plain], ["a", "a", "b", "b"])
    assert list(versus["method"]) == ["EWC lambda 1000, a"] and versus.iloc[0]["against"] == "plain GRPO, b"
    assert versus.iloc[0]["a final, difference"].startswith("+0.500 [")


def test_a_branch_names_where_its_first_stage_came_from_and_times_the_stages_it_trained(tmp_path):
    (tmp_path / "status.json").write_text('{"status": "completed", "duration_s": 600}')
    cur = {**PLAIN[0], "branched_from": {"dir": "/x/ladder/0", "stages": ["a"]}}
    table = continual.gains_by_job([{"curriculum": cur, "row": {"dir": str(tmp_path)}}], ["plain"])
    assert list(table["job minutes"]) == ["taken from ladder/0", "10.0"]


def test_method_labels_name_curriculum_jobs_by_method_and_leave_the_others():
    jobs = [_job({**PLAIN[0], "ewc_lambda": 0.0}), {"curriculum": None}]
    assert continual.method_labels(jobs, ["ewc.lambda=0", "lr=1"]) == ["plain GRPO", "lr=1"]


def test_an_adaptive_run_is_a_method_scored_against_its_start_model_and_the_progressive_order():
    # one run trained both stages: its single row is the final model; stage b went from 0 to 3 of 4 right
    adaptive = {**_curriculum(1, [[1, 0, 0, 0], [0, 0, 0, 0]], [[[1, 1, 0, 0], [1, 1, 1, 0]]]),
                "mode": "adaptive", "ewc_lambda": 0.0, "bwt": None, "forgetting_max": None}
    progressive = {**PLAIN[0], "ewc_lambda": 0.0}
    jobs = [_job(progressive), _job(adaptive)]
    labels = ["curriculum=progressive", "curriculum=adaptive"]
    table = continual.continual_table(jobs, labels).set_index("method")
    row = table.loc["plain GRPO (adaptive curriculum)"]
    assert row["a final"] == "0.500" and row["b final"] == "0.750"
    assert row["a gain"].startswith("+0.250, 1 seed: not yet shown") and row["b gain"].startswith("+0.750, 1 seed")
    assert row["BWT"] == "" and row["max forgetting"] == ""
    gains = continual.gains_by_job(jobs, labels)
    assert list(gains[gains["method"] == "plain GRPO (adaptive curriculum)"]["before"]) == ["0.250", "0.000"]
    versus = continual.against_baseline(jobs, labels)
    assert versus.iloc[0]["against"] == "plain GRPO, curriculum=progressive"
    # final models: a 1 of 4 (progressive forgot it) against 2 of 4; b 4 of 4 against 3 of 4
    assert versus.iloc[0]["a final, difference"].startswith("+0.250, 1 seed: not yet shown")
    assert versus.iloc[0]["b final, difference"].startswith("-0.250, 1 seed")


@pytest.mark.slow  # a subprocess
def test_the_report_loads_no_training_code():
    """grpo-report draws the continual tables from evaluation's metrics: importing it loads neither TRL, nor
    transformers, nor grpo_exp.training (a subprocess: this session has them loaded already)."""
    import subprocess
    import sys

    probe = ("import sys, grpo_exp.analysis.report; "
             "print(sorted(m for m in sys.modules if m in ('trl', 'transformers') or m.startswith('grpo_exp.training')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_forward_transfer_and_turnover_count_problems_that_change_hands():
    # PLAIN: stage b before it trained 1/4 (after a), base 0/4: FWT +0.25; of a's 4 problems, a's model solved 3
    # and b's model kept 1 of them (2 lost), gained none
    row = continual.continual_table([_job(c) for c in PLAIN], ["plain", "plain"]).iloc[0]
    assert row["FWT"] == "0.250 [t 0.250, 0.250]"
    assert row["earlier solved, lost"] == "0.500 [t 0.500, 0.500]" and row["earlier unsolved, gained"].startswith("0.000")
    # accuracy may hold while problems change hands: 2 of 4 right before and after, with all four swapped
    swapped = turnover([[[1, 1, 0, 0]], [[0, 0, 1, 1], [1, 1, 1, 1]]])
    assert swapped == {"lost": 0.5, "gained": 0.5, "scored": 4}
    assert turnover([[[1, 0]]]) is None and forward_transfer([[0.5]], [0.1]) is None
    assert forward_transfer([[0.5, 0.3], [0.4, 0.9]], [0.1, 0.2]) == pytest.approx(0.1)


def test_each_method_gets_one_accuracy_matrix_heatmap_of_its_seeds_means(tmp_path, monkeypatch):
    from grpo_exp.analysis import plots

    drawn = {}
    real = plots.plot_curriculum
    monkeypatch.setattr(plots, "plot_curriculum",
                        lambda cur, title, path: drawn.setdefault(path.name, (cur, title)) and real(cur, title, path))
    other = _curriculum(3, [[1, 1, 0, 0], [0, 0, 0, 0]], [[[1, 1, 1, 1], [1, 0, 0, 0]], [[1, 0, 0, 0], [1, 1, 1, 1]]])
    made = plots.plot_curriculum_means([("plain GRPO", PLAIN[0]), ("plain GRPO", other), ("EWC lambda 10", KEEP[0])],
                                       tmp_path)
    assert sorted(p.name for p in made) == ["accuracy_matrix_ewc_lambda_10.png", "accuracy_matrix_plain_grpo.png"]
    assert all(p.stat().st_size > 0 for p in made)
    mean, title = drawn["accuracy_matrix_plain_grpo.png"]
    assert mean["base"] == [0.375, 0.0]  # (1/4 + 2/4) / 2
    assert mean["matrix"] == [[0.875, 0.25], [0.25, 1.0]]
    assert "mean over 2 seeds (1, 3)" in title
