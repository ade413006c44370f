"""grpo-bench --matrix (analysis/bench/matrix.py, memory.py, matrix_report.py): its options and bad input (one
line, exit code 2, nothing written), the memory estimate (by hand, and refusing a point no machine holds), a
matrix that keeps its measured points and continues a stopped one (children faked, as test_bench_page does), and
one real matrix of one point on the tiny random model."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from grpo_exp.analysis.bench import matrix, memory, parent
from grpo_exp.apps.bench import main, parse_args
from tests.analysis.test_bench_page import PNG, child
from tests.conftest import ROOT


def test_matrix_options_and_their_defaults():
    args = parse_args(["--matrix"])
    assert (args.models, args.lengths, args.groups) == (["smollm2_135m", "gemma3_270m"], [64, 256], [4, 16])
    args = parse_args(["--matrix", "--models", "tiny_random,org/name,tiny_random", "--lengths", "8, 16,8",
                       "--groups", "2", "--steps", "1", "--warmup", "0", "--rounds", "2"])
    assert (args.models, args.lengths, args.groups) == (["tiny_random", "org/name"], [8, 16], [2])
    point = matrix.point_args(args, "tiny_random", 8, 2, ["fp32"], ROOT / "x")
    # a point is a single-shape bench: its command measures it alone, with the matrix's passed options
    assert point.argv[:8] == ["--model", "tiny_random", "--max-completion-length", "8", "--num-generations", "2",
                              "--baseline", "fp32"]
    assert ["--steps", "1"] == point.argv[8:10] and "--rounds" in point.argv and "--beta" not in point.argv
    assert parse_args(point.argv).max_completion_length == 8
    assert not point.matrix and point.models is None
    single = parse_args([])  # without --matrix, the single shape's defaults as before
    assert (single.model, single.max_completion_length, single.num_generations) == ("smollm2_135m", 64, 4)
    assert matrix.point_name("org/name", 64, 4) == "org--name-L64-G4"


@pytest.mark.parametrize("argv, says", [
    (["--matrix", "--lengths", "0"], "argument --lengths: 0 in '0' is under 1"),
    (["--matrix", "--lengths=-5"], "argument --lengths: -5 in '-5' is under 1"),
    (["--matrix", "--lengths", "64,x"], "argument --lengths: 'x' in '64,x' is not an integer"),
    (["--matrix", "--lengths", "6.5"], "argument --lengths: '6.5' in '6.5' is not an integer"),
    (["--matrix", "--groups", "0"], "argument --groups: 0 in '0' is under 2: GRPO needs 2 or more"),
    (["--matrix", "--groups", "four"], "argument --groups: 'four' in 'four' is not an integer"),
    (["--matrix", "--models", "smolm2_135m"],
     "--models: smolm2_135m is not a conf/model option (did you mean 'smollm2_135m'?), a model directory or a hub id"),
    (["--matrix", "--models", "tiny_random,a/b/c"], "--models: a/b/c is not a conf/model option"),
    (["--matrix", "--model", "tiny_random"], "--matrix sets each point's model, length, group and baselines itself; "
                                             "leave out --model"),
    (["--matrix", "--baseline", "fp32", "--num-generations", "8"], "leave out --num-generations, --baseline"),
    (["--lengths", "64"], "--models, --lengths, --groups, --no-memory-check and --skip-over-memory belong to --matrix"),
])
def test_bad_matrix_input_is_one_line_and_runs_nothing(tmp_path, capsys, argv, says):
    out = tmp_path / "matrix"
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--out", str(out)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo-bench: error: ") and says in err, err
    assert not out.exists()


def test_the_memory_estimate_by_hand():
    smol = memory.shape_from_config(memory.KNOWN_SHAPES["smollm2_135m"])
    assert smol["params"] == 134_515_008  # the converted model's own count (bench.json's model_shape)
    assert 268e6 < memory.shape_from_config(memory.KNOWN_SHAPES["gemma3_270m"])["params"] < 269e6
    found = memory.estimate_mb(smol, rows=8, generation_rows=16, length=64, beta=0.0)
    mb = 1024.0 ** 2
    assert found["state_mb"] == round(4 * 134_515_008 * 4 / mb, 1)  # weights, gradients, Adam's two moments
    assert found["logits_mb"] == round(4 * 8 * 65 * 49152 / mb, 1)
    assert memory.estimate_mb(smol, 8, 16, 64, beta=0.04)["state_mb"] == round(5 * 4 * 134_515_008 / mb, 1)
    # the bench measured 3.6-4.2 GB at this shape (docs/log.md): on the high side, not far off
    assert 4000 < found["peak_mb"] < 6000
    # twice the rows: more than the state alone, less than twice the whole
    wider = memory.estimate_mb(smol, 16, 32, 64, 0.0)["peak_mb"]
    assert found["peak_mb"] < wider < 2 * found["peak_mb"]


def test_a_point_no_machine_holds_is_refused_before_any_model_loads(tmp_path, capsys):
    out = tmp_path / "matrix"
    code = main(["--matrix", "--models", "tiny_random", "--lengths", "8,100000", "--groups", "2,256",
                 "--out", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("grpo-bench: error: point tiny_random L100000 G256 needs about "), err  # the largest
    assert "give --no-memory-check" in err
    assert not out.exists()


def test_the_largest_point_over_the_memory_is_named(tmp_path):
    args = parse_args(["--matrix", "--models", "tiny_random", "--lengths", "8,64", "--groups", "2,4"])
    points = matrix.plan(args, tmp_path, ["fp32"], free_mb=1e9)
    peaks = {p.label: p.estimate["peak_mb"] for p in points}
    assert list(peaks) == ["tiny_random L8 G2", "tiny_random L8 G4", "tiny_random L64 G2", "tiny_random L64 G4"]
    assert max(peaks, key=peaks.get) == "tiny_random L64 G4"
    below = sorted(peaks.values())[1] + 0.05  # the two larger points are over
    with pytest.raises(matrix.MatrixError, match=r"^point tiny_random L64 G4 needs about .*; 2 points are over"):
        matrix.plan(args, tmp_path, ["fp32"], free_mb=below)
    args.skip_over_memory = True  # the points over are left out, each with its estimate; the others run
    states = {p.label: p.state for p in matrix.plan(args, tmp_path, ["fp32"], free_mb=below)}
    assert states == {"tiny_random L8 G2": "new", "tiny_random L8 G4": "new",
                      "tiny_random L64 G2": matrix.OVER_MEMORY, "tiny_random L64 G4": matrix.OVER_MEMORY}
    args.skip_over_memory, args.no_memory_check = False, True
    assert len(matrix.plan(args, tmp_path, ["fp32"], free_mb=below)) == 4


@pytest.fixture
def fake_children(monkeypatch):
    """parent.run as it is, its children and probes faked; returns the (point, variant) each child ran for."""
    ran = []

    def run_child(name, spec, out, round_no):
        ran.append((out.name, name))
        return child(name, spec["kind"], 0.5 if name == "grpo-exp" else 1.0)

    monkeypatch.setattr(parent, "run_child", run_child)
    monkeypatch.setattr(parent, "machine_limits", lambda threads: {"gemm_gflops": {"fp32": 10.0, "bf16": 20.0},
                                                                   "read_gb_s": 5.0, "threads": threads, "seconds": 0.1})
    monkeypatch.setattr(matrix, "available_mb", lambda: 1e9)
    return ran


def test_a_matrix_keeps_its_measured_points_and_continues_a_stopped_one(tmp_path, fake_children, monkeypatch, capsys):
    monkeypatch.setattr(matrix, "native_bf16", lambda: "fp32")
    out = tmp_path / "matrix"
    argv = ["--matrix", "--models", "tiny_random", "--lengths", "8", "--groups", "2,3", "--steps", "1", "--warmup",
            "0", "--out", str(out)]
    assert matrix.run_matrix(parse_args(argv[:6] + ["2"] + argv[7:])) == 0  # the first point alone
    assert fake_children == [("tiny_random-L8-G2", "baseline"), ("tiny_random-L8-G2", "grpo-exp")]
    fake_children.clear()

    calls = []

    def stopped(args):  # the second point is stopped (Ctrl-C) before its bench.json is written
        calls.append(args.num_generations)
        raise KeyboardInterrupt

    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        matrix.run_matrix(parse_args(argv), runner=stopped)
    assert calls == [3]  # the measured point was kept, not run again
    said = capsys.readouterr().out
    assert "point 1/2 tiny_random L8 G2: measured already" in said and "point 2/2 tiny_random L8 G3: start" in said

    assert matrix.run_matrix(parse_args(argv)) == 0  # the same command continues it
    assert fake_children == [("tiny_random-L8-G3", "baseline"), ("tiny_random-L8-G3", "grpo-exp")]
    said = capsys.readouterr().out
    assert said.count("this CPU has no native bf16") == 1 and "point 2/2 tiny_random L8 G3: done in" in said
    report = json.loads((out / "matrix.json").read_text())
    assert report["baselines"] == ["baseline"] and "trl-defaults" in report["skipped_baselines"]
    assert [p["point"] for p in report["points"]] == ["tiny_random-L8-G2", "tiny_random-L8-G3"]
    for p in report["points"]:
        assert p["status"] == "ok" and p["s_per_step"] == {"baseline": 1.0, "grpo-exp": 0.5}
        assert p["ratio"] == {"baseline": 2.0} and p["step_speedup"] == {"baseline": 2.0}
        assert p["rss_ratio"] == {"grpo-exp": 1.0} and p["x_floor"]["grpo-exp"] > 0
        assert p["probe"]["best"]["read_gb_s"] == 5.0 and p["estimate_mb"] > 0
    assert report["probe"]["readings"] == 8  # per point: before the variants, after each child, at the end
    assert report["machine_limits"]["gemm_gflops"]["fp32"] == 10.0
    rows = list(csv.DictReader((out / "matrix.csv").open()))
    assert [r["group"] for r in rows] == ["2", "3"] and rows[0]["ratio_vs_trl_fp32"] == "2.0"
    assert rows[0]["ratio_vs_trl_defaults"] == ""
    assert (out / "matrix.png").read_bytes()[:8] == PNG
    assert "| `tiny_random-L8-G3` | tiny_random | 8 | 3 | 0.50 | 1.00 | 2.00 |" in (out / "matrix.md").read_text()

    # another --steps into the same folder: refused, nothing run
    with pytest.raises(matrix.MatrixError, match="was measured with steps=1, this matrix asks steps=2"):
        matrix.run_matrix(parse_args([*argv, "--steps", "2"]))


def test_a_failed_point_runs_again_and_the_page_names_the_machine(tmp_path, fake_children, monkeypatch):
    monkeypatch.setattr(matrix, "native_bf16", lambda: "bf16")  # a CPU with native bf16: both baselines
    real, failed = parent.run_child, []

    def failing_once(name, spec, out, round_no):
        if name == "trl-defaults" and not failed:
            failed.append(name)
            return {"name": name, "kind": "trl", "overrides": [], "status": "failed", "returncode": 1, "wall_s": 1.0}
        return real(name, spec, out, round_no)

    monkeypatch.setattr(parent, "run_child", failing_once)
    out, page = tmp_path / "matrix", tmp_path / "docs" / "results" / "scale.md"
    argv = ["--matrix", "--models", "tiny_random", "--lengths", "8", "--groups", "2", "--out", str(out)]
    assert matrix.run_matrix(parse_args(argv)) == 1
    first = json.loads((out / "matrix.json").read_text())["points"][0]
    assert first["status"] == "failed" and first["failed"] == ["trl-defaults"]
    fake_children.clear()
    args = parse_args([*argv, "--page", str(page), "--machine", "box"])
    assert matrix.run_matrix(args) == 0
    assert [v for _, v in fake_children] == ["baseline", "trl-defaults", "grpo-exp"]
    report = json.loads((out / "matrix.json").read_text())
    assert report["skipped_baselines"] == {} and report["points"][0]["ratio"] == {"baseline": 2.0, "trl-defaults": 2.0}
    text = page.read_text()
    assert text.startswith("# Results: scale\n\n<!-- Written by grpo-bench --matrix from matrix.json")
    assert f"- **Matrix made by:** `grpo-bench {' '.join(args.argv)}`" in text
    assert "- **Machine:** box (" in text and "- **Commit:** `" in text and "points measured from " in text
    assert "GEMM peak fp32 10 GFLOP/s, bf16 20 GFLOP/s; memory read 5.0 GB/s" in text
    assert "| point | model | length | group | grpo-exp s/step | TRL fp32 s/step | TRL defaults s/step |" in text
    assert "left out" not in text and "![matrix](scale/matrix.png)" in text
    assert (page.parent / "scale" / "matrix.png").read_bytes()[:8] == PNG


@pytest.mark.slow  # one point, two child processes: about a minute on 2 busy cores
def test_a_matrix_of_one_point_on_the_tiny_model(tmp_path):
    """The real children end to end; more points, kept or continued, are the faked-children tests' above."""
    out = tmp_path / "matrix"
    command = [sys.executable, "-m", "grpo_exp.apps.bench", "--matrix", "--models", "tiny_random", "--lengths", "8",
               "--groups", "2", "--steps", "1", "--warmup", "0", "--prompts-per-step", "1", "--threads", "1",
               "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("[bench] matrix: point ") == 2  # a start and an end line
    report = json.loads((out / "matrix.json").read_text())
    assert [(p["group"], p["status"]) for p in report["points"]] == [(2, "ok")]
    for p in report["points"]:
        assert set(p["s_per_step"]) == {"grpo-exp", *report["baselines"]}
        assert p["ratio"]["baseline"] > 0 and p["x_floor"]["grpo-exp"] > 1 and p["peak_rss_mb"]["grpo-exp"] > 100
        assert p["rss_ratio"]["grpo-exp"] > 0
    assert len(list(csv.DictReader((out / "matrix.csv").open()))) == 1
    assert (out / "matrix.png").read_bytes()[:8] == PNG
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("measured already") == 1, again.stderr[-2000:]


def test_skip_over_memory_runs_the_rest_and_lists_what_it_left_out(tmp_path, fake_children, monkeypatch, capsys):
    monkeypatch.setattr(matrix, "native_bf16", lambda: "fp32")
    out, page = tmp_path / "matrix", tmp_path / "docs" / "results" / "scale.md"
    argv = ["--matrix", "--models", "tiny_random", "--lengths", "8,64", "--groups", "2", "--steps", "1", "--warmup",
            "0", "--out", str(out), "--page", str(page), "--machine", "box"]
    sizes = {p.length: p.estimate["peak_mb"] for p in matrix.plan(parse_args(argv), out, ["fp32"], free_mb=1e9)}
    monkeypatch.setattr(matrix, "available_mb", lambda: (sizes[8] + sizes[64]) / 2)  # the longer point is over
    with pytest.raises(matrix.MatrixError, match="--skip-over-memory"):
        matrix.run_matrix(parse_args(argv))
    capsys.readouterr()
    assert matrix.run_matrix(parse_args([*argv, "--skip-over-memory"])) == 0
    said = capsys.readouterr().out
    assert "tiny_random L64 G2: left out (--skip-over-memory)" in said
    assert "it runs (--no-memory-check)" not in said  # the point left out is not announced as running
    assert {point for point, _ in fake_children} == {"tiny_random-L8-G2"}
    report = json.loads((out / "matrix.json").read_text())
    assert [p["status"] for p in report["points"]] == ["ok", matrix.OVER_MEMORY]
    assert "| `tiny_random-L64-G2` | tiny_random | 64 | 2 | left out: over memory (estimated peak " in page.read_text()
