"""curriculum.branch_from: a curriculum takes the finished stages it shares with another run (same settings up
to them) instead of training them again, and refuses a run it shares nothing with, before any model loads."""

from __future__ import annotations

import json
import os

import pytest

from grpo_exp.base.errors import ConfigError
from grpo_exp.training.curriculum import record, sequential
from grpo_exp.training.run_dir import SETTINGS_FILE, training_settings
from tests.conftest import compose_cfg

STAGES = ["basic", "intermediate"]
BASE = ["logger=none", "curriculum=progressive", "curriculum.eval_limit=2"]


@pytest.fixture
def stubbed(monkeypatch):
    """run_curriculum with training and scoring stubbed: a "trained" stage writes what a finished one has (its
    model's config, metrics.json, its training settings); returns the stages trained, in order."""
    trained = []

    def fake_train(cfg, step_offset=0, pools=None):
        out = cfg.paths.output_dir
        os.makedirs(f"{out}/model", exist_ok=True)
        with open(f"{out}/model/config.json", "w") as fh:
            fh.write("{}")
        with open(f"{out}/model/model.safetensors", "wb") as fh:
            fh.write(os.urandom(2 << 20))  # large enough to be linked, not copied
        with open(f"{out}/metrics.json", "w") as fh:
            json.dump({"status": "completed", "stage": cfg.stage.name}, fh)
        with open(f"{out}/{SETTINGS_FILE}", "w") as fh:
            json.dump(training_settings(cfg), fh)
        if cfg.ewc["lambda"] > 0:
            open(f"{out}/fisher.safetensors", "w").close()
        os.makedirs(f"{out}/checkpoints/checkpoint-1", exist_ok=True)
        trained.append((cfg.stage.name, cfg.ewc["lambda"], cfg.curriculum.replay, cfg.init_from))
        return {"steps": 1, "reward_mean_first": 0.0, "reward_mean_last": 0.0}

    def fake_scores(model_cfg, cache_dir, model_dir, stage_cfgs, limit, batch_size, seed):
        mark = 1 if model_dir else 0  # the base model gets all wrong, a trained one all right
        return [({"accuracy": float(mark)}, [mark] * limit) for _ in stage_cfgs]

    monkeypatch.setattr(sequential, "train", fake_train)
    monkeypatch.setattr(record, "evaluate_dir", fake_scores)
    monkeypatch.setattr(sequential.cpu, "apply", lambda cpu_cfg: {})
    return trained


def run(overrides, out):
    return sequential.run_curriculum(compose_cfg(overrides, out), overrides)


def test_another_method_on_the_same_seed_takes_the_first_stage_and_trains_the_second(tmp_path, stubbed):
    run([*BASE, "ewc.lambda=1000"], tmp_path / "ewc")
    stubbed.clear()
    branch = [*BASE, "ewc.lambda=0", "curriculum.replay=0.2", f"curriculum.branch_from={tmp_path / 'ewc'}"]
    result = run(branch, tmp_path / "replay")
    # only the second stage trained, from the first stage's model now in this run's directory
    assert [t[:3] for t in stubbed] == [("intermediate", 0.0, 0.2)]
    assert stubbed[0][3] == str(tmp_path / "replay" / "1_basic")
    taken, source = tmp_path / "replay" / "1_basic", tmp_path / "ewc" / "1_basic"
    assert os.path.samefile(taken / "model" / "model.safetensors", source / "model" / "model.safetensors")
    assert not (taken / "checkpoints").exists()
    saved = json.loads((tmp_path / "replay" / "curriculum.json").read_text())
    assert saved["branched_from"] == {"dir": str(tmp_path / "ewc"), "stages": ["basic"]}
    assert saved["stage_metrics"][0]["dir"] == str(taken)
    assert saved["base"] == [0.0, 0.0] and saved["matrix"] == [[1.0, 1.0], [1.0, 1.0]]
    assert [g["stage"] for g in result["stage_gains"]] == STAGES
    # the source is left as it was
    assert len(json.loads((tmp_path / "ewc" / "curriculum.json").read_text())["matrix"]) == 2


def test_a_branch_that_is_resumed_does_not_branch_again(tmp_path, stubbed):
    run([*BASE, "ewc.lambda=1000"], tmp_path / "ewc")
    branch = [*BASE, "ewc.lambda=0", f"curriculum.branch_from={tmp_path / 'ewc'}"]
    run(branch, tmp_path / "plain")
    stubbed.clear()
    result = run([*branch, "resume=true"], tmp_path / "plain")
    assert stubbed == [] and result["branched_from"]["stages"] == ["basic"]


def test_the_same_settings_share_every_finished_stage(tmp_path, stubbed):
    run([*BASE, "ewc.lambda=1000"], tmp_path / "a")
    stubbed.clear()
    run([*BASE, "ewc.lambda=1000", f"curriculum.branch_from={tmp_path / 'a'}"], tmp_path / "b")
    assert stubbed == []


