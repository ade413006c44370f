"""The bench's parent process: the variants `grpo-bench` asks for (baselines, grpo-exp, candidates), each run
in a child process of its own (`python -m grpo_exp.apps.bench --child spec.json`, child.py) round after round,
their step records summarized and pooled over rounds, ratios against each baseline, and bench.json and
bench.md written into the output folder."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from grpo_exp.analysis import provenance
from grpo_exp.analysis.bench.floor import machine_info, machine_limits, moved_line, probe_summary, step_floor
from grpo_exp.analysis.bench.tables import PROFILE_PARTS, plot_rewards, ratios, round_ratios, sections

ROOT = Path(__file__).resolve().parents[3]
BASELINES = ("fp32", "trl-defaults")
# the variant name of each --baseline ("baseline" is the fp32 one, as before there was a choice)
BASELINE_NAMES = {"fp32": "baseline", "trl-defaults": "trl-defaults"}
# each round's own figures, kept beside the pooled ones
ROUND_KEYS = ("status", "step_time_s_median", "step_time_s_mean", "completion_tokens_per_s", "peak_rss_mb", "wall_s")


def parse_candidate(text: str) -> tuple[str, list[str]]:
    name, sep, overrides = text.partition("=")
    if not sep or not name or not overrides:
        raise SystemExit(f"--candidate {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...]")
    return name, [o for o in overrides.split(",") if o]


def split_env(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """`env.NAME=VALUE` items set an environment variable of the child (e.g. env.OMP_WAIT_POLICY=ACTIVE)."""
    env = {o[4:].partition("=")[0]: o.partition("=")[2] for o in overrides if o.startswith("env.")}
    return [o for o in overrides if not o.startswith("env.")], env


def common_overrides(args) -> list[str]:
    from grpo_exp.config.compose import model_overrides

    out = [
        *model_overrides(args.model), f"stage={args.stage}", "logger=none", f"cpu.threads={args.threads}",
        f"train.per_device_train_batch_size={args.prompts_per_step * args.num_generations}",
        f"train.num_generations={args.num_generations}",
        f"train.max_completion_length={args.max_completion_length}", f"train.seed={args.seed}",
        "train.logging_steps=1",
    ]
    if args.lr is not None:
        out.append(f"train.learning_rate={args.lr}")
    if args.beta is not None:
        out.append(f"train.beta={args.beta}")
    return out


def run_child(name: str, spec: dict, out_dir: Path, round_no: int | None = None) -> dict:
    """Run one variant in a subprocess; its own peak RSS comes from wait4's rusage of that child. With
    `round_no` (--rounds > 1) it writes into <out>/<name>/round_<n>/."""
    child_dir = out_dir / name if round_no is None else out_dir / name / f"round_{round_no}"
    child_dir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "name": name, "dir": str(child_dir)}
    (child_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]),
           "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env.update(spec.get("env") or {})
    print(f"\n[bench] === {name}{'' if round_no is None else f' (round {round_no})'} "
          f"({spec['kind']}{': ' + ' '.join(spec['overrides']) if spec['overrides'] else ''}"
          f"{' env ' + str(spec.get('env')) if spec.get('env') else ''})",
          flush=True)
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "grpo_exp.apps.bench", "--child", str(child_dir / "spec.json")],
                            cwd=ROOT, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    result_path = child_dir / "result.json"
    if proc.returncode != 0 or not result_path.exists():
        return {"name": name, "kind": spec["kind"], "overrides": spec["overrides"], "status": "failed",
                "returncode": proc.returncode, "wall_s": time.time() - started}
    result = json.loads(result_path.read_text())
    result["peak_rss_mb"] = round(usage.ru_maxrss / 1024.0, 1)  # KiB on Linux
    result["wall_s"] = round(time.time() - started, 1)
    result["status"] = "ok"
    result.update(summarize_steps(result))
    return result


def summarize_steps(result: dict) -> dict:
    steps = [s for s in result["steps"] if s["measured"]]
    times = [s["time_s"] for s in steps]
    total_time = sum(times)
    tokens = sum(s["tokens"] for s in steps)
    prompts = result["prompts_per_step"] * len(steps)
    out = {
        "measured_steps": len(steps),
        "step_time_s_median": statistics.median(times) if times else None,
        "step_time_s_mean": total_time / len(times) if times else None,
        "completion_tokens": tokens,
        "completion_tokens_per_s": tokens / total_time if total_time > 0 else None,
        "prompts_per_s": prompts / total_time if total_time > 0 else None,
        "page_faults_per_step": (statistics.mean(s["page_faults"] for s in steps)
                                 if steps and all("page_faults" in s for s in steps) else None),
        "reward_curve": [s.get("reward") for s in result["steps"]],
    }
    if result.get("profile_steps"):
        measured = [p for p, s in zip(result["profile_steps"], result["steps"]) if s["measured"]]
        if measured:
            keys = [k for k in (*PROFILE_PARTS, "other", "step") if any(k in p for p in measured)]
            out["profile_mean_per_step_s"] = {k: round(sum(p.get(k, 0.0) for p in measured) / len(measured), 3)
                                              for k in keys}
            gen_steps = [p for p in measured if p.get("generation", 0) > 0]
            out["profile_generating_step_s"] = {k: round(v, 3) for k, v in gen_steps[0].items()} if gen_steps else None
    return out


def merge_rounds(runs: list[dict]) -> dict:
    """One variant's result over its rounds (--rounds): the measured steps of every round pooled (tokens/s is
    their tokens over their time, the medians theirs), the highest peak RSS of any round with that round's parts,
    the reward curve of the first round, and each round's own figures under `rounds`."""
    if len(runs) == 1:
        return runs[0]
    per_round = [{k: r.get(k) for k in ROUND_KEYS} for r in runs]
    failed = [r for r in runs if r.get("status") != "ok"]
    if failed:
        return {**failed[0], "rounds": per_round}
    top = max(runs, key=lambda r: r["peak_rss_mb"])
    merged = {**runs[0], "steps": [s for r in runs for s in r["steps"]],
              "peak_rss_mb": top["peak_rss_mb"], "peak_rss_part": top.get("peak_rss_part"),
              "peak_rss_rise_mb": top.get("peak_rss_rise_mb"), "child_vmhwm_mb": top.get("child_vmhwm_mb"),
              "wall_s": round(sum(r["wall_s"] for r in runs), 1)}
    if runs[0].get("profile_steps"):
        merged["profile_steps"] = [p for r in runs for p in r["profile_steps"]]
    merged.update(summarize_steps(merged))
    merged.update(reward_curve=runs[0]["reward_curve"], rounds=per_round)
    return merged


