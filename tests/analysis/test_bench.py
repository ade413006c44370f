"""grpo-bench's floor (machine limits, the step's FLOPs and weight bytes) and its trl-defaults baseline. No timing
assertions beyond 'measured and positive'."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from grpo_exp.analysis.bench import child, floor, parent, tables
from tests.conftest import ROOT


def test_machine_limits_are_measured_in_seconds():
    limits = floor.machine_limits(threads=1, size=256, reps=1)
    assert limits["gemm_gflops"]["fp32"] > 0 and limits["gemm_gflops"]["bf16"] > 0
    assert limits["read_gb_s"] > 0 and limits["seconds"] < 30


def synthetic(step_s: float) -> dict:
    """A bench result: 2 measured steps of one generation round (steps_per_generation 2) of 16 rows."""
    return {"steps": [{"measured": True, "tokens": 640.0, "max_length": 50},
                      {"measured": True, "tokens": 0.0}],
            "completion_tokens": 640.0, "step_time_s_mean": step_s,
            "settings": {"steps_per_generation": 2, "generation_batch_size": 16, "num_generations": 4,
                         "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                         "max_completion_length": 64},
            "model_shape": {"matmul_params": 100_000_000, "prompt_tokens_mean": 40.0}}


def test_step_floor_by_hand():
    limits = {"gemm_gflops": {"fp32": 100.0, "bf16": 400.0}, "read_gb_s": 20.0}
    found = floor.step_floor(synthetic(10.0), limits)
    n, peak, bw = 1e8, 400e9, 20e9
    train = 6 * n * (640 / 2 + 40 * 8 / 4) / peak  # a round's 640 tokens over its 2 steps; 2 distinct prompts
    decode = 50 * max(2 * n / bw, 2 * n * 16 / peak)  # bf16 weights: 2 bytes
    prefill = 2 * n * 40 * 16 / 4 / peak  # 4 distinct prompts per round
    expected = train + (prefill + decode) / 2
    assert found["dtype"] == "bf16" and found["decode_bound"] == "memory"  # 10 ms read vs 8 ms of FLOPs
    assert found["floor_s"] == pytest.approx(expected, rel=1e-3)
    assert found["multiple"] == pytest.approx(10.0 / expected, rel=1e-2)
    # where bf16 is emulated (slower than fp32), the floor uses fp32's peak and 4-byte weights
    slow_bf16 = floor.step_floor(synthetic(10.0), {"gemm_gflops": {"fp32": 100.0, "bf16": 20.0}, "read_gb_s": 20.0})
    assert slow_bf16["dtype"] == "fp32" and slow_bf16["floor_s"] > found["floor_s"]


@pytest.mark.long  # four variant processes with the engine's compile: about 5 minutes on 2 AVX2 cores
def test_bench_runs_both_baselines_and_the_engine_at_a_fixed_length_with_the_profile(tmp_path):
    """One bench run covers what a user asks of it: both plain-TRL baselines, grpo-exp, a candidate, the
    profile, the floor and the ratios (one subprocess per variant, so one run keeps the suite short)."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_exp.apps.bench", "--steps", "1", "--warmup", "0", "--model", "tiny_random",
         "--max-completion-length", "8", "--prompts-per-step", "1", "--num-generations", "2", "--threads", "1",
         "--baseline", "fp32", "--baseline", "trl-defaults", "--out", str(out), "--fixed-length", "--profile",
         "--candidate", "engine=speed.generation=engine,speed.rollout_compile=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "bench.json").read_text())
    variants = report["variants"]
    assert set(variants) == {"baseline", "trl-defaults", "grpo-exp", "engine"}
    for name, res in variants.items():
        # --steps 1 is rounded up to a whole generation round of the default recipe (steps_per_generation=2)
        assert res["status"] == "ok" and res["measured_steps"] == 2, name
        assert res["settings"]["steps_per_generation"] == 2, name
        assert res["completion_tokens_per_s"] > 0 and res["peak_rss_mb"] > 100, name
        assert res["profile_mean_per_step_s"]["generation"] > 0, name
        # every step maps some pages in (a generation round's new tensors at least): a count was read
        assert res["page_faults_per_step"] > 0, name
    for name, steps in report["steps"].items():  # the peak RSS after each step: never falls, ends at the run's
        peaks = [s["peak_rss_mb"] for s in steps]
        assert peaks == sorted(peaks) and 100 < peaks[-1] <= variants[name]["child_vmhwm_mb"] + 0.1, name
    assert variants["baseline"]["settings"]["bf16"] is False
    assert variants["baseline"]["settings"]["gradient_checkpointing"] is True
    assert variants["baseline"]["settings"]["shared_prefix"] is False
    assert variants["grpo-exp"]["settings"]["gradient_checkpointing"] is False
    assert variants["grpo-exp"]["settings"]["shared_prefix"] is True
    assert variants["trl-defaults"]["settings"]["gradient_checkpointing"] is True
    # TRL's own default precision: bf16 on (GRPOConfig's default)
    assert variants["trl-defaults"]["settings"]["bf16"] is True
    assert variants["engine"]["settings"]["rollout"] == "engine"
    # --fixed-length: every completion of every variant ran to the 8-token limit (one round: 1 prompt x 2
    # completions x 2 steps per generation), through TRL's generate and through the engine alike
    for name, variant in variants.items():
        assert variant["settings"]["fixed_length"] is True, name
        assert variant["completion_tokens"] == 4 * 8, name
    assert set(report["ratios_vs"]) == {"baseline", "trl-defaults"}
    assert report["ratio_vs_baseline"] == report["ratios_vs"]["baseline"]
    assert report["ratio_vs_baseline"]["grpo-exp"]["completion_tokens_per_s"] > 0
    assert report["machine_limits"]["gemm_gflops"]["bf16"] > 0
    for name in variants:
        assert report["floor"][name]["floor_s"] > 0 and report["floor"][name]["multiple"] > 1
    for name, res in variants.items():  # which part raised the peak RSS, charged in full
        rises = res["peak_rss_rise_mb"]
        assert res["peak_rss_part"] in rises and rises["setup"] > 100, name
        assert set(rises) <= {"setup", *tables.PROFILE_PARTS, "other"}, name
        assert 0 < sum(rises.values()) <= res["child_vmhwm_mb"] + 0.1, name
    md = (out / "bench.md").read_text()
    assert "x floor" in md and "tok/s vs trl-defaults" in md and "MB it raised the peak RSS by" in md
    assert "page faults per step" in md


