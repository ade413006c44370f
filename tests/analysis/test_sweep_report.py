"""A real Hydra multirun on the tiny model (one subprocess, 4 jobs: threads 1,2 x num_generations 2,3,
where 3 does not divide the batch of 4 and fails inside its job), then grpo-report on it."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

from grpo_exp.training.tracking import offline_history, offline_records
from tests.conftest import ROOT, run_module


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    sweep_dir = tmp / "threads_gens"
    env = {"WANDB_MODE": "offline", "WANDB_DATA_DIR": str(tmp / "wb_data"), "WANDB_CACHE_DIR": str(tmp / "wb_cache"),
           "WANDB_CONFIG_DIR": str(tmp / "wb_config")}
    # jobs 1 and 3 fail while training (a reward turns NaN at its first call: exit 3 for the job), the others
    # complete; a config error would now refuse the whole sweep before any job starts (tests/config/test_precheck.py)
    proc = run_module("tests.spread_reward_main", "-m", "debug=smoke", "cpu.threads=1,2",
                      "reward.funcs=[vowel_fraction],[vowel_fraction,nan_after]", "reward.weights=null",
                      "train.max_steps=1", "logger=wandb", f"hydra.sweep.dir={sweep_dir}", timeout=400,
                      env={**env, "GRPO_EXP_TEST_NAN_AFTER": "0"})
    return proc, sweep_dir


@pytest.fixture(scope="module")
def report(sweep):
    _, sweep_dir = sweep
    out = sweep_dir / "report"
    proc = subprocess.run([sys.executable, "-m", "grpo_exp.apps.report", str(sweep_dir), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return proc, out


@pytest.mark.slow
def test_failing_job_does_not_stop_the_sweep(sweep):
    proc, sweep_dir = sweep
    assert proc.returncode != 0, "a failed job must make the sweep exit non-zero"
    statuses = [json.loads((sweep_dir / str(i) / "status.json").read_text()) for i in range(4)]
    assert [s["status"] for s in statuses] == ["completed", "failed", "completed", "failed"], proc.stderr[-3000:]
    for i in (1, 3):
        assert "reward function 'nan_after' returned nan at step 1" in statuses[i]["error"]
        assert "TrainingHalted" in (sweep_dir / str(i) / "error.txt").read_text()
    for i in (0, 2):
        assert json.loads((sweep_dir / str(i) / "metrics.json").read_text())["steps"] == 1


@pytest.mark.slow
def test_report_has_a_row_per_job_and_plots(report):
    proc, out = report
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "completion_tokens_per_s" in proc.stdout  # the printed main table
    df = pd.read_csv(out / "report.csv")
    assert len(df) == 4
    done = df[df["status"] == "completed"].sort_values("override:cpu.threads")
    assert done["override:cpu.threads"].tolist() == [1, 2]
    assert done["override:reward.funcs"].tolist() == ["[vowel_fraction]", "[vowel_fraction]"]
    assert (done["steps"] == 1).all() and (done["completion_tokens_per_s"] > 0).all()
    assert (done["peak_rss_mb"] > 50).all() and done["reward_mean_last"].notna().all()
    failed = df[df["status"] == "failed"]
    assert len(failed) == 2 and failed["error"].str.contains("returned nan").all()
    # one step: it is the last fifth of the run, and the periodic evaluation ran after it (the last step)
    assert (done["reward_fifth_5"] == done["reward_mean_overall"]).all()
    assert done[[f"reward_fifth_{k}" for k in range(1, 5)]].isna().all().all()
    assert (done["split"] == "test").all() and done["validation_basic_accuracy_step_1"].between(0, 1).all()
    md = (out / "report.md").read_text()
    assert "Failed or unfinished jobs" in md and "Best variant per metric" in md
    assert "## Training reward by fifths of the run" in md
    assert "## Accuracy before and after training (test split)" in md
    for name in ("throughput_memory.png", "reward_curves.png", "learning_curve.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.slow
def test_offline_wandb_runs_hold_training_and_resource_metrics(sweep):
    _, sweep_dir = sweep
    for job, threads in ((0, 1), (2, 2)):
        run_dir = sweep_dir / str(job)
        run_id = (run_dir / "wandb_run_id.txt").read_text().strip()
        [run_file] = run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
        rows = offline_history(run_file)
        step_rows = [r for r in rows if "train/reward" in r]
        assert step_rows and step_rows[0]["train/global_step"] == 1
        assert {"resources/rss_mb", "resources/peak_rss_mb", "resources/step_time_s",
                "resources/cpu_percent/core0"} <= step_rows[0].keys()
        assert any("completions/_type" in r for r in rows)
        records = {r.WhichOneof("record_type"): r for r in offline_records(run_file)}
        assert records["run"].run.run_group == f"sweep-{sweep_dir.name}"
        assert f"threads:{threads}" in records["run"].run.tags and records["run"].run.job_type == "basic"
        assert records["exit"].exit.exit_code == 0


def _fake_job(path, overrides, config, files):
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (path / ".hydra" / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    for name, data in files.items():
        (path / name).write_text(json.dumps(data))


def test_report_eval_quantization_curriculum_and_missing_metrics(tmp_path):
    from grpo_exp.analysis.report import write_report

    sweep = tmp_path / "multirun"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("{}\n")
    ev = {"sets": {"basic": {"accuracy": 0.5, "tokens_per_s": 10.0, "model_size_mb": 500.0}}}
    ev8 = {"sets": {"basic": {"accuracy": 0.4, "tokens_per_s": 14.0, "model_size_mb": 200.0}}}
    _fake_job(sweep / "0", ["quantization=none"], {"quantization": {"method": "none"}}, {"eval.json": ev})
    _fake_job(sweep / "1", ["quantization=dynamic_int8"], {"quantization": {"method": "dynamic_int8"}},
              {"eval.json": ev8})
    curriculum = {"stages": ["basic", "intermediate"], "base": [0.1, 0.0], "matrix": [[0.6], [0.5, 0.3]],
                  "average_accuracy": 0.4, "bwt": -0.1, "forgetting_max": 0.1}
    _fake_job(sweep / "2", ["curriculum=progressive"], {}, {"curriculum.json": curriculum})
    stage2 = sweep / "2" / "2_intermediate"  # a later stage logs its forgetting of basic
    stage2.mkdir()
    (stage2 / "metrics.json").write_text(json.dumps({"status": "completed", "steps": 2}))
    (stage2 / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"global_step": 3, "forgetting/basic/kl": 0.5, "eval/basic/accuracy": 0.55},
        {"global_step": 4, "forgetting/basic/kl": 1.25, "eval/basic/accuracy": 0.5})))
    _fake_job(sweep / "3", ["train.max_steps=5"], {}, {})  # started, never wrote anything

    df, out = write_report([sweep])
    assert out == sweep and len(df) == 4
    assert df.set_index("job").loc["1", "eval_basic_accuracy"] == 0.4
    assert df.set_index("job").loc["2", "average_accuracy"] == 0.4
    assert df.set_index("job").loc["2", "forgetting_kl_basic"] == 1.25  # the KL at the end of the run
    assert df.set_index("job").loc["3", "status"] == "failed"
    for name in ("quantization.png", "curriculum_2.png", "forgetting_kl.png", "report.md", "report.csv"):
        assert (sweep / name).stat().st_size > 0
    assert "no metrics.json" in (sweep / "report.md").read_text()


def test_a_job_that_raises_leaves_status_and_traceback(tmp_path):
    from omegaconf import OmegaConf

    from grpo_exp.apps.task import record_status

    hydra_cfg = OmegaConf.create({"runtime": {"output_dir": str(tmp_path)}, "overrides": {"task": ["stage.path=x"]},
                                  "job": {"num": 3}})
    try:
        raise RuntimeError("dataset file is empty")
    except RuntimeError as err:
        record_status(hydra_cfg, "failed", 0.0, err)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == "dataset file is empty" and status["job_num"] == 3
    assert "RuntimeError: dataset file is empty" in (tmp_path / "error.txt").read_text()
    record_status(hydra_cfg, "completed", 0.0)  # resumed, and finished this time
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "completed"
    assert not (tmp_path / "error.txt").exists()
    assert "RuntimeError: dataset file is empty" in (tmp_path / "error.earlier.txt").read_text()


def _stage_two_job(path, lam, seed, basic, inter, kl):
    """A later stage trained from the basic stage's model and scored on both stages (eval.sets)."""
    def entry(before, after):
        return {"n": 200, "before": before, "after": after, "after_ci95": [after - 0.05, after + 0.05],
                "accuracy_diff_ci95": [after - before - 0.04, after - before + 0.04]}
    _fake_job(path, [f"ewc.lambda={lam}", f"train.seed={seed}"],
              {"stage": {"name": "intermediate"}, "ewc": {"lambda": lam}, "train": {"seed": seed}},
              {"metrics.json": {"status": "completed", "steps": 60},
               "before_after.json": {"before": "start", "sets": {"basic": entry(*basic), "intermediate": entry(*inter)}}})
    (path / "history.jsonl").write_text(json.dumps({"global_step": 60, "forgetting/basic/kl": kl}) + "\n")


