"""Run files: a publish killed at any step leaves one complete copy once repaired; JSONL reading."""

from __future__ import annotations

import json

import pytest

from grpo_exp.base import io


class Killed(BaseException):
    """Stands for SIGKILL at a step: nothing after it runs, no clean-up either."""


def _dir(path, content: str):
    path.mkdir(parents=True)
    (path / "weights.bin").write_text(content)
    (path / "config.json").write_text(json.dumps({"v": content}))
    return path


def _copies(root):
    return sorted(p.name for p in root.iterdir())


@pytest.mark.parametrize("kill_at,expected", [(None, "new"), ("retired", "old"), ("published", "new")])
def test_publish_killed_at_any_step_repairs_to_exactly_one_complete_copy(tmp_path, monkeypatch, kill_at, expected):
    final = _dir(tmp_path / "model", "old")
    staging = _dir(tmp_path / ".staging-model", "new")

    def hook(step, where):
        if step == kill_at:
            raise Killed

    monkeypatch.setattr(io, "publish_fault_hook", hook)
    try:
        io.publish_dir(staging, final)
    except Killed:
        # at every moment one complete copy exists: at model/ or at model.retired/
        assert any((p / "weights.bin").is_file() and (p / "config.json").is_file()
                   for p in (final, io.retired_dir(final)) if p.exists())
    io.repair_publish(final)
    assert [p for p in _copies(tmp_path) if p.startswith("model")] == ["model"]
    assert (final / "weights.bin").read_text() == expected and json.loads((final / "config.json").read_text()) == {
        "v": expected}


def test_publish_into_an_empty_place_and_repair_of_nothing(tmp_path):
    staging = _dir(tmp_path / "s", "new")
    io.publish_dir(staging, tmp_path / "model")
    assert _copies(tmp_path) == ["model"] and io.repair_publish(tmp_path / "model") is None


def test_read_jsonl_strict_and_tolerant(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "cut sh')
    with pytest.raises(ValueError):
        io.read_jsonl(path)
    assert io.read_jsonl(path, tolerant=True) == [{"step": 1}, {"step": 2}]
    assert io.read_jsonl(tmp_path / "missing.jsonl") == []


class _Disk:
    def __init__(self, free):
        self.free = free


@pytest.mark.parametrize("err,free,needed,full", [
    (OSError(28, "No space left on device"), 10 * 2**30, 2**20, True),  # ENOSPC: full, whatever df says
    (RuntimeError("unexpected pos 1756446336 vs 1756446228"), 2**20, 2**30, True),  # torch's own words
    (PermissionError(13, "Permission denied"), 2**20, 2**10, False),  # 1 MB free is enough for this write: not why it failed
    (RuntimeError("unexpected pos 1 vs 2"), 10 * 2**30, 2**30, False),  # plenty of room: not a full disk
])
def test_a_save_error_is_a_full_disk_only_when_it_is_one(tmp_path, monkeypatch, err, free, needed, full):
    monkeypatch.setattr(io.shutil, "disk_usage", lambda path: _Disk(free))
    reason = io.disk_full_reason(err, tmp_path / "checkpoint-4", needed)
    assert (reason is not None) == full
    if full:
        assert "checkpoint-4 not written: the disk holding" in reason and "\n" not in reason