def run(args) -> int:
    """Run every variant of the benchmark `args` (see apps/bench.py) asks for; returns the exit code."""
    out_dir = Path(args.out) if args.out else ROOT / "outputs" / "bench" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    command = shlex.join(["grpo-bench", *getattr(args, "argv", sys.argv[1:])])
    commit = provenance.repo_commit()
    base_spec = {"common": common_overrides(args), "threads": args.threads, "steps": args.steps,
                 "warmup": args.warmup, "profile": args.profile, "reward_curve_steps": args.reward_curve_steps,
                 "prompts_per_step": args.prompts_per_step, "fixed_length": args.fixed_length}
    variants = {}
    if not args.no_baseline:
        for baseline in dict.fromkeys(args.baseline or ["fp32"]):
            variants[BASELINE_NAMES[baseline]] = {**base_spec, "kind": "trl", "overrides": [],
                                                  "trl_defaults": baseline == "trl-defaults"}
    readings = [machine_limits(args.threads)]
    print(f"[bench] machine: {_limits_text(readings[0], args.threads)}", flush=True)
    overrides, env = split_env(list(args.override))
    variants["grpo-exp"] = {**base_spec, "kind": "grpo-exp", "overrides": overrides, "env": env}
    for text in args.candidate:
        name, overrides = parse_candidate(text)
        overrides, env = split_env(overrides)
        kind = "trl" if "kind=trl" in overrides else "grpo-exp"  # kind=trl: another plain-TRL variant
        overrides = [o for o in overrides if o != "kind=trl"]
        if kind == "trl" and overrides:
            raise SystemExit(f"--candidate {name}: a kind=trl variant takes only env.* items, not {overrides}")
        variants[name] = {**base_spec, "kind": kind, "overrides": overrides, "env": env}

    # the probe again after every child and once more at the end: one 0.4 s reading is too noisy to carry a floor
    results = run_rounds(variants, out_dir, args.rounds,
                         after_child=lambda: readings.append(machine_limits(args.threads)))
    readings.append(machine_limits(args.threads))
    probe = probe_summary(readings)
    limits = probe["best"]
    print(f"[bench] machine, best of {len(readings)} probes: {_limits_text(limits, args.threads)}", flush=True)
    moved = moved_line(probe)
    if moved:
        print(f"[bench] warning: {moved}", flush=True)
    for res in results.values():
        if res.get("status") == "ok":
            res["floor"] = step_floor(res, limits)
    baseline_names = [n for n, spec in variants.items() if spec["kind"] == "trl" and "trl_defaults" in spec]
    ratios_vs = {b: {n: ratios(results[b], r) for n, r in results.items() if r.get("status") == "ok"}
                 for b in baseline_names if results[b].get("status") == "ok"}
    # ratios against the first baseline asked for (the fp32 one unless only trl-defaults was)
    ratio_of = ratios_vs.get(baseline_names[0], {}) if baseline_names else {}
    # --rounds: the order each round ran in, and every variant's tokens/s ratio to each baseline round by round
    orders = round_orders(list(variants), args.rounds) if args.rounds > 1 else None
    rounds_vs = {b: {n: round_ratios(results[b], r) for n, r in results.items()} for b in ratios_vs} if orders else {}
    report = {
        "command": command,
        # the code's commit when the bench started, its start and end (UTC), and the libraries it ran with
        "commit": commit,
        "started": started.isoformat(timespec="seconds"),
        "ended": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": provenance.versions(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "out", "argv", "page", "machine")},
        "machine": machine_info(),
        "machine_limits": limits,  # the best probe reading, which every x floor is against
        "floor_probe": {**probe, "all": readings},
        "variants": {n: {k: v for k, v in r.items() if k not in ("steps", "profile_steps")} for n, r in results.items()},
        "steps": {n: r.get("steps") for n, r in results.items()},
        "profile_steps": {n: r.get("profile_steps") for n, r in results.items() if r.get("profile_steps")},
        "ratio_vs_baseline": ratio_of,
        "ratios_vs": ratios_vs,
        "floor": {n: r.get("floor") for n, r in results.items() if r.get("floor")},
    }
    if orders:
        report["round_order"] = orders
        report["round_ratios_vs"] = rounds_vs
    if args.reward_curve_steps:
        report["reward_curves"] = {n: r.get("reward_curve") for n, r in results.items()}
        if plot_rewards(results, out_dir / "reward_curve.png"):
            report["reward_curve_png"] = str(out_dir / "reward_curve.png")
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2))

    found = sections(report)
    md = ["# Benchmark: grpo-exp vs plain TRL GRPOTrainer\n", f"`{report['command']}`\n",
          f"Machine: {report['machine']}; best of {len(readings)} floor probes: "
          f"{_limits_text(limits, args.threads)}; their spread: fp32 {probe['spread']['fp32']:.0%}, bf16 {probe['spread']['bf16']:.0%}\n"]
    if moved:
        md.append(f"**Warning:** {moved}.\n")
    for section in found:  # the main table first, under the header; the others under their titles
        md += ([] if section.name == "bench" else [f"## {section.title}\n"]) + [section.markdown, ""]
        print("\n" + section.markdown)
    (out_dir / "bench.md").write_text("\n".join(md) + "\n")
    print(f"\n[bench] wrote {out_dir / 'bench.json'} and bench.md")
    if getattr(args, "page", None):
        from grpo_exp.analysis.bench.page import write_page

        written = write_page(out_dir, args.page, args.machine, tool="grpo-bench", shown_dir=shown(out_dir))
        print(f"[bench] results page: {written}")
    return 0 if all(r.get("status") == "ok" for r in results.values()) else 1