def test_the_peak_rss_is_charged_to_the_part_that_raised_it(monkeypatch):
    readings = iter([100.0, 150.0, 150.0, 120.0, 170.0])
    monkeypatch.setattr(child, "_vmhwm_mb", lambda: next(readings))
    recorder = child.StepRecorder(gen_batch=1, profile=True)
    for part in ("setup", "backward", "generation", "generation", "other"):
        recorder.note_peak(part)
    assert recorder.peak_rise_mb == {"setup": 100.0, "backward": 50.0, "other": 20.0}
    assert recorder.peak_part == "other"
    quiet = child.StepRecorder(gen_batch=1, profile=False)  # without --profile nothing is read
    quiet.note_peak("setup")
    assert quiet.peak_rise_mb == {} and quiet.peak_part is None


def test_beta_reaches_every_variant_of_the_bench(tmp_path):
    # the baselines copy their algorithm settings (beta included) from the config composed with these
    from grpo_exp.analysis.bench.child import compose
    from grpo_exp.analysis.bench.parent import common_overrides
    from grpo_exp.apps.bench import parse_args

    assert compose(common_overrides(parse_args([])), tmp_path).train.beta == 0.04  # conf/stage/basic.yaml
    assert compose(common_overrides(parse_args(["--beta", "0"])), tmp_path).train.beta == 0.0


def test_a_model_directory_or_hub_id_is_benchmarked_through_the_custom_model_option(tmp_path):
    from grpo_exp.analysis.bench.child import compose
    from grpo_exp.analysis.bench.parent import common_overrides
    from grpo_exp.apps.bench import parse_args

    model_dir = tmp_path / "my_model"
    model_dir.mkdir()
    for given, name, ident in ((str(model_dir), "custom", str(model_dir)), ("org/name", "custom", "org/name"),
                               ("tiny_random", "tiny_random", None)):
        model = compose(common_overrides(parse_args(["--model", given])), tmp_path / "out").model
        assert (model.name, model.get("id")) == (name, ident)


def child_result(name: str, step_s: list[float], tokens: float, rss: float) -> dict:
    """What run_child returns for one round of a variant: measured steps of `tokens` tokens each."""
    res = {"name": name, "status": "ok", "prompts_per_step": 2, "wall_s": 10.0, "peak_rss_mb": rss,
           "peak_rss_part": "backward", "peak_rss_rise_mb": {"setup": rss / 2, "backward": rss / 2},
           "child_vmhwm_mb": rss, "steps": [{"measured": True, "tokens": tokens, "time_s": t, "reward": t}
                                            for t in step_s],
           "profile_steps": [{"generation": t / 2, "step": t} for t in step_s]}
    res.update(parent.summarize_steps(res))
    return res


