"""Every run draws curves.png from its own files."""

from __future__ import annotations

import json

from grpo_exp.analysis.run_curves import write_curves


def test_curves_png_from_history_and_before_after(tmp_path):
    rows = [{"step": s, "reward": s / 10} for s in range(1, 11)] + [{"step": 10, "eval/basic/accuracy": 0.4}]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "before_after.json").write_text(json.dumps({
        "before": "base", "split": "test", "validation_before": {"set": "basic", "n": 50, "accuracy": 0.2},
        "sets": {"basic": {"n": 200, "before": 0.2, "after": 0.45}}}))
    path = write_curves(tmp_path)
    assert path == tmp_path / "curves.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_no_curves_without_logged_steps(tmp_path):
    (tmp_path / "history.jsonl").write_text("")
    assert write_curves(tmp_path) is None and not (tmp_path / "curves.png").exists()


def test_the_step_axis_says_cumulative_only_for_a_later_stage():
    from grpo_exp.analysis.plots import step_label

    one_stage = {"history": [{"step": 1, "global_step": 1}, {"step": 2}]}
    later_stage = {"history": [{"step": 1, "global_step": 91}]}
    assert step_label([one_stage]) == "step"
    assert step_label([one_stage, later_stage]) == "step (cumulative over stages)"
