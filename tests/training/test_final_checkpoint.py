"""A completed stage keeps model/ and drops checkpoints/ (train.keep_final_checkpoint=false), also when a rerun finds
a stage an earlier version finished with its checkpoint; a kill during the removal leaves no checkpoint that looks
whole. The end-to-end run (tests/apps/test_train_e2e.py) checks the same through the entrypoint."""

import json

import pytest

from grpo_exp.training import checkpoints
from grpo_exp.training.run_dir import REMOVED_SUFFIX, drop_checkpoints, open_run_dir
from tests.conftest import compose_cfg


def _finished_stage(run_dir):
    """A run directory as a completed stage leaves it, with its final checkpoint still in place."""
    ckpt = run_dir / "checkpoints" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "optimizer.pt").write_bytes(b"\0" * 1024)
    (run_dir / "model").mkdir()
    (run_dir / "model" / "config.json").write_text("{}")
    (run_dir / "metrics.json").write_text(json.dumps({"status": "completed", "stage": "basic", "steps": 4}))
    return ckpt


def test_dropping_removes_the_checkpoints_and_a_removal_a_kill_cut_short(tmp_path):
    _finished_stage(tmp_path)
    half_removed = tmp_path / ("checkpoints" + REMOVED_SUFFIX) / "checkpoint-2"
    half_removed.mkdir(parents=True)
    drop_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "model"]
    drop_checkpoints(tmp_path)  # nothing left to remove is no error
    assert (tmp_path / "model" / "config.json").is_file()


def test_a_kill_during_the_removal_leaves_no_checkpoint_resume_would_take(tmp_path):
    _finished_stage(tmp_path)
    (tmp_path / "checkpoints").rename(tmp_path / ("checkpoints" + REMOVED_SUFFIX))  # killed after the rename
    assert checkpoints.last_checkpoint(tmp_path / "checkpoints") is None


@pytest.mark.parametrize("keep", [False, True])
def test_a_rerun_of_a_finished_stage_drops_its_checkpoint_unless_told_to_keep_it(tmp_path, keep):
    ckpt = _finished_stage(tmp_path / "run")
    cfg = compose_cfg(["debug=smoke", "resume=true", f"train.keep_final_checkpoint={str(keep).lower()}"], tmp_path)
    finished, resume_from = open_run_dir(cfg, tmp_path / "run", plan=None)
    assert finished["status"] == "completed" and resume_from is None
    assert ckpt.is_dir() == keep
    assert (tmp_path / "run" / "model" / "config.json").is_file()