def _limits_text(limits: dict, threads: int) -> str:
    return (f"GEMM peak fp32 {limits['gemm_gflops']['fp32']:.0f} / bf16 {limits['gemm_gflops']['bf16']:.0f} GFLOP/s, "
            f"memory read {limits['read_gb_s']:.1f} GB/s ({threads} threads)")


def shown(path: Path) -> str:
    """`path` as a page shows it: relative to the working directory when it lies under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order the variants run in, round by round: as given, then reversed, and so on (A B C, C B A, A B C), so
    that over an even number of rounds no variant always runs first, in the machine's freshest (or slowest)
    minutes."""
    return [names if r % 2 == 0 else names[::-1] for r in range(rounds)]


def run_rounds(variants: dict, out_dir: Path, rounds: int, runner=None, after_child=None) -> dict:
    """Every variant's result, over `rounds` rounds of one child each (merge_rounds), in round_orders' order;
    `runner` runs one child (run_child), `after_child()` runs after each (the floor probe)."""
    runner = runner or run_child
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r, names in enumerate(round_orders(list(variants), rounds), start=1):
        for name in names:
            runs[name].append(runner(name, variants[name], out_dir, r if rounds > 1 else None))
            if after_child is not None:
                after_child()
    return {name: merge_rounds(found) for name, found in runs.items()}