def test_rounds_run_in_alternating_order_and_pool_their_steps(tmp_path):
    """--rounds: A B, B A, A B; a variant's steps pooled over its rounds, its highest peak RSS, its first round's
    reward curve, and ratios to the baseline taken round by round."""
    speeds = {("baseline", 1): 2.0, ("baseline", 2): 4.0, ("baseline", 3): 2.0,
              ("grpo-exp", 1): 1.0, ("grpo-exp", 2): 1.0, ("grpo-exp", 3): 0.5}
    calls = []

    def runner(name, spec, out_dir, round_no):
        calls.append((name, round_no))
        return child_result(name, [speeds[name, round_no]] * 2, 64.0, 1000.0 + 100 * round_no)

    variants = {"baseline": {}, "grpo-exp": {}}
    results = parent.run_rounds(variants, tmp_path, 3, runner=runner)
    assert calls == [("baseline", 1), ("grpo-exp", 1), ("grpo-exp", 2), ("baseline", 2), ("baseline", 3),
                     ("grpo-exp", 3)]
    ours = results["grpo-exp"]
    assert ours["measured_steps"] == 6 and ours["completion_tokens"] == 6 * 64
    assert ours["completion_tokens_per_s"] == pytest.approx(6 * 64 / (2 * (1.0 + 1.0 + 0.5)))
    assert ours["step_time_s_median"] == 1.0 and ours["peak_rss_mb"] == 1300.0
    assert ours["reward_curve"] == [1.0, 1.0]  # the first round's, not the rounds one after another
    assert ours["profile_mean_per_step_s"]["generation"] == round((1.0 + 1.0 + 0.5) / 6, 3)  # rounded to ms
    assert [r["completion_tokens_per_s"] for r in ours["rounds"]] == [64.0, 64.0, 128.0]
    ratios = tables.round_ratios(results["baseline"], ours)
    assert ratios == {"completion_tokens_per_s": [2.0, 4.0, 4.0], "median": 4.0, "min": 2.0, "max": 4.0}
    md = tables.rounds_table(results, {"baseline": {n: tables.round_ratios(results["baseline"], r)
                                                   for n, r in results.items()}},
                            parent.round_orders(list(variants), 3))
    assert "Order: baseline, grpo-exp; grpo-exp, baseline; baseline, grpo-exp." in md
    assert "| grpo-exp | 64.0 | 64.0 | 128.0 | 2.00, 4.00, 4.00 | 4.00 [2.00, 4.00] |" in md
    # one round: the child's own result, untouched (and no per-round figures)
    single = parent.run_rounds(variants, tmp_path, 1, runner=lambda n, s, o, r: child_result(n, [1.0], 8.0, 500.0))
    assert "rounds" not in single["grpo-exp"] and tables.round_ratios(single["baseline"], single["grpo-exp"]) is None


def test_a_failed_round_fails_the_variant(tmp_path):
    def runner(name, spec, out_dir, round_no):
        if round_no == 2:
            return {"name": name, "status": "failed", "returncode": 1, "wall_s": 1.0}
        return child_result(name, [1.0], 8.0, 500.0)

    results = parent.run_rounds({"grpo-exp": {}}, tmp_path, 2, runner=runner)
    assert results["grpo-exp"]["status"] == "failed"
    assert [r["status"] for r in results["grpo-exp"]["rounds"]] == ["ok", "failed"]


def test_the_floor_probe_is_its_best_reading_and_says_when_the_machine_moved():
    def reading(fp32, bf16, read=40.0):
        return {"gemm_gflops": {"fp32": fp32, "bf16": bf16}, "read_gb_s": read, "threads": 2, "seconds": 0.4}

    steady = floor.probe_summary([reading(190, 430), reading(180, 420, 42.0), reading(185, 425)])
    assert steady["best"]["gemm_gflops"] == {"fp32": 190, "bf16": 430} and steady["best"]["read_gb_s"] == 42.0
    assert steady["readings"] == 3 and not steady["moved"] and floor.moved_line(steady) is None
    assert steady["range"]["gemm_gflops_bf16"] == [420, 430]
    # the readings a busy host gave in one hour (fp32 193/101, bf16 434/206): the bench says so
    busy = floor.probe_summary([reading(193, 434), reading(101, 206), reading(172, 428)])
    assert busy["moved"] and busy["spread"]["bf16"] == round((434 - 206) / 434, 3)
    line = floor.moved_line(busy)
    assert line.startswith("the machine's throughput moved during the bench: its bf16 GEMM peak read 206-434 GFLOP/s")


def test_the_bench_probes_the_floor_after_every_child(tmp_path):
    probes = []
    variants = {"baseline": {}, "grpo-exp": {}}
    parent.run_rounds(variants, tmp_path, 2, runner=lambda n, s, o, r: child_result(n, [1.0], 8.0, 500.0),
                      after_child=lambda: probes.append(len(probes)))
    assert probes == [0, 1, 2, 3]  # two variants, two rounds


def test_an_unknown_bench_model_is_one_line_before_anything_runs(tmp_path, capsys):
    from grpo_exp.apps.bench import parse_args

    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--model", "smolm2_135m", "--out", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("grpo-bench: error: --model smolm2_135m is not a conf/model option (did you mean "
                          "'smollm2_135m'?)")
    assert not (tmp_path / "bench").exists()
    assert parse_args(["--model", "tiny_random"]).model == "tiny_random"
    assert parse_args(["--model", "org/name"]).model == "org/name"  # a hub id, checked when its variant loads it
