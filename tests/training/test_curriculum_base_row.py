"""The base row of a curriculum (the start model on every stage's held-out problems) is scored once per sweep: a
job takes it from a sibling job whose base_key matches (the same code, start model, problems and decoding settings),
and scores it itself where anything of these differs. The scoring is replaced by a counter: what is tested is
which job scores and which takes."""

from __future__ import annotations

import pytest

from grpo_exp.base.io import write_json
from grpo_exp.base.run_files import CURRICULUM_FILE
from grpo_exp.training.curriculum import record
from grpo_exp.training.curriculum.sequential import _stage_config
from tests.conftest import compose_cfg


@pytest.fixture
def scored(monkeypatch):
    """The jobs' directories whose base row was scored (not taken), in order; a committed code version."""
    calls = []

    def evaluate_dir(model_cfg, cache_dir, model_dir, stage_cfgs, limit, batch_size, seed):
        calls.append(seed)
        return [({"accuracy": 0.5}, [1, 0] * (limit // 2)) for _ in stage_cfgs]

    monkeypatch.setattr(record, "evaluate_dir", evaluate_dir)
    monkeypatch.setattr(record, "AT_START", "abc1234")
    return calls


def _job(sweep, name: str, *overrides: str) -> dict:
    """score_base for one job of `sweep` (its curriculum.json written, as the job writes it after its first stage)."""
    user = ["curriculum=progressive", "curriculum.eval_limit=4", "logger=none", *overrides]
    root = sweep / name
    cfg = compose_cfg(user, root)
    stages = list(cfg.curriculum.stages)
    stage_cfgs = [_stage_config(cfg, user, stages, i, root) for i in range(len(stages))]
    result = record.new_result(cfg, stages)
    record.score_base(cfg, stage_cfgs, None, result)
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / CURRICULUM_FILE, result)
    return result


def test_the_seeds_of_a_sweep_score_the_packaged_start_model_once(tmp_path, scored):
    first = _job(tmp_path, "seed42", "train.seed=42")
    second = _job(tmp_path, "seed1", "train.seed=1")
    assert scored == [42]
    assert second["base"] == first["base"] and second["correct"]["base"] == first["correct"]["base"]
    assert second["base_from"] == "seed42" and "base_from" not in first
    assert second["base_key"] == first["base_key"] is not None


@pytest.mark.parametrize("change", ["curriculum.eval_limit=2", "train.max_completion_length=24",
                                    "curriculum.eval_batch_size=8", "model=gemma3_270m"])
def test_a_job_scores_its_own_base_row_where_the_problems_settings_or_model_differ(tmp_path, scored, change):
    _job(tmp_path, "seed42", "train.seed=42")
    other = _job(tmp_path, "other", "train.seed=1", change)
    assert scored == [42, 1] and "base_from" not in other


def test_a_randomly_initialised_model_is_another_model_under_another_seed(tmp_path, scored):
    _job(tmp_path, "a", "model=tiny_random", "train.seed=42")
    _job(tmp_path, "b", "model=tiny_random", "train.seed=1")
    _job(tmp_path, "c", "model=tiny_random", "train.seed=42")
    assert scored == [42, 1]


def test_uncommitted_code_takes_nothing_and_offers_nothing(tmp_path, scored, monkeypatch):
    monkeypatch.setattr(record, "AT_START", "abc1234 (with uncommitted changes, diff 0123)")
    first = _job(tmp_path, "seed42", "train.seed=42")
    _job(tmp_path, "seed1", "train.seed=1")
    assert scored == [42, 1] and first["base_key"] is None


def test_a_start_directory_is_named_by_its_files(tmp_path, scored):
    start = tmp_path / "start"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"weights")
    _job(tmp_path / "sweep", "seed42", f"init_from={start}", "train.seed=42")
    _job(tmp_path / "sweep", "seed1", f"init_from={start}", "train.seed=1")
    (start / "model.safetensors").write_bytes(b"other weights")
    _job(tmp_path / "sweep", "seed2", f"init_from={start}", "train.seed=2")
    assert scored == [42, 2]
