"""Figures computed by grpo-report from the runs' files: the reward by fifths of a run on a hand-made
history.jsonl, the intervals over seeds, ranking on the validation split only, and results pages (their
header's provenance, their tables' commands, the learning-curve PNG), on fake sweeps laid out as Hydra
and the trainer write them."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone

import pandas as pd
import pytest

from grpo_exp.analysis import aggregates, plots, provenance, seed_summary
from tests.conftest import ROOT

PNG = b"\x89PNG\r\n\x1a\n"


def _write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def _job(path, overrides, *, seed, split="validation", n=100, correct=50, before=0.3, history=(), steps=10,
         multirun=True):
    """A finished job: Hydra's records, metrics.json, eval.json and before_after.json on `split`."""
    hydra = {"hydra": {"mode": "MULTIRUN" if multirun else "RUN",
                       "overrides": {"hydra": ["hydra.mode=MULTIRUN"] if multirun else [], "task": overrides},
                       "job": {"config_name": "train", "override_dirname": ",".join(sorted(overrides))}}}
    _write(path / ".hydra" / "hydra.yaml", hydra)  # JSON is YAML
    _write(path / ".hydra" / "overrides.yaml", "".join(f"- {o}\n" for o in overrides))
    _write(path / ".hydra" / "config.yaml", {"train": {"seed": seed}, "eval": {"split": split}})
    _write(path / "metrics.json", {"status": "completed", "steps": steps})
    accuracy = correct / n
    _write(path / "eval.json", {"config": {"split": split}, "sets": {"basic": {"accuracy": accuracy, "n": n}}})
    _write(path / "before_after.json", {
        "before": "base", "split": split, "before_source": {"from": "cache"},
        "sets": {"basic": {"n": n, "before": before, "after": accuracy, "accuracy_diff": accuracy - before,
                           "before_ci95": [before - 0.1, before + 0.1], "after_ci95": [accuracy - 0.1, accuracy + 0.1],
                           "accuracy_diff_ci95": [accuracy - before - 0.05, accuracy - before + 0.05],
                           "only_first_correct": 5, "only_second_correct": 5 + round((accuracy - before) * n),
                           "mcnemar_p": 0.01}}})
    _write(path / "history.jsonl", "".join(json.dumps(r) + "\n" for r in history))
    return path


def _history(rewards, evals=()):
    """One row per step 1.. with its reward (None: a step that logged none), then the eval rows."""
    rows = [{"global_step": s, **({"reward": r} if r is not None else {}), "time": 1_790_000_000 + 60 * s}
            for s, r in enumerate(rewards, start=1)]
    for step, accuracy in evals:
        rows.append({"global_step": step, "eval/basic/accuracy": accuracy, "eval/basic/n": 50})
    return sorted(rows, key=lambda r: r["global_step"])


def test_reward_fifths_of_a_hand_made_history(tmp_path):
    from grpo_exp.analysis.report import load_job

    # 10 steps: two per fifth; an eval row at step 4 and 10 carries no reward and changes nothing
    job = _job(tmp_path / "run", ["train.seed=1"], seed=1, steps=10,
               history=_history([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0], [(4, 0.2), (10, 0.4)]))
    row = load_job(job)["row"]
    assert [round(row[f"reward_fifth_{k}"], 10) for k in range(1, 6)] == [0.15, 0.35, 0.55, 0.75, 0.95]
    assert row["reward_mean_overall"] == pytest.approx(0.55)
    assert row["validation_basic_accuracy_step_4"] == 0.2 and row["validation_basic_accuracy_step_10"] == 0.4

    # 7 steps (fifth ceil(5 s / 7): steps 1 | 2 | 3, 4 | 5 | 6, 7), step 4 logged no reward (a second step of
    # a generation): fifth 3 is step 3 alone; the overall mean is over the six rewards, not the five fifths
    fifths = aggregates.reward_fifths(_history([0.0, 0.5, 1.0, None, 0.25, 0.5, 1.0]), steps=7)
    assert fifths == {"reward_fifth_1": 0.0, "reward_fifth_2": 0.5, "reward_fifth_3": 1.0, "reward_fifth_4": 0.25,
                      "reward_fifth_5": 0.75, "reward_mean_overall": 3.25 / 6}
    # metrics.json's steps win over the last logged step: a run of 10 steps that logged 5 has fifths 1..3
    partial = aggregates.reward_fifths(_history([0.2, 0.4, 0.6, 0.8, 1.0]), steps=10)
    assert [partial[f"reward_fifth_{k}"] for k in range(1, 6)] == [pytest.approx(0.3), pytest.approx(0.7), 1.0,
                                                                   None, None]


