"""The continual study as one resumable command (`python -m grpo_exp.train -m experiment=continual`), end to end on
the tiny model: a study stopped after its first job continues with the rest when the same command runs again,
keeping the finished job's files and branching the next method off it; the same command with a changed setting is
one line naming it, and nothing already written changes."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_module

STUDY = ["-m", "experiment=continual", "debug=smoke", "train.seed=3", "train.max_steps=1", "logger=none",
         "curriculum.eval_limit=3", "curriculum.eval_batch_size=3", "eval.every_steps=null", "cpu.threads=1",
         "ewc.fisher_samples=4", "ewc.fisher_batch_size=4"]


def _files(job):
    """Every JSON file a job wrote but status.json, which keeps each attempt (checked apart), and its checkpoints'."""
    return {p.relative_to(job): p.read_bytes() for p in sorted(job.rglob("*.json"))
            if p.is_file() and p.name != "status.json" and "checkpoints" not in p.relative_to(job).parts}


@pytest.mark.slow
def test_a_method_with_fewer_seeds_skips_its_other_seeds_before_anything_loads(tmp_path):
    # experiment=continual runs replay on seeds 42, 1 and 2 only (curriculum.method_seeds): its seed-3 job ends at once
    sweep = tmp_path / "continual"
    done = run_module("grpo_exp.train", *STUDY, "method=replay", f"hydra.sweep.dir={sweep}",
                      env={"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    job = sweep / "seed3_replay"
    assert json.loads((job / "status.json").read_text())["status"] == "skipped"
    assert not _files(job) and not (job / "1_basic").exists()  # nothing trained, nothing scored
    assert "skipped: method=replay runs on train.seed 42, 1, 2 in this study" in done.stdout + done.stderr
    from grpo_exp.analysis import report, runs

    assert report.find_jobs(sweep) == [] and runs.find_runs(tmp_path) == []  # not a run to report


@pytest.mark.slow
def test_a_half_finished_study_continues_and_refuses_changed_settings(tmp_path):
    sweep = tmp_path / "continual"
    env = {"HF_HUB_OFFLINE": "1"}
    # the first job only: as a study stopped after it (the EWC job trains every stage and keeps its Fisher), and as
    # a version that kept each finished stage's checkpoint left it
    first = run_module("grpo_exp.train", *STUDY, "method=ewc", "train.keep_final_checkpoint=true",
                       f"hydra.sweep.dir={sweep}", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    ewc_job = sweep / "seed3_ewc"
    assert len(list(ewc_job.glob("*/checkpoints/checkpoint-*"))) == 2
    assert json.loads((ewc_job / "curriculum.json").read_text())["stages"] == ["basic", "intermediate"]
    finished = _files(ewc_job)

    # the whole command again: the finished job is kept as it was, the next method branches off its first stage
    again = run_module("grpo_exp.train", *STUDY, "method=ewc,grpo", f"hydra.sweep.dir={sweep}", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _files(ewc_job) == finished
    assert not list(sweep.rglob("checkpoints*"))  # the kept job's stages dropped theirs, the new job's never kept any
    # its status keeps the first attempt's wall time, the job minutes the report gives, beside the second's
    status = json.loads((ewc_job / "status.json").read_text())
    assert [a["status"] for a in status["attempts"]] == ["completed", "completed"]
    assert status["duration_s"] == pytest.approx(sum(a["duration_s"] for a in status["attempts"]))
    assert status["started"] == status["attempts"][0]["started"]
    grpo = json.loads((sweep / "seed3_grpo" / "curriculum.json").read_text())
    assert grpo["ewc_lambda"] == 0 and grpo["branched_from"]["stages"] == ["basic"]
    assert grpo["branched_from"]["dir"].endswith("seed3_ewc")
    both = {job: _files(sweep / job) for job in ("seed3_ewc", "seed3_grpo")}

    # a changed setting on the existing study: one line naming it, exit code 2, every file as it was
    changed = run_module("grpo_exp.train", *STUDY, "method=ewc,grpo", "train.learning_rate=1e-3",
                         f"hydra.sweep.dir={sweep}", env=env)
    assert changed.returncode != 0
    errors = [line for line in changed.stderr.splitlines() if "train.learning_rate" in line]
    assert errors and all("\n" not in e for e in errors), changed.stderr[-3000:]
    assert {job: _files(sweep / job) for job in both} == both
