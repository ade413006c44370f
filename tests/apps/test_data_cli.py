"""`python -m grpo_exp.data`: one split of a stage as JSONL, and its one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grpo_exp.apps.data import EXIT_BAD_INPUT, FIELDS, main
from grpo_exp.core import data


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_writes_the_split_training_and_evaluation_draw(tmp_path):
    out = tmp_path / "sub" / "test.jsonl"
    assert main(["stage=basic", "split=test", "limit=30", "train.seed=3", f"out={out}"]) == 0
    rows = read(out)
    assert len(rows) == 30 and all(tuple(r) == FIELDS for r in rows)
    # The held-out sets are cut by stage.split_seed (default 42), whatever the training seed.
    expected = data.build_examples("basic", "test", size=200, seed=42)[:30]
    assert [r["question"] for r in rows] == [e["question"] for e in expected]
    assert len({r["key"] for r in rows}) == 30 and {r["level"] for r in rows} == {"basic"}
    assert {r["template"] for r in rows} == {"add", "sub", "mul", "div"}
    train = tmp_path / "train.jsonl"
    assert main(["stage=basic", "split=train", "limit=30", "train.seed=3", f"out={train}"]) == 0
    expected = data.build_examples("basic", "train", size=2000, seed=42, sample_seed=3)[:30]
    assert [r["question"] for r in read(train)] == [e["question"] for e in expected]
    assert expected != data.build_examples("basic", "train", size=2000, seed=42, sample_seed=4)[:30]


def test_splits_share_no_computation(tmp_path):
    keys = {}
    for split in data.SPLITS:
        out = tmp_path / f"{split}.jsonl"
        assert main(["stage=intermediate", f"split={split}", "stage.num_train=300", f"out={out}"]) == 0
        keys[split] = {r["key"] for r in read(out)}
    assert len(keys["validation"]) == len(keys["test"]) == 200
    assert not keys["train"] & keys["validation"] and not keys["train"] & keys["test"]
    assert not keys["validation"] & keys["test"]


@pytest.mark.parametrize("args,needle", [
    (["stage=basics", "split=test"], "unknown stage option 'basics' (did you mean 'basic'?); valid choices: advanced, basic"),
    (["stage=basic", "split=dev"], "unknown split 'dev'; valid splits: train, validation, test"),
    (["stage=basic", "split=test", "limit=0"], "limit=0 must be a positive integer"),
    (["stage=basic"], "split= is missing"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "keep.jsonl"
    out.write_text("already here\n")
    assert main([*args, f"out={out}"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert out.read_text() == "already here\n"  # nothing already written is lost
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl"]


@pytest.mark.slow
def test_module_entrypoint_exits_2(tmp_path):
    out = tmp_path / "x.jsonl"
    result = subprocess.run([sys.executable, "-m", "grpo_exp.data", "stage=basic", "split=train2", f"out={out}"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_BAD_INPUT and "unknown split 'train2'" in result.stderr
    assert not out.exists()
