"""Sweeps through Hydra launcher plugins (conf/hydra/launcher/): a real sweep on the tiny model through
joblib, submitit_local and Ray, each run as a user runs it (one subprocess), then grpo-report over its
sweep directory; and the one-line errors for an unknown launcher or one whose plugin is not installed.

Each sweep is `train.num_generations=2,3[,4]`: 3 does not divide the smoke batch of 4 completions, so that
job fails its checks inside the job (as a job fails on a cluster: `sweep_check=in_job`, which leaves each job's
checks to the job; by default the sweep is refused before any job starts) while the others train one step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from grpo_exp.apps.task import launcher_threads
from grpo_exp.base.errors import ConfigError
from grpo_exp.config.compose import check_overrides
from grpo_exp.training.tracking import offline_records
from tests.conftest import ROOT, run_module

CORES = len(os.sched_getaffinity(0))
PLUGIN_MODULES = {"joblib": "hydra_plugins.hydra_joblib_launcher.joblib_launcher",
                  "submitit_local": "hydra_plugins.hydra_submitit_launcher.submitit_launcher",
                  "ray": "hydra_plugins.hydra_ray_launcher.ray_launcher"}


def wandb_env(tmp) -> dict:
    return {"WANDB_MODE": "offline", "WANDB_DATA_DIR": str(tmp / "wb_data"), "WANDB_CACHE_DIR": str(tmp / "wb_cache"),
            "WANDB_CONFIG_DIR": str(tmp / "wb_config")}


def sweep(tmp_path_factory, launcher: str, generations: str, *extra: str):
    pytest.importorskip(PLUGIN_MODULES[launcher], reason=f"{launcher} plugin not installed: pip install -e '.[launchers]'")
    tmp = tmp_path_factory.mktemp(launcher)
    sweep_dir = tmp / f"{launcher}_gens"
    proc = run_module("grpo_exp.train", "-m", f"hydra/launcher={launcher}", "debug=smoke", "train.max_steps=1",
                      f"train.num_generations={generations}", "sweep_check=in_job", *extra,
                      f"hydra.sweep.dir={sweep_dir}",
                      timeout=400, env=wandb_env(tmp))
    return proc, sweep_dir


def report(sweep_dir) -> pd.DataFrame:
    out = sweep_dir / "report"
    proc = subprocess.run([sys.executable, "-m", "grpo_exp.apps.report", str(sweep_dir), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return pd.read_csv(out / "report.csv")


def check_jobs(proc, sweep_dir, generations: list[int], threads: int) -> None:
    """Every job left status.json; the failed one its error, the others one step of metrics."""
    assert proc.returncode != 0, "the failed job must make the sweep exit non-zero"
    for job, gens in enumerate(generations):
        job_dir = sweep_dir / str(job)
        status = json.loads((job_dir / "status.json").read_text())
        assert f"train.num_generations={gens}" in status["overrides"]
        if gens == 3:
            assert status["status"] == "failed" and "num_generations=3" in status["error"], status
            assert "ConfigError" in (job_dir / "error.txt").read_text()
            assert not (job_dir / "metrics.json").exists()
        else:
            assert status["status"] == "completed", (status, proc.stderr[-3000:])
            metrics = json.loads((job_dir / "metrics.json").read_text())
            # cpu.threads=auto: the job's share of the cores, not all of them (apps/task.share_cores)
            assert metrics["steps"] == 1 and metrics["cpu_threads"] == threads

    df = report(sweep_dir).sort_values("job")
    assert df["job"].astype(str).tolist() == [str(i) for i in range(len(generations))]  # nothing else is a job
    assert df["override:train.num_generations"].tolist() == generations
    assert df["status"].tolist() == ["failed" if g == 3 else "completed" for g in generations]
    assert df.loc[df["status"] == "failed", "error"].str.contains("num_generations=3").all()


@pytest.fixture(scope="module")
def joblib_sweep(tmp_path_factory):
    # 3 jobs on 2 workers: one worker runs two jobs in turn (a second wandb run in the same process)
    return sweep(tmp_path_factory, "joblib", "2,3,4", "logger=wandb")


@pytest.mark.slow
def test_joblib_sweep_runs_jobs_in_parallel_workers_and_reports_them(joblib_sweep):
    proc, sweep_dir = joblib_sweep
    check_jobs(proc, sweep_dir, [2, 3, 4], threads=max(1, CORES // min(2, CORES)))
    output = proc.stdout + proc.stderr
    assert "Joblib.Parallel(n_jobs=2" in output
    assert "is validated against ConfigStore schema" not in output  # the filtered Hydra 1.3 notice


@pytest.mark.slow
def test_wandb_offline_runs_inside_joblib_workers(joblib_sweep):
    _, sweep_dir = joblib_sweep
    for job in (0, 2):
        run_id = (sweep_dir / str(job) / "wandb_run_id.txt").read_text().strip()
        [run_file] = (sweep_dir / str(job)).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")
        records = {r.WhichOneof("record_type"): r for r in offline_records(run_file)}
        assert records["run"].run.run_group == f"sweep-{sweep_dir.name}"
        assert records["exit"].exit.exit_code == 0


@pytest.mark.slow
def test_submitit_local_sweep_keeps_its_folder_beside_the_jobs(tmp_path_factory):
    proc, sweep_dir = sweep(tmp_path_factory, "submitit_local", "2,3", "logger=none")
    check_jobs(proc, sweep_dir, [2, 3], threads=1)  # conf/hydra/launcher/submitit_local.yaml: cpus_per_task 1
    logs = sorted(p.name for p in (sweep_dir / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 2, logs  # submitit's own job logs, one per job


@pytest.mark.long  # ray starts a cluster of its own; the other launchers are make test's
def test_ray_sweep_runs_jobs_as_ray_tasks(tmp_path_factory):
    proc, sweep_dir = sweep(tmp_path_factory, "ray", "2,3", "logger=none")
    check_jobs(proc, sweep_dir, [2, 3], threads=1)  # conf/hydra/launcher/ray.yaml: remote.num_cpus 1
    assert "Ray Launcher is launching 2 jobs" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_unknown_launcher_is_one_line_with_the_choices(tmp_path):
    proc = run_module("grpo_exp.train", "-m", "hydra/launcher=slurm", "debug=smoke", f"hydra.sweep.dir={tmp_path / 's'}",
                      timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: unknown hydra/launcher option 'slurm'; valid choices: basic, joblib")
    assert "submitit_local" in lines[0] and "submitit_slurm" in lines[0]
    assert not (tmp_path / "s").exists()


def test_launcher_without_its_plugin_names_the_extra(monkeypatch):
    from hydra.core.plugins import Plugins

    Plugins.instance()  # Hydra's plugin scan happens first, as it would with the plugin absent
    # as if hydra-joblib-launcher were not installed: importing its launcher fails
    monkeypatch.setitem(sys.modules, PLUGIN_MODULES["joblib"], None)
    with pytest.raises(ConfigError) as err:
        check_overrides("train", ["-m", "hydra/launcher=joblib", "debug=smoke"])
    message = str(err.value)
    assert message.startswith("hydra/launcher=joblib needs the hydra-joblib-launcher plugin, which is not installed")
    assert message.endswith("pip install -e '.[launchers]'") and "\n" not in message


def test_threads_per_job_follow_the_launcher():
    joblib = {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"}
    assert launcher_threads({**joblib, "n_jobs": 2}, 8) == 4
    assert launcher_threads({**joblib, "n_jobs": 3}, 8) == 2
    assert launcher_threads({**joblib, "n_jobs": -1}, 8) == 1  # joblib: -1 is one job per core
    assert launcher_threads({**joblib, "n_jobs": -2}, 8) == 1  # all cores but one
    assert launcher_threads({**joblib, "n_jobs": 16}, 8) == 1
    submitit = "hydra_plugins.hydra_submitit_launcher.submitit_launcher."
    assert launcher_threads({"_target_": submitit + "LocalLauncher", "cpus_per_task": 2}, 8) == 2
    assert launcher_threads({"_target_": submitit + "SlurmLauncher", "cpus_per_task": None}, 8) is None
    ray = "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
    assert launcher_threads({"_target_": ray, "ray": {"remote": {"num_cpus": 4}}}, 8) == 4
    assert launcher_threads({"_target_": ray, "ray": {"remote": {}}}, 8) == 1
    assert launcher_threads({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"}, 8) is None


# the deprecation notice apps/task.py filters for the commands (pytest resets filters per test)
@pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/\w+' is validated against ConfigStore schema")
def test_submitit_slurm_settings_make_a_valid_sbatch_script(tmp_path, monkeypatch):
    """No cluster here: a stand-in `srun` lets submitit build the sbatch script from
    conf/hydra/launcher/submitit_slurm.yaml, mapping the keys as the plugin does."""
    pytest.importorskip(PLUGIN_MODULES["submitit_local"])
    import submitit
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf, open_dict

    import grpo_exp.config.schema  # noqa: F401  (registers the structured-config schemas)
    from grpo_exp.config.options import CONF_DIR

    (tmp_path / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=cpu",
                                "experiment=threads_batch"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.sweep.dir = str(tmp_path / "sweep")
        cfg.hydra.job.name = "train"
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert params.pop("_target_").endswith("SlurmLauncher")
    executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    for line in ("--partition=cpu", "--cpus-per-task=4", "--mem=8GB", "--time=180", "--job-name=train"):
        assert f"#SBATCH {line}\n" in script, script
    assert f"--output={tmp_path}/sweep/.submitit/%j/%j_0_log.out" in script