def _sweep(root, variants):
    """A sweep of (ablation, seed, split, correct of 100) jobs with its multirun.yaml."""
    _write(root / "multirun.yaml", {"hydra": {"overrides": {"hydra": ["hydra.mode=MULTIRUN"],
                                                            "task": ["experiment=recipe_seeds"]},
                                              "job": {"config_name": "train"}}})
    for i, (ablation, seed, split, correct) in enumerate(variants):
        rewards = [0.1 * (k % 5) + 0.01 * seed for k in range(10)]
        _job(root / str(i), [f"ablation={ablation}", f"train.seed={seed}", "experiment=recipe_seeds"], seed=seed,
             split=split, correct=correct, history=_history(rewards, [(5, correct / 200), (10, correct / 100)]))
    return root


def test_over_seeds_mean_min_max_and_both_intervals(tmp_path):
    from grpo_exp.analysis.report import write_report

    sweep = _sweep(tmp_path / "s", [("none", 1, "validation", 40), ("none", 2, "validation", 50),
                                    ("none", 3, "validation", 60), ("beta_0", 1, "validation", 30),
                                    ("beta_0", 2, "validation", 34)])
    write_report([sweep])
    table = pd.read_csv(sweep / "seed_summary.csv").set_index("variant")
    assert table["rank"].tolist() == [1, 2] and table.index.tolist() == ["ablation=none", "ablation=beta_0"]
    none = table.loc["ablation=none"]
    assert (none["seeds"], none["eval_basic_accuracy_n"]) == (3, 3)
    assert none["eval_basic_accuracy_mean"] == pytest.approx(0.5)
    assert (none["eval_basic_accuracy_min"], none["eval_basic_accuracy_max"]) == (0.4, 0.6)
    # sd 0.1 over 3 seeds, t(0.975, 2) = 4.3027: 0.5 -+ 4.3027 x 0.1 / sqrt(3)
    assert none["eval_basic_accuracy_t95_low"] == pytest.approx(0.25159, abs=1e-5)
    assert none["eval_basic_accuracy_t95_high"] == pytest.approx(0.74841, abs=1e-5)
    # 150 right of 300 problems pooled: Wilson [0.44378, 0.55622]
    assert none["eval_basic_accuracy_pooled95_low"] == pytest.approx(0.44378, abs=1e-5)
    assert none["eval_basic_accuracy_pooled95_high"] == pytest.approx(0.55622, abs=1e-5)
    md = (sweep / "report.md").read_text()
    assert "[0.252, 0.748]" in md and "[0.444, 0.556]" in md  # the t and the pooled interval of ablation=none
    assert "mix held-out splits" not in md and "not ranked" not in md