def test_a_first_stage_without_the_fisher_this_run_needs_is_not_shared(tmp_path, stubbed):
    run([*BASE, "ewc.lambda=0"], tmp_path / "plain")
    with pytest.raises(ConfigError, match=r"shares no finished stage.*ewc\.lambda \(0\.0 -> 1000\.0\)"):
        run([*BASE, "ewc.lambda=1000", f"curriculum.branch_from={tmp_path / 'plain'}"], tmp_path / "ewc")


@pytest.mark.parametrize("change, named", [
    ("train.learning_rate=1e-4", r"shares no finished stage.*train\.learning_rate"),
    ("train.seed=7", r"other settings: seed \(42 -> 7\)"),
    ("curriculum.eval_batch_size=5", r"other settings: eval_batch_size \(\d+ -> 5\)"),
])
def test_a_run_that_trained_the_first_stage_otherwise_is_refused_in_one_line(tmp_path, stubbed, change, named):
    run([*BASE, "ewc.lambda=1000"], tmp_path / "a")
    stubbed.clear()
    with pytest.raises(ConfigError, match=named) as err:
        run([*BASE, change, f"curriculum.branch_from={tmp_path / 'a'}"], tmp_path / "b")
    assert "\n" not in str(err.value) and stubbed == []
    assert not (tmp_path / "b" / "curriculum.json").exists()


def test_a_directory_without_a_curriculum_is_refused(tmp_path, stubbed):
    with pytest.raises(ConfigError, match=r"curriculum\.branch_from=.* holds no curriculum\.json"):
        run([*BASE, f"curriculum.branch_from={tmp_path}"], tmp_path / "b")


def test_branch_from_needs_a_sequential_curriculum(tmp_path):
    from grpo_exp.config.checks import validate

    with pytest.raises(ConfigError, match=r"curriculum\.branch_from=x takes the first stages"):
        validate(compose_cfg(["logger=none", "curriculum.branch_from=x"], tmp_path))


def test_branch_from_missing_train_trains_every_stage_where_there_is_nothing_to_take(tmp_path, stubbed):
    """A sweep's jobs all name one job of the seed as their source: that job (its own directory) trains every stage,
    as does a job whose source has no record yet or trained its first stage otherwise; a source that finished
    first is taken from."""
    source = tmp_path / "ewc"
    lenient = ["curriculum.branch_from_missing=train", f"curriculum.branch_from={source}"]
    run([*BASE, "ewc.lambda=1000", *lenient], source)  # the source itself
    assert [t[0] for t in stubbed] == STAGES
    stubbed.clear()
    run([*BASE, "ewc.lambda=0", *lenient], tmp_path / "plain")  # the source finished: its first stage is taken
    assert [t[0] for t in stubbed] == ["intermediate"]
    stubbed.clear()
    run([*BASE, "train.learning_rate=1e-4", *lenient], tmp_path / "other")  # shares nothing: trains both
    assert [t[0] for t in stubbed] == STAGES
    assert "branched_from" not in json.loads((tmp_path / "other" / "curriculum.json").read_text())
    stubbed.clear()
    nothing = ["curriculum.branch_from_missing=train", f"curriculum.branch_from={tmp_path / 'not_yet'}"]
    run([*BASE, *nothing], tmp_path / "early")  # the source has not started
    assert [t[0] for t in stubbed] == STAGES


def test_branch_from_missing_does_not_excuse_a_source_of_another_seed(tmp_path, stubbed):
    run([*BASE, "ewc.lambda=1000"], tmp_path / "a")
    with pytest.raises(ConfigError, match=r"other settings: seed \(42 -> 7\)"):
        run([*BASE, "train.seed=7", "curriculum.branch_from_missing=train",
             f"curriculum.branch_from={tmp_path / 'a'}"], tmp_path / "b")


def test_branch_from_missing_is_checked(tmp_path):
    from grpo_exp.config.checks import validate

    with pytest.raises(ConfigError, match=r"curriculum\.branch_from_missing.*'skip'.*error, train"):
        validate(compose_cfg(["logger=none", "curriculum=progressive", "curriculum.branch_from_missing=skip"], tmp_path))


def test_a_resumed_curriculum_refuses_finished_stages_of_other_settings(tmp_path, stubbed):
    """Rerunning a study's command with other settings on its directory: one line naming them, nothing trained or
    overwritten; the same settings keep every finished stage."""
    run([*BASE, "ewc.lambda=1000", "resume=true"], tmp_path / "a")
    stubbed.clear()
    before = (tmp_path / "a" / "curriculum.json").read_text()
    with pytest.raises(ConfigError, match=r"resume: stage 1 \(basic\) .* other settings .*train\.learning_rate") as err:
        run([*BASE, "ewc.lambda=1000", "resume=true", "train.learning_rate=1e-4"], tmp_path / "a")
    assert "\n" not in str(err.value) and stubbed == []
    assert (tmp_path / "a" / "curriculum.json").read_text() == before
    run([*BASE, "ewc.lambda=1000", "resume=true"], tmp_path / "a")
    assert stubbed == []