def test_report_summarises_forgetting_per_ewc_lambda(tmp_path):
    from grpo_exp.analysis.report import write_report

    sweep = tmp_path / "ewc"
    _stage_two_job(sweep / "0", 0, 42, (0.46, 0.29), (0.01, 0.04), 8.0)
    _stage_two_job(sweep / "1", 0, 1, (0.50, 0.40), (0.02, 0.06), 6.0)
    _stage_two_job(sweep / "2", 100000, 42, (0.46, 0.46), (0.01, 0.005), 0.1)
    _stage_two_job(sweep / "3", 100000, 1, (0.50, 0.48), (0.02, 0.02), 0.3)

    write_report([sweep])
    per_job = pd.read_csv(sweep / "ewc_summary.csv")
    assert per_job["ewc_lambda"].tolist() == [0, 0, 100000, 100000]
    assert per_job["basic_forgetting"].round(3).tolist() == [0.1, 0.17, 0.02, 0.0]  # start - final, seed 1 first
    assert per_job["intermediate_gain"].round(3).tolist() == [0.04, 0.03, 0.0, -0.005]
    assert per_job["bwt"].round(3).tolist() == [-0.1, -0.17, -0.02, 0.0]
    assert per_job["basic_forgetting_ci95"].tolist()[:2] == ["[0.060, 0.140]", "[0.130, 0.210]"]
    means = pd.read_csv(sweep / "ewc_lambda_summary.csv").set_index("ewc_lambda")
    assert means["seeds"].tolist() == [2, 2]
    assert means["basic_forgetting"].round(3).tolist() == [0.135, 0.01]
    assert means.loc[0, "basic_forgetting_range"] == "0.100..0.170"
    assert means["forgetting_kl_basic"].round(3).tolist() == [7.0, 0.2]
    assert means["intermediate_final"].round(4).tolist() == [0.05, 0.0125]
    assert "## EWC: final accuracy, forgetting and KL per lambda" in (sweep / "report.md").read_text()
    png = (sweep / "ewc_lambda.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_report_has_no_ewc_section_without_earlier_stages(tmp_path):
    from grpo_exp.analysis.report import write_report

    sweep = tmp_path / "plain"
    for i, lam in enumerate((0, 1000)):
        _fake_job(sweep / str(i), [f"ewc.lambda={lam}"], {"ewc": {"lambda": lam}},
                  {"metrics.json": {"status": "completed", "steps": 2}})
    write_report([sweep])
    assert "## EWC" not in (sweep / "report.md").read_text() and not (sweep / "ewc_summary.csv").exists()


def test_report_scores_each_variant_over_seeds(tmp_path):
    from grpo_exp.analysis.report import write_report

    sweep = tmp_path / "recipes"
    scored = {("none", 42): (0.16, 0.485), ("none", 3): (0.16, 0.245), ("beta", 42): (0.16, 0.45),
              ("beta", 3): (0.16, 0.40)}
    for i, ((ablation, seed), (before, after)) in enumerate(scored.items()):
        _fake_job(sweep / str(i), [f"ablation={ablation}", f"train.seed={seed}"], {"train": {"seed": seed}},
                  {"metrics.json": {"status": "completed", "steps": 90},
                   "eval.json": {"sets": {"basic": {"accuracy": after, "n": 200}}},
                   "before_after.json": {"split": "validation",
                                         "sets": {"basic": {"before": before, "after": after,
                                                            "accuracy_diff": after - before}}}})
    _fake_job(sweep / "4", ["ablation=beta", "train.seed=1"], {"train": {"seed": 1}},
              {"status.json": {"status": "failed", "error": "ConfigError: x"}})

    write_report([sweep])
    table = pd.read_csv(sweep / "seed_summary.csv").set_index("variant")
    assert table.index.tolist() == ["ablation=beta", "ablation=none"]  # the higher mean first; the failed job left out
    assert table["seeds"].tolist() == [2, 2] and table.loc["ablation=none", "seed_list"] == "3 42"
    assert table.loc["ablation=none", "eval_basic_accuracy_mean"] == pytest.approx(0.365)
    assert table.loc["ablation=beta", "eval_basic_accuracy_min"] == pytest.approx(0.40)
    assert table.loc["ablation=none", "eval_basic_diff_max"] == pytest.approx(0.325)
    assert "## Each variant over seeds" in (sweep / "report.md").read_text()


def test_runs_with_no_lever_are_one_variant_over_seeds(tmp_path):
    """Single runs of the default recipe beside runs of a lever (as a device screen makes them, each with its
    own seed): the default's runs form one row, not one row per run."""
    from grpo_exp.analysis.report import write_report

    runs = tmp_path / "screen"
    scored = {("", 42): 0.39, ("", 1): 0.415, ("train.lr_scheduler_type=linear", 42): 0.50,
              ("train.lr_scheduler_type=linear", 1): 0.555}
    for i, ((lever, seed), after) in enumerate(scored.items()):
        _fake_job(runs / f"run{i}", [*([lever] if lever else []), f"train.seed={seed}"], {"train": {"seed": seed}},
                  {"metrics.json": {"status": "completed", "steps": 90},
                   "eval.json": {"config": {"split": "validation"}, "sets": {"basic": {"accuracy": after, "n": 200}}}})
    write_report([runs])
    table = pd.read_csv(runs / "seed_summary.csv").set_index("variant")
    assert table.index.tolist() == ["train.lr_scheduler_type=linear", "(defaults)"]
    assert table["seeds"].tolist() == [2, 2] and table.loc["(defaults)", "seed_list"] == "1 42"
    assert table.loc["(defaults)", "eval_basic_accuracy_mean"] == pytest.approx(0.4025)


def test_report_has_no_seed_section_for_one_seed(tmp_path):
    from grpo_exp.analysis.report import write_report

    sweep = tmp_path / "one_seed"
    for i, ablation in enumerate(("none", "beta")):
        _fake_job(sweep / str(i), [f"ablation={ablation}"], {"train": {"seed": 42}},
                  {"metrics.json": {"status": "completed", "steps": 90},
                   "eval.json": {"sets": {"basic": {"accuracy": 0.4, "n": 200}}}})
    write_report([sweep])
    assert not (sweep / "seed_summary.csv").exists() and "over seeds" not in (sweep / "report.md").read_text()