def test_mixed_splits_are_not_ranked_across(tmp_path):
    from grpo_exp.analysis.report import write_report

    # the test-split variant scores higher, but is never ranked against the validation-split ones
    sweep = _sweep(tmp_path / "mixed", [("none", 1, "validation", 40), ("none", 2, "validation", 50),
                                        ("beta_0", 1, "validation", 45), ("beta_0", 2, "validation", 47),
                                        ("lr_constant", 1, "test", 90), ("lr_constant", 2, "test", 80)])
    df, _ = write_report([sweep])
    assert df["split"].tolist() == ["validation"] * 4 + ["test"] * 2
    table = pd.read_csv(sweep / "seed_summary.csv")
    assert table["variant"].tolist() == ["ablation=beta_0", "ablation=none", "ablation=lr_constant"]
    assert table["split"].tolist() == ["validation", "validation", "test"]
    assert table["rank"].tolist()[:2] == [1, 2] and pd.isna(table["rank"].iloc[2])
    md = (sweep / "report.md").read_text()
    line = ("These jobs mix held-out splits (validation: 4 jobs, test: 2 jobs); variants are ranked on the "
            "validation split only, never across splits.")
    assert md.count(line) == 1
    best = md.split("## Best variant per metric")[1].split("##")[0]
    assert "| eval_basic_accuracy | highest | 0.5 | validation | 1 |" in best  # job 1 (50 right), not job 4 (90)

    # rank() puts the validation rows first whatever the order it is given, and never numbers another split's
    shuffled = table.drop(columns="rank").iloc[[2, 1, 0]]
    reranked = seed_summary.rank(shuffled, "eval_basic_accuracy_mean")
    assert reranked["variant"].tolist() == ["ablation=beta_0", "ablation=none", "ablation=lr_constant"]
    assert reranked["rank"].tolist()[:2] == [1, 2] and pd.isna(reranked["rank"].iloc[2])
    only_test = seed_summary.split_note(["test", "test"])
    assert only_test.startswith("Measured on the test split") and "not ranked" in only_test
    assert seed_summary.split_note(["validation"] * 3) is None


def test_learning_curve_level_is_the_base_model_on_the_same_split():
    job = {"before_after": {"before": "base", "split": "validation", "sets": {"basic": {"before": 0.125, "n": 200}}},
           "periodic": {"basic": [(0, 0.1, 50), (20, 0.3, 50)]}}
    assert plots.base_level(job, "basic") == ("base model, n=200", 0.125)
    # the periodic evaluation's own problems, recorded after training, come first
    job["before_after"]["validation_before"] = {"set": "basic", "n": 50, "accuracy": 0.14}
    assert plots.base_level(job, "basic") == ("base model, n=50", 0.14)
    del job["before_after"]["validation_before"]
    job["before_after"]["split"] = "test"  # other problems: the step-0 evaluation instead
    assert plots.base_level(job, "basic") == ("step 0, n=50", 0.1)
    job["periodic"]["basic"] = [(20, 0.3, 50)]
    assert plots.base_level(job, "basic") is None


def test_run_commands_rebuilt_from_jobs_without_multirun_yaml(tmp_path):
    jobs = [_job(tmp_path / "sweep" / str(i), [f"ablation={a}", f"train.seed={s}"], seed=s)
            for i, (a, s) in enumerate([("none", 42), ("none", 1), ("beta_0", 42), ("beta_0", 1)])]
    single = _job(tmp_path / "run", ["model=tiny_random", "debug=smoke"], seed=42, multirun=False)
    assert provenance.run_commands([*jobs, single]) == [
        "python -m grpo_exp.train model=tiny_random debug=smoke",
        "python -m grpo_exp.train -m ablation=none,beta_0 train.seed=42,1"]


def test_a_sweep_dir_resumed_with_other_values_names_each_command(tmp_path):
    """multirun.yaml is the last command's: the jobs an earlier command of the same sweep dir made are told by their own
    overrides, not credited to it."""
    sweep = tmp_path / "sweep"
    _write(sweep / "multirun.yaml", {"hydra": {"overrides": {"hydra": ["hydra.mode=MULTIRUN"],
                                                             "task": ["experiment=probes", "ablation=ds", "train.seed=1"]},
                                               "sweeper": {"params": {"ablation": "none,ds"}},
                                               "job": {"config_name": "train"}}})
    jobs = [_job(sweep / name, ["experiment=probes", *extra], seed=seed) for name, extra, seed in (
        ("none_42", ["ablation=none"], 42), ("ds_42", ["ablation=ds"], 42), ("ds_1", ["ablation=ds", "train.seed=1"], 1))]
    assert provenance.run_commands(jobs) == [
        "python -m grpo_exp.train -m experiment=probes ablation=ds train.seed=1",
        "python -m grpo_exp.train -m experiment=probes ablation=none,ds"]
    # a sweep whose every job the last command made has its one line
    assert provenance.run_commands(jobs[2:]) == ["python -m grpo_exp.train -m experiment=probes ablation=ds train.seed=1"]


