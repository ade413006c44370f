"""A bench's results page (analysis/bench/page.py): written from a hand-made bench.json laid out as the bench's
parent writes it, its header (the bench's and the page's commands, commits, dates, machine, versions) and
its tables, each followed by the `grpo-report --table` command that prints it again; written again by
grpo-report with the same tables; and written by grpo-bench --page itself (children faked, nothing measured)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from grpo_exp.analysis.bench import page as bench_page
from grpo_exp.analysis.bench import parent
from tests.conftest import ROOT

PNG = b"\x89PNG\r\n\x1a\n"
COMMAND = ("grpo-bench --steps 2 --warmup 1 --fixed-length --baseline fp32 --rounds 2 --profile "
           "--reward-curve-steps 3 --out outputs/bench/demo")


def variant(name: str, kind: str, tok_s: list[float], step_s: float, rss: float) -> dict:
    """One variant as bench.json's "variants" holds it (the child's result less its steps, with the parent's
    summary, rounds, profile and floor)."""
    return {"name": name, "kind": kind, "overrides": [], "status": "ok", "torch": "2.0.0",
            "settings_text": f"{'fp32' if kind == 'trl' else 'bf16'}, gen batch 8, fixed length, 2 thr",
            "measured_steps": 4, "step_time_s_median": step_s, "step_time_s_mean": step_s,
            "completion_tokens": 512.0, "completion_tokens_per_s": sum(tok_s) / len(tok_s),
            "prompts_per_s": 2 / step_s, "peak_rss_mb": rss, "page_faults_per_step": 1000.0,
            "reward_curve": [0.1, 0.2, 0.3], "peak_rss_part": "backward",
            "peak_rss_rise_mb": {"setup": rss / 2, "backward": rss / 2},
            "profile_mean_per_step_s": {"generation": step_s / 2, "backward": step_s / 4, "other": step_s / 4,
                                        "step": step_s},
            "rounds": [{"status": "ok", "completion_tokens_per_s": t} for t in tok_s],
            "floor": {"floor_s": 0.25, "train_s": 0.2, "generation_s": 0.05, "decode_bound": "memory",
                      "dtype": "bf16", "matmul_params": 134_515_008, "decode_steps": 64.0,
                      "completion_tokens_per_step": 128.0, "prompt_tokens_mean": 55.1, "multiple": step_s / 0.25}}


def bench_json() -> dict:
    """A bench of a baseline and grpo-exp over two rounds, profiled, with reward curves: bench.json as
    parent.run writes it."""
    variants = {"baseline": variant("baseline", "trl", [20.0, 30.0], 10.0, 3000.0),
                "grpo-exp": variant("grpo-exp", "grpo-exp", [100.0, 200.0], 2.0, 2900.0)}
    ratios = {n: {"completion_tokens_per_s": round(v["completion_tokens_per_s"] / 25.0, 3),
                  "peak_rss_mb": round(v["peak_rss_mb"] / 3000.0, 3)} for n, v in variants.items()}
    return {"command": COMMAND, "commit": "abc1234", "started": "2026-12-01T10:00:00+00:00",
            "ended": "2026-12-01T10:30:00+00:00", "versions": "python 3.11.7, torch 2.0.0, transformers 5.0.0, trl 1.0.0",
            "settings": {"model": "smollm2_135m", "steps": 2, "warmup": 1, "prompts_per_step": 2, "num_generations": 4,
                         "max_completion_length": 64, "threads": 2, "seed": 42, "lr": None, "beta": None,
                         "stage": "basic", "override": [], "candidate": [], "baseline": ["fp32"], "no_baseline": False,
                         "profile": True, "fixed_length": True, "rounds": 2, "reward_curve_steps": 3},
            "machine": "x86_64, 2 cpus (avx2,avx512f,avx512_bf16)",
            "machine_limits": {"gemm_gflops": {"fp32": 128.4, "bf16": 829.3}, "read_gb_s": 43.57, "threads": 2,
                               "seconds": 0.92},
            "variants": variants, "steps": {n: [] for n in variants}, "profile_steps": {},
            "ratio_vs_baseline": ratios, "ratios_vs": {"baseline": ratios},
            "floor": {n: v["floor"] for n, v in variants.items()},
            "round_order": [["baseline", "grpo-exp"], ["grpo-exp", "baseline"]],
            "round_ratios_vs": {"baseline": {"baseline": {"completion_tokens_per_s": [1.0, 1.0], "median": 1.0,
                                                          "min": 1.0, "max": 1.0},
                                             "grpo-exp": {"completion_tokens_per_s": [5.0, 6.667], "median": 5.833,
                                                          "min": 5.0, "max": 6.667}}},
            "reward_curves": {n: v["reward_curve"] for n, v in variants.items()}}


def _report(*args):
    return subprocess.run([sys.executable, "-m", "grpo_exp.apps.report", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _after_date(text: str) -> str:
    """The page below its Date line: what regenerating must give again."""
    return text.split("- **Date:**")[1].split("\n", 1)[1]


@pytest.mark.slow  # grpo-report in a subprocess
def test_bench_page_header_tables_and_regeneration(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench.json").write_text(json.dumps(bench_json(), indent=2))
    page = tmp_path / "docs" / "results" / "demo-bench.md"
    proc = _report(bench, "--page", page, "--machine", "test-box")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = page.read_text()
    lines = text.split("\n")
    assert lines[:3] == ["# Results: demo-bench", "",
                         "<!-- Written by grpo-report from the bench's bench.json; do not edit: rerun the page's "
                         "command. -->"]
    header = text.split("\n## ")[0]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    assert f"- **Bench made by:** `{COMMAND}`" in header
    assert f"- **Page made by:** `grpo-report {bench} --page {page} --machine test-box`" in header
    assert f"- **Commit:** `{commit}" in header and "; bench: `abc1234`" in header
    assert (f"- **Date:** {datetime.now(timezone.utc):%Y-%m-%d}" in header
            and "(page); bench ran from 2026-12-01 10:00 UTC to 2026-12-01 10:30 UTC" in header)
    assert "- **Machine:** test-box (" in header and "cores usable" in header
    assert "the bench recorded: x86_64, 2 cpus (avx2,avx512f,avx512_bf16), 2 threads per variant" in header
    assert "(where grpo-report ran); the bench: python 3.11.7, torch 2.0.0, transformers 5.0.0, trl 1.0.0" in header
    assert "2 variants, 2 ran to the end: `baseline` (plain TRL), `grpo-exp` (grpo-exp); 2 rounds, profiled" in header

    # the main table's row of grpo-exp, its ratios against the baseline; the rounds, profile and floor tables
    assert ("| grpo-exp | bf16, gen batch 8, fixed length, 2 thr | 4 | 2.00 | 2.00 | 150.0 | 1.000 | 2900 | 6.00 "
            "| 0.97 | 0.250 | 8.0 | 1000 |") in text
    assert "| grpo-exp | 100.0 | 200.0 | 5.00, 6.67 | 5.83 [5.00, 6.67] |" in text
    assert "| generation | 5.00 (50%) | 1.00 (50%) |" in text
    assert "GEMM peak fp32 128 GFLOP/s, bf16 829 GFLOP/s; memory read 43.6 GB/s" in text
    assert "| baseline | 0.250 | 0.200 | 0.050 | memory | bf16 | 134.5 | 64.0 | 128.0 | 55.1 | 10.00 | 40.0 |" in text
    for name in ("bench", "rounds", "profile", "floor"):
        assert f"Reproduce: `grpo-report {bench} --table {name}`" in text
        printed = _report(bench, "--table", name)  # the command after the table prints that table
        assert printed.returncode == 0 and printed.stdout.strip() in text, printed.stderr[-2000:]
    assert "![reward_curve](demo-bench/reward_curve.png)" in text
    assert (page.parent / "demo-bench" / "reward_curve.png").read_bytes()[:8] == PNG

    again = bench_page.write_page(bench, page, "test-box")  # the same page from the same bench.json
    assert _after_date(again.read_text()) == _after_date(text)


def test_an_older_bench_json_says_what_it_did_not_record(tmp_path):
    report = bench_json()
    for key in ("command", "commit", "started", "ended", "versions", "round_order", "round_ratios_vs",
                "reward_curves"):
        report.pop(key)
    for res in report["variants"].values():
        res.pop("profile_mean_per_step_s")
        res.pop("rounds")
    (tmp_path / "bench.json").write_text(json.dumps(report))
    text = bench_page.write_page(tmp_path, tmp_path / "old.md").read_text()
    assert "- **Bench made by:** not recorded (bench.json has no command)" in text
    assert "; bench: no commit recorded in bench.json" in text
    assert "the file's modification time: this bench recorded no dates" in text
    assert "the bench: torch 2.0.0 (its children; nothing else recorded)" in text
    assert "## Rounds" not in text and "## Profile" not in text and "## The machine's floor" in text
    assert not (tmp_path / "old").exists()  # no reward curves: no plot folder
    with pytest.raises(KeyError, match="no table 'rounds' in this bench; it has: bench, floor"):
        bench_page.table_markdown(tmp_path, "rounds")


@pytest.mark.slow  # grpo-report in a subprocess
def test_report_options_for_a_bench_are_checked(tmp_path):
    (tmp_path / "bench.json").write_text(json.dumps(bench_json()))
    proc = _report(tmp_path)
    assert proc.returncode == 2 and "is a bench's output (bench.json): give --page or --table" in proc.stderr
    proc = _report(tmp_path, tmp_path, "--table", "bench")
    assert proc.returncode == 2 and "give it alone" in proc.stderr


def child(name: str, kind: str, step_s: float) -> dict:
    """What run_child returns for one round: a result.json's keys, with the parent's own."""
    res = {"name": name, "kind": kind, "overrides": [], "status": "ok", "prompts_per_step": 2, "wall_s": 5.0,
           "peak_rss_mb": 1000.0, "torch": "2.0.0", "settings_text": f"{kind}, 1 thr",
           "settings": {"steps_per_generation": 1, "generation_batch_size": 8, "num_generations": 4,
                        "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
                        "max_completion_length": 16},
           "model_shape": {"matmul_params": 1_000_000, "prompt_tokens_mean": 20.0},
           "steps": [{"measured": True, "tokens": 128.0, "time_s": step_s, "max_length": 16, "reward": 0.5}] * 2}
    res.update(parent.summarize_steps(res))
    return res


@pytest.mark.slow  # grpo-report in a subprocess
def test_grpo_bench_writes_the_page_after_the_bench(tmp_path, monkeypatch):
    """grpo-bench --page: bench.json records the command, the commit, the dates and the versions; the page
    says grpo-bench made it and how grpo-report makes it again, which gives the same tables."""
    from grpo_exp.apps.bench import parse_args

    monkeypatch.setattr(parent, "run_child", lambda name, spec, out, r: child(name, spec["kind"], 1.0 if name ==
                                                                              "baseline" else 0.5))
    monkeypatch.setattr(parent, "machine_limits", lambda threads: {"gemm_gflops": {"fp32": 10.0, "bf16": 20.0},
                                                                   "read_gb_s": 5.0, "threads": threads, "seconds": 0.1})
    out, page = tmp_path / "bench", tmp_path / "docs" / "results" / "fake.md"
    argv = ["--model", "tiny_random", "--threads", "1", "--out", str(out), "--page", str(page), "--machine", "box"]
    assert parent.run(parse_args(argv)) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["command"] == "grpo-bench " + " ".join(argv)
    assert report["commit"] and report["started"] <= report["ended"] and "torch" in report["versions"]
    assert "page" not in report["settings"] and "argv" not in report["settings"]
    text = page.read_text()
    assert text.startswith("# Results: fake\n\n<!-- Written by grpo-bench from the bench's bench.json")
    assert (f"- **Page made by:** `{report['command']}` (with the bench); again from its bench.json: "
            f"`grpo-report {out} --page {page} --machine box`") in text
    assert "| grpo-exp | grpo-exp, 1 thr | 2 | 0.50 | 0.50 | 256.0 | 4.000 | 1000 | 2.00 | 1.00 |" in text
    assert "## The machine's floor" in text and "## Rounds" not in text
    again = _report(out, "--page", tmp_path / "again.md", "--machine", "box")
    assert again.returncode == 0, again.stderr[-2000:]
    assert _after_date(text).split("\n## ", 1)[1] == _after_date((tmp_path / "again.md").read_text()).split("\n## ", 1)[1]
