"""A real GRPO run, end to end, on the tiny random model: TRL steps, outputs, reload."""

from __future__ import annotations

import gc
import json

import pytest

from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_exp.base.io import read_jsonl
from grpo_exp.training.trainer import GrpoExpTrainer
from grpo_exp.training.stage import train
from tests.conftest import run_module

METRIC_KEYS = {"steps", "step_time_s_median", "completion_tokens_per_s", "peak_rss_mb", "reward_mean_first",
               "reward_mean_last", "reward_correctness_mean", "reward_answer_format_mean", "wall_time_s"}


def test_two_step_run_writes_a_loadable_model_and_metrics(smoke_cfg):
    metrics = train(smoke_cfg)
    run_dir = smoke_cfg.paths.output_dir
    assert metrics["steps"] == 2 and metrics["status"] == "completed"
    # A curriculum runs stages in one process: nothing of a finished stage's trainer may stay alive.
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, GrpoExpTrainer)]
    on_disk = json.loads(open(f"{run_dir}/metrics.json").read())
    assert METRIC_KEYS <= on_disk.keys()
    assert on_disk["completion_tokens_per_s"] > 0 and on_disk["step_time_s_median"] > 0
    assert 100 < on_disk["peak_rss_mb"] < 16_000

    history = read_jsonl(f"{run_dir}/history.jsonl")
    assert [row["step"] for row in history] == [1, 2]
    assert all("rewards/correctness/mean" in row and "rss_mb" in row for row in history)
    samples = read_jsonl(f"{run_dir}/completions.jsonl")
    assert samples and {"prompt", "completion", "rewards"} <= samples[0].keys()

    model = AutoModelForCausalLM.from_pretrained(f"{run_dir}/model")
    tokenizer = AutoTokenizer.from_pretrained(f"{run_dir}/model")
    ids = tokenizer("What is 2 + 2?", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 4
    assert model.config.num_hidden_layers == smoke_cfg.model.tiny_layers


@pytest.mark.slow
def test_entrypoint_runs_as_a_user_would(tmp_path):
    run_dir = tmp_path / "cli_run"
    proc = run_module("grpo_exp.train", "debug=smoke", "train.max_steps=3", "train.save_steps=1",
                      "cpu.omp_wait_policy=passive", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 3
    # three saves, none left once the run completed (train.keep_final_checkpoint=false): model/ holds the weights
    assert not (run_dir / "checkpoints").exists() and not list(run_dir.glob("checkpoints*"))
    assert "train.keep_final_checkpoint=true keeps it" in (run_dir / "train.log").read_text()
    # set before torch loaded, so OpenMP ran with it (a late setting would warn and leave it unset)
    assert metrics["cpu_omp_wait_policy"] == "PASSIVE"
    assert metrics["cpu_malloc"] == "retain"  # cpu.malloc=auto on glibc
    assert "not applied" not in proc.stderr
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert (run_dir / "model" / "config.json").exists()
    # the model directory is plain safetensors, not a pickle
    assert list((run_dir / "model").glob("*.safetensors"))
    # the run draws its own picture and says where its files are
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"run files in {run_dir}" in proc.stdout + proc.stderr and "grpo-report" in proc.stdout + proc.stderr
    assert isinstance(metrics["git_commit"], str)