def _report(*args):
    return subprocess.run([sys.executable, "-m", "grpo_exp.apps.report", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_results_page_header_tables_and_plots(tmp_path):
    sweep = _sweep(tmp_path / "sweep", [("none", 1, "validation", 40), ("none", 2, "validation", 50),
                                        ("beta_0", 1, "validation", 45), ("beta_0", 2, "validation", 47)])
    page = tmp_path / "docs" / "results" / "demo.md"
    proc = _report(sweep, "--page", page, "--machine", "test-box")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = page.read_text()
    header = text.split("\n## ")[0]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    import torch
    import transformers
    import trl

    assert "- **Runs made by:** `python -m grpo_exp.train -m experiment=recipe_seeds`" in header
    assert f"- **Page made by:** `grpo-report {sweep} --page {page} --machine test-box`" in header
    assert f"- **Commit:** `{commit}" in header and "runs: no commit recorded" in header
    assert f"- **Date:** {datetime.now(timezone.utc):%Y-%m-%d}" in header
    assert "- **Machine:** test-box (" in header and "avx512_bf16 " in header and "amx_bf16 " in header
    assert "cores usable" in header
    assert (f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}" in header
            and f"python {sys.version.split()[0]}" in header)
    for title in ("Accuracy before and after training (validation split)", "Each variant over seeds",
                  "Training reward by fifths of the run", "Validation accuracy during training (validation split)"):
        assert f"## {title}" in text
    for name in ("before_after", "seeds", "reward_fifths", "validation_accuracy"):
        command = f"grpo-report {sweep} --table {name}"
        assert f"Reproduce: `{command}`" in text
        printed = _report(sweep, "--table", name)  # the command after the table prints that table
        assert printed.returncode == 0 and printed.stdout.strip() in text, printed.stderr[-2000:]
    assert "![learning_curve](demo/learning_curve.png)" in text and "![reward_curves](demo/reward_curves.png)" in text
    for name in ("learning_curve.png", "reward_curves.png"):
        data = (page.parent / "demo" / name).read_bytes()
        assert data[:8] == PNG and len(data) > 5000
    from matplotlib.image import imread

    assert imread(page.parent / "demo" / "learning_curve.png").shape[2] in (3, 4)  # decodes as an image
    assert not (sweep / "report.md").exists()  # a page run writes the page only

    again = _report(sweep, "--page", page, "--machine", "test-box")  # one command regenerates it
    assert again.returncode == 0 and page.read_text().split("- **Date:**")[1].split("\n", 1)[1] == \
        text.split("- **Date:**")[1].split("\n", 1)[1]


@pytest.mark.slow
def test_page_options_are_checked(tmp_path):
    proc = _report(tmp_path, "--machine", "x")
    assert proc.returncode == 2 and "give --page too" in proc.stderr
    sweep = _sweep(tmp_path / "sweep", [("none", 1, "validation", 40)])
    proc = _report(sweep, "--table", "seeds")  # one seed: no such table for these runs
    assert proc.returncode == 2 and "no table 'seeds'" in proc.stderr and "reward_fifths" in proc.stderr


def test_forgetting_kl_is_one_line_per_method_averaged_over_its_seeds(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(plots, "_line_plot", lambda curves, *a, **k: drawn.extend(curves))
    history = lambda kls: [{"global_step": s, "forgetting/basic/kl": kl} for s, kl in kls]  # noqa: E731
    jobs = [{"history": history([(110, 1.0), (130, 3.0)])}, {"history": history([(110, 2.0), (130, 5.0), (150, 9.0)])},
            {"history": history([(110, 0.5)])}]
    plots.plot_forgetting_kl(jobs, ["plain", "plain", "ewc"], tmp_path)
    # the seeds' mean at the steps both logged; a method of one seed as it is
    assert drawn == [("plain (basic), mean of 2", [(110, 1.5), (130, 4.0)]), ("ewc (basic)", [(110, 0.5)])]


def test_a_curriculum_jobs_commit_is_read_from_its_stages(tmp_path):
    from grpo_exp.analysis.provenance import run_commits

    job = tmp_path / "0"
    (job / "1_basic").mkdir(parents=True)
    (job / "2_intermediate").mkdir()
    (job / "status.json").write_text('{"status": "completed"}')
    (job / "1_basic" / "metrics.json").write_text('{"git_commit": "aaa1111"}')
    (job / "2_intermediate" / "metrics.json").write_text('{"git_commit": "bbb2222"}')
    assert run_commits([job]) == ["aaa1111", "bbb2222"]
    assert run_commits([tmp_path / "missing"]) == []


def test_compare_says_whether_runs_fall_inside_a_pages_seed_spread(tmp_path):
    from grpo_exp.analysis import results_page
    from grpo_exp.analysis.compare_page import CompareError, compare

    page_runs = _sweep(tmp_path / "page_runs", [("none", 1, "test", 40), ("none", 2, "test", 50),
                                                ("none", 3, "test", 60)])
    page = results_page.write_page([str(page_runs)], tmp_path / "docs" / "demo.md", "test-box")
    assert results_page.FIGURES_MARK in page.read_text()
    mine = _sweep(tmp_path / "mine", [("none", 7, "test", 55)])
    for ref in (page, page_runs):  # a page's figures block, or its runs' directory
        table = compare(str(ref), [str(mine)])
        row = next(line for line in table.splitlines() if "basic_accuracy" in line)
        assert "0.500" in row and "0.400..0.600" in row and "0.550 (seed 7)" in row
        assert "inside the page's seed range" in row
    far = _sweep(tmp_path / "far", [("none", 8, "test", 90)])
    assert "outside the page's seed range" in compare(str(page), [str(far)])
    validation = _sweep(tmp_path / "val", [("none", 9, "validation", 50)])
    with pytest.raises(CompareError, match="reports the test split"):
        compare(str(page), [str(validation)])
    empty = tmp_path / "empty.md"
    empty.write_text("# a page without figures\n")
    with pytest.raises(CompareError, match="holds no figures block"):
        compare(str(empty), [str(mine)])


def test_a_page_refuses_runs_of_uncommitted_code_and_paths_outside_the_repo(tmp_path):
    from grpo_exp.analysis import results_page

    sweep = _sweep(tmp_path / "sweep", [("none", 1, "test", 40), ("none", 2, "test", 50)])
    metrics = json.loads((sweep / "0" / "metrics.json").read_text())
    _write(sweep / "0" / "metrics.json", {**metrics, "git_commit": "abc1234 (with uncommitted changes, diff 0123)"})
    with pytest.raises(results_page.PageError, match="uncommitted changes.*--allow-dirty"):
        results_page.write_page([str(sweep)], tmp_path / "p.md")
    assert not (tmp_path / "p.md").exists()
    inside = ROOT / "outputs" / "pytest-page"
    text = results_page.repo_relative(f"`grpo-report {inside} --page {ROOT}/docs/x.md`")
    assert text == "`grpo-report outputs/pytest-page --page docs/x.md`"
    in_repo = ROOT / "outputs" / "pytest-pages" / f"{tmp_path.name}.md"
    try:
        with pytest.raises(results_page.PageError, match="outside the repository"):
            # a page inside the repository citing runs in a temporary folder: a path no reader has
            results_page.write_page([str(sweep)], in_repo, allow_dirty=True)
        assert not in_repo.exists()
    finally:
        import shutil

        shutil.rmtree(in_repo.parent, ignore_errors=True)
    marked = results_page.write_page([str(sweep)], tmp_path / "p.md", allow_dirty=True).read_text()
    assert "**Uncommitted code:** 1 run(s)" in marked
