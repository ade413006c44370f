"""The two_step gap page's figures: pooled sampled correctness of training rounds, evaluate's pass@1, and the
command's one-line refusals."""

import json

import pytest

from grpo_exp.analysis import sampling_gap
from grpo_exp.apps import sampling_gap as app


def _job(rounds: list[float], lengths: list[float] | None = None) -> dict:
    history = [{"step": 2 * i + 1, sampling_gap.ROUND_KEY: c, "completions/mean_length": (lengths or [10.0] * 99)[i]}
               for i, c in enumerate(rounds)]
    history += [{"step": 2 * i + 2, "loss": 0.1} for i in range(len(rounds))]  # the round's second step logs none
    return {"history": history, "row": {"dir": "run"}}


def test_run_figures_pool_every_round_over_its_completions():
    f = sampling_gap.run_figures(_job([0.0, 0.25, 0.5], [10.0, 20.0, 30.0]), per_round=32)
    assert f["rounds"] == 3 and f["samples"] == 96
    assert f["correctness"] == pytest.approx(24 / 96)
    assert f["first"] == 0.0 and f["by_third"] == [0.0, 0.25, 0.5]
    assert f["ci"][0] < f["correctness"] < f["ci"][1]
    assert f["length"] == pytest.approx(20.0)


def test_run_without_rounds_is_refused():
    with pytest.raises(ValueError, match="logged no rewards/correctness/mean"):
        sampling_gap.run_figures({"history": [{"loss": 1.0}], "row": {"dir": "x"}}, per_round=32)


def _eval_dir(tmp_path, sampled: bool):
    stage = {"n": 10, "accuracy": 0.2, "mean_completion_tokens": 12.0}
    if sampled:
        stage.update(sampled_pass_at_1=0.15, sampled_pass_at_1_ci95=[0.1, 0.2], pass_samples=8, pass_temperature=0.8,
                     pass_at_k={"1": 0.15, "8": 0.4}, pass_at_k_ci95={"1": [0.1, 0.2], "8": [0.3, 0.5]})
    (tmp_path / "eval.json").write_text(json.dumps({"config": {"split": "validation"}, "sets": {"two_step": stage}}))
    return tmp_path


def test_eval_figures_read_pass1_pass_k_and_their_intervals(tmp_path):
    ev = sampling_gap.eval_figures(_eval_dir(tmp_path, sampled=True))
    assert (ev["stage"], ev["pass1"], ev["samples"], ev["split"]) == ("two_step", 0.15, 80, "validation")
    assert ev["pass_k"] == {8: (0.4, [0.3, 0.5])}
    assert sampling_gap._pass_k(ev) == ", pass@8 0.400 [0.300, 0.500]"  # the page's line about the evaluation


def test_greedy_only_evaluation_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"eval.pass_k=\[1,k\]"):
        sampling_gap.eval_figures(_eval_dir(tmp_path, sampled=False))


def test_cli_refuses_a_folder_without_eval_json_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        app.main(["--eval", str(tmp_path), "--runs", str(tmp_path), "--page", str(tmp_path / "p.md")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "has no eval.json" in err and str(tmp_path) in err
