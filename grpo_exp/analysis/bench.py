"""Benchmark grpo-exp's training path against a plain TRL GRPOTrainer on the same prompts and settings.

    grpo-bench                                   # default model, 1 warm-up + 5 measured steps each
    grpo-bench --profile                         # + where the time goes inside a step, and where RSS peaks
    grpo-bench --override train=fast             # measure grpo-exp with other config overrides
    grpo-bench --candidate fast=train=fast --candidate static=+train.extra.cache_implementation=static
    grpo-bench --candidate passive=cpu.omp_wait_policy=passive --candidate trl_passive=kind=trl,env.OMP_WAIT_POLICY=PASSIVE
    grpo-bench --reward-curve-steps 30           # + reward per step of both variants (bench.json, PNG)
    grpo-bench --baseline fp32 --baseline trl-defaults --candidate engine=train.rollout=engine
    grpo-bench --rounds 3                        # each variant 3 times, in alternating order: ratios per round

Variants, each in its own subprocess (so its peak RSS, the child's ru_maxrss, is its own):
  baseline  a plain `trl.GRPOTrainer` built from `trl.GRPOConfig` with TRL's defaults as the older CPU tools run
            it: fp32 (bf16=False; on the CPU, or the GPU where there is one), TRL's default gradient checkpointing left on; the GRPO settings
            (lr and its schedule, num_generations, batch and generation rounds, max_completion_length, seed, beta, loss_type, sampling,
            clipping) copied from the composed grpo-exp config, so only the performance settings differ.
  trl-defaults  (--baseline trl-defaults) a plain `trl.GRPOTrainer` with TRL's own precision defaults, as a TRL user
            gets it today: bf16 on (GRPOConfig's default), gradient checkpointing on; the same GRPO settings.
  grpo-exp  `grpo_exp.training.stage.prepare` + `grpo_exp.training.trainer.build_trainer` (what training runs) from conf/train.yaml composed with the same overrides (+ --override).
  <name>    each --candidate NAME=OVERRIDE[,OVERRIDE...]: grpo-exp with those extra overrides (env.VAR=VALUE:
            an environment variable of that child; kind=trl: a plain-TRL variant, e.g. with another env).

grpo-exp's child applies cpu.omp_wait_policy before torch loads and cpu.malloc before the model loads, as the
entrypoint does (defaults: OpenMP's own policy; freed memory retained for reuse); the baseline child runs with
OpenMP's and glibc's defaults as a plain TRL script does (kind=trl,env.MALLOC_MMAP_MAX_=0,... gives it retain's).

Completion tokens of a step = TRL's `completions/mean_length` x the completions generated in that step (the
per-step batch, or the whole generation batch on the steps that generate when steps_per_generation > 1). Rates
are sums over the measured steps (after the warm-up); with steps_per_generation = k the measured window is
rounded up to whole multiples of k steps so it holds exactly one generation per k steps.

The floor: before the variants run, the parent measures the machine's GEMM peak (fp32 and bf16, best of a few
1536^3 products) and its memory read bandwidth (a 256 MB sum) with the variants' thread count, in a few seconds.
Each variant's floor per optimizer step is then
    6 N (completion tokens + distinct prompt tokens) / peak                 scoring forward + backward
  + [2 N (distinct prompt tokens) / peak                                    prefill, once per prompt
     + decoding steps x max(W / bandwidth, 2 N B / peak)] / steps_per_generation
with N the parameters that multiply (the input embedding is a lookup; a tied LM head counts once), W = N at the
machine's fastest GEMM dtype (2 bytes for bf16, else 4), B the rows of a generation round, decoding steps the
longest completion of the round (TRL's completions/max_length), and peak the fastest GEMM dtype's. Attention, norms
and the optimizer are left out, so the floor is a lower bound; each variant's mean step time is printed as a
multiple of it.

--rounds N runs the whole set N times, the order reversed every other round (A B C, C B A, A B C), so a slow
phase of a shared or virtual machine falls on neighbours rather than on one variant. A variant's figures pool
its rounds' measured steps (peak RSS: its highest round); bench.md's Rounds table gives each round's tokens/s and
each variant's ratio to every baseline in the same round, with their median, lowest and highest.

Each step also counts the child's minor page faults (pages the kernel mapped in, zero-filled when new: memory the
allocator gave back and took again; cpu.malloc), reported per measured step.

Writes bench.json, bench.md (and reward_curve.png) into --out (default outputs/bench/<timestamp>/).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASELINES = ("fp32", "trl-defaults")
# the variant name of each --baseline ("baseline" is the fp32 one, as before there was a choice)
BASELINE_NAMES = {"fp32": "baseline", "trl-defaults": "trl-defaults"}
PROFILE_PARTS = ("generation", "old_logprobs", "rewards", "policy_forward", "extra_loss", "backward", "optimizer")


# ----------------------------------------------------------------------------------------------------- parent side


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


# each round's own figures, kept beside the pooled ones
ROUND_KEYS = ("status", "step_time_s_median", "step_time_s_mean", "completion_tokens_per_s", "peak_rss_mb", "wall_s")


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


def round_ratios(base: dict, other: dict) -> dict | None:
    """`other`'s completion tokens/s over `base`'s round by round (each pair ran within minutes of each other, so
    a slow phase of the machine falls on both), with their median, lowest and highest."""
    pairs = [(b.get("completion_tokens_per_s"), o.get("completion_tokens_per_s"))
             for b, o in zip(base.get("rounds") or [], other.get("rounds") or [])]
    values = [round(o / b, 3) for b, o in pairs if b and o]
    if not values:
        return None
    return {"completion_tokens_per_s": values, "median": round(statistics.median(values), 3),
            "min": min(values), "max": max(values)}


def ratios(base: dict, other: dict) -> dict:
    def r(key, invert=False):
        a, b = base.get(key), other.get(key)
        if not a or not b:
            return None
        return round(a / b if invert else b / a, 3)

    return {"completion_tokens_per_s": r("completion_tokens_per_s"), "prompts_per_s": r("prompts_per_s"),
            "step_time_s_mean": r("step_time_s_mean"), "step_time_s_median": r("step_time_s_median"),
            "peak_rss_mb": r("peak_rss_mb"), "speedup_step_time_mean": r("step_time_s_mean", invert=True)}


def fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(results: dict, ratio_of: dict, ratios_vs: dict | None = None) -> str:
    """One row per variant; tok/s and RSS ratios against the first baseline, tok/s against any other baseline,
    and the step time as a multiple of the machine's floor."""
    others = [b for b in (ratios_vs or {}) if b != "baseline"]
    head = ("| variant | settings | steps | step s (median) | step s (mean) | completion tok/s | prompts/s "
            "| peak RSS MB | tok/s ratio | RSS ratio |" + "".join(f" tok/s vs {b} |" for b in others)
            + " floor s | x floor | page faults per step |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for name, res in results.items():
        if res.get("status") != "ok":
            lines.append(f"| {name} | FAILED (exit {res.get('returncode')}) |" + " |" * (head.count("|") - 3))
            continue
        rat = ratio_of.get(name) or {}
        floor = res.get("floor") or {}
        lines.append(
            f"| {name} | {res['settings_text']} | {res['measured_steps']} | {fmt(res['step_time_s_median'])} "
            f"| {fmt(res['step_time_s_mean'])} | {fmt(res['completion_tokens_per_s'], 1)} "
            f"| {fmt(res['prompts_per_s'], 3)} | {fmt(res['peak_rss_mb'], 0)} "
            f"| {fmt(rat.get('completion_tokens_per_s'))} | {fmt(rat.get('peak_rss_mb'))} |"
            + "".join(f" {fmt(((ratios_vs or {}).get(b) or {}).get(name, {}).get('completion_tokens_per_s'))} |"
                      for b in others)
            + f" {fmt(floor.get('floor_s'), 3)} | {fmt(floor.get('multiple'), 1)} "
            f"| {fmt(res.get('page_faults_per_step'), 0)} |")
    return "\n".join(lines)


def profile_table(results: dict) -> str:
    names = [n for n, r in results.items() if r.get("profile_mean_per_step_s")]
    if not names:
        return ""
    keys = [k for k in (*PROFILE_PARTS, "other", "step")
            if any(k in results[n]["profile_mean_per_step_s"] for n in names)]
    lines = ["| part (s per step, mean of measured steps) | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for k in keys:
        cells = []
        for n in names:
            prof = results[n]["profile_mean_per_step_s"]
            v = prof.get(k)
            share = f" ({100 * v / prof['step']:.0f}%)" if v is not None and k != "step" and prof.get("step") else ""
            cells.append(f"{fmt(v)}{share}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    peaks = [n for n in names if results[n].get("peak_rss_rise_mb")]
    if peaks:
        parts = [k for k in ("setup", *PROFILE_PARTS, "other")
                 if any(k in results[n]["peak_rss_rise_mb"] for n in peaks)]
        lines += ["", "| part (MB it raised the peak RSS by, whole run) | " + " | ".join(peaks) + " |",
                  "|---|" + "---|" * len(peaks)]
        for k in parts:
            lines.append(f"| {k} | " + " | ".join(
                fmt(results[n]["peak_rss_rise_mb"].get(k), 0) + (" (peak)" if results[n].get("peak_rss_part") == k
                                                                 else "") for n in peaks) + " |")
    return "\n".join(lines)


def plot_rewards(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in results.items():
        curve = res.get("reward_curve") or []
        pts = [(i + 1, v) for i, v in enumerate(curve) if v is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3, label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward (TRL `reward`)")
    ax.set_title("Reward per step, same prompts and seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args) -> int:
    """Run every variant of the benchmark `args` (see apps/bench.py) asks for; returns the exit code."""
    out_dir = Path(args.out) if args.out else ROOT / "outputs" / "bench" / time.strftime("%Y-%m-%d_%H-%M-%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    base_spec = {"common": common_overrides(args), "threads": args.threads, "steps": args.steps,
                 "warmup": args.warmup, "profile": args.profile, "reward_curve_steps": args.reward_curve_steps,
                 "prompts_per_step": args.prompts_per_step, "fixed_length": args.fixed_length}
    variants = {}
    if not args.no_baseline:
        for baseline in dict.fromkeys(args.baseline or ["fp32"]):
            variants[BASELINE_NAMES[baseline]] = {**base_spec, "kind": "trl", "overrides": [],
                                                  "trl_defaults": baseline == "trl-defaults"}
    limits = machine_limits(args.threads)
    print(f"[bench] machine: GEMM peak fp32 {limits['gemm_gflops']['fp32']:.0f} GFLOP/s, bf16 "
          f"{limits['gemm_gflops']['bf16']:.0f} GFLOP/s; memory read {limits['read_gb_s']:.1f} GB/s "
          f"({args.threads} threads, {limits['seconds']:.1f} s)", flush=True)
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

    results = run_rounds(variants, out_dir, args.rounds)
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
        "command": " ".join(["grpo-bench", *sys.argv[1:]]),
        "settings": {k: v for k, v in vars(args).items() if k not in ("child", "out")},
        "machine": machine_info(),
        "machine_limits": limits,
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

    main_table = table(results, ratio_of, ratios_vs)
    md = ["# Benchmark: grpo-exp vs plain TRL GRPOTrainer\n", f"`{report['command']}`\n",
          f"Machine: {report['machine']}; GEMM peak fp32 {limits['gemm_gflops']['fp32']:.0f} / bf16 "
          f"{limits['gemm_gflops']['bf16']:.0f} GFLOP/s, memory read {limits['read_gb_s']:.1f} GB/s "
          f"({args.threads} threads)\n", main_table, ""]
    rounds_md = rounds_table(results, rounds_vs, orders) if orders else ""
    if rounds_md:
        md += ["## Rounds\n", rounds_md, ""]
    prof = profile_table(results)
    if prof:
        md += ["## Profile\n", prof, ""]
    (out_dir / "bench.md").write_text("\n".join(md) + "\n")
    print("\n" + main_table)
    if rounds_md:
        print("\n" + rounds_md)
    if prof:
        print("\n" + prof)
    print(f"\n[bench] wrote {out_dir / 'bench.json'} and bench.md")
    return 0 if all(r.get("status") == "ok" for r in results.values()) else 1


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order the variants run in, round by round: as given, then reversed, and so on (A B C, C B A, A B C), so
    that over an even number of rounds no variant always runs first, in the machine's freshest (or slowest)
    minutes."""
    return [names if r % 2 == 0 else names[::-1] for r in range(rounds)]


def run_rounds(variants: dict, out_dir: Path, rounds: int, runner=None) -> dict:
    """Every variant's result, over `rounds` rounds of one child each (merge_rounds), in round_orders' order;
    `runner` runs one child (run_child)."""
    runner = runner or run_child
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r, names in enumerate(round_orders(list(variants), rounds), start=1):
        for name in names:
            runs[name].append(runner(name, variants[name], out_dir, r if rounds > 1 else None))
    return {name: merge_rounds(found) for name, found in runs.items()}


def rounds_table(results: dict, rounds_vs: dict, orders: list[list[str]]) -> str:
    """Each variant's tokens/s round by round, and its ratio to each baseline in the same round."""
    n = len(orders)
    head = ("| variant | " + " | ".join(f"round {r + 1} tok/s" for r in range(n))
            + "".join(f" | vs {b} per round | vs {b} median [lowest, highest]" for b in rounds_vs) + " |")
    lines = [f"Order: {'; '.join(', '.join(o) for o in orders)}.\n", head, "|---" * (head.count("|") - 1) + "|"]
    for name, res in results.items():
        cells = [fmt(r.get("completion_tokens_per_s"), 1) for r in res.get("rounds") or []]
        cells += ["-"] * (n - len(cells))
        for b in rounds_vs:
            rr = rounds_vs[b].get(name)
            cells += ([", ".join(fmt(v) for v in rr["completion_tokens_per_s"]),
                       f"{fmt(rr['median'])} [{fmt(rr['min'])}, {fmt(rr['max'])}]"] if rr else ["-", "-"])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_limits(threads: int, size: int = 1536, reps: int = 3) -> dict:
    """The machine's GEMM peak (fp32, bf16) and memory read bandwidth with `threads` threads, in a few seconds:
    the best of a few square products and of a few sums over 256 MB (larger than any cache)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    t_start = time.perf_counter()
    try:
        peaks = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
            best = _best_time(lambda: torch.mm(a, b), reps)
            peaks[name] = 2 * size ** 3 / best / 1e9
        data = torch.ones(64 * 1024 * 1024)
        read = data.numel() * 4 / _best_time(data.sum, reps) / 1e9
    finally:
        torch.set_num_threads(saved)
    return {"gemm_gflops": {k: round(v, 1) for k, v in peaks.items()}, "read_gb_s": round(read, 2),
            "threads": threads, "seconds": round(time.perf_counter() - t_start, 2)}


def _best_time(fn, reps: int) -> float:
    fn()  # warm-up (first-touch, oneDNN primitive creation)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def step_floor(res: dict, limits: dict) -> dict:
    """The machine's floor for one optimizer step of this variant (see the module docstring) and the variant's
    mean step time as a multiple of it."""
    model = res["model_shape"]
    n = model["matmul_params"]
    peaks = limits["gemm_gflops"]
    dtype = "bf16" if peaks["bf16"] > peaks["fp32"] else "fp32"
    peak = peaks[dtype] * 1e9
    weight_bytes = n * (2 if dtype == "bf16" else 4)
    bandwidth = limits["read_gb_s"] * 1e9
    steps = [s for s in res["steps"] if s["measured"]]
    spg = res["settings"]["steps_per_generation"] or 1
    rows = res["settings"]["generation_batch_size"]
    groups = res["settings"]["num_generations"]
    per_step = res["settings"]["per_device_train_batch_size"] * res["settings"]["gradient_accumulation_steps"]
    completion_tokens = res["completion_tokens"] / len(steps) if steps else 0.0  # a round's, spread over its steps
    prompt_tokens = model["prompt_tokens_mean"]
    train_flops = 6 * n * (completion_tokens + prompt_tokens * per_step / groups)
    decode_steps = [s["max_length"] for s in steps if s.get("max_length") is not None]
    decode = statistics.mean(decode_steps) if decode_steps else res["settings"]["max_completion_length"]
    per_decode_step = max(weight_bytes / bandwidth, 2 * n * rows / peak)
    generation_s = (2 * n * prompt_tokens * rows / groups / peak + decode * per_decode_step) / spg
    floor = train_flops / peak + generation_s
    step = res.get("step_time_s_mean")
    return {"floor_s": round(floor, 4), "train_s": round(train_flops / peak, 4), "generation_s": round(generation_s, 4),
            "decode_bound": "memory" if weight_bytes / bandwidth >= 2 * n * rows / peak else "compute",
            "dtype": dtype, "matmul_params": n, "decode_steps": round(decode, 1),
            "completion_tokens_per_step": round(completion_tokens, 1), "prompt_tokens_mean": round(prompt_tokens, 1),
            "multiple": round(step / floor, 2) if step and floor else None}


def machine_info() -> str:
    import platform

    flags = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    f = set(line.split(":", 1)[1].split())
                    flags = ",".join(x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in f)
                    break
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus ({flags})"


# ------------------------------------------------------------------------------------------------------ child side


class StepRecorder:
    """A TrainerCallback timing each optimizer step and reading TRL's per-step log line; with `profile`,
    also a set of timers the child wraps around the trainer's methods, and which of those parts raised the
    process's peak RSS (VmHWM, read as each part ends: one small file read, not a sampler thread)."""

    def __init__(self, gen_batch: int, profile: bool):
        from transformers import TrainerCallback

        self.gen_batch = gen_batch
        self.profile = profile
        self.steps: list[dict] = []
        self.profile_steps: list[dict] = []
        # MB by which each part raised the peak RSS over the whole run (setup: before the first step), and the
        # part in which the run's peak was reached
        self.peak_rise_mb: dict[str, float] = {}
        self.peak_part: str | None = None
        self._hwm = 0.0
        self._current: dict[str, float] = {}
        self._t0 = 0.0
        self._faults0 = 0
        self._opt_t0 = 0.0
        rec = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                rec.note_peak("other" if rec.steps else "setup")
                rec._current = {}
                rec._faults0 = _minor_faults()
                rec._t0 = time.perf_counter()

            def on_pre_optimizer_step(self, args, state, control, **kw):
                rec.note_peak("other")
                rec._opt_t0 = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kw):
                rec.add("optimizer", time.perf_counter() - rec._opt_t0)
                rec.note_peak("optimizer")

            def on_step_end(self, args, state, control, **kw):
                rec.note_peak("other")
                elapsed = time.perf_counter() - rec._t0
                # page_faults: pages the kernel had to map in (zero-filled) during the step, memory the allocator
                # gave back and took again (cpu.malloc); peak_rss_mb: the peak so far, how it grows over a run
                rec.steps.append({"step": state.global_step, "time_s": round(elapsed, 4),
                                  "page_faults": _minor_faults() - rec._faults0, "peak_rss_mb": _vmhwm_mb()})
                if rec.profile:
                    parts = {k: round(v, 4) for k, v in rec._current.items()}
                    parts["other"] = round(elapsed - sum(rec._current.values()), 4)
                    parts["step"] = round(elapsed, 4)
                    rec.profile_steps.append(parts)

            def on_log(self, args, state, control, logs=None, **kw):
                logs = logs or {}
                if "train_runtime" in logs or not rec.steps:
                    return
                row = rec.steps[-1]
                mean_len = logs.get("completions/mean_length")
                row["generated"] = mean_len is not None
                row["mean_length"] = mean_len
                row["tokens"] = float(mean_len) * rec.gen_batch if mean_len is not None else 0.0
                row["max_length"] = logs.get("completions/max_length")
                for key in ("reward", "loss", "grad_norm"):
                    if logs.get(key) is not None:
                        row[key] = logs[key]

        self.callback = _Callback()

    def add(self, part: str, seconds: float) -> None:
        self._current[part] = self._current.get(part, 0.0) + seconds

    def note_peak(self, part: str) -> None:
        """Charge any rise of the peak RSS since the last reading to `part` (what ran in between)."""
        if not self.profile:
            return
        hwm = _vmhwm_mb()
        if hwm > self._hwm:
            self.peak_rise_mb[part] = round(self.peak_rise_mb.get(part, 0.0) + hwm - self._hwm, 1)
            self.peak_part, self._hwm = part, hwm

    def wrap(self, obj, method: str, part) -> None:
        """Replace obj.method by a timed version; `part` is a name or a function of nothing giving one."""
        import functools

        original = getattr(obj, method)

        @functools.wraps(original)
        def timed(*a, **kw):
            self.note_peak("other")  # a rise since the last reading happened outside the timed parts
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                name = part() if callable(part) else part
                self.add(name, time.perf_counter() - t0)
                self.note_peak(name)

        setattr(obj, method, timed)

    def instrument(self, trainer) -> None:
        import torch

        self.wrap(trainer, "_generate", "generation")
        self.wrap(trainer, "_calculate_rewards", "rewards")
        # no-grad forwards are the old-policy (and reference) logprobs; grad-enabled ones are the policy forward
        self.wrap(trainer, "_get_per_token_logps_and_entropies",
                  lambda: "policy_forward" if torch.is_grad_enabled() else "old_logprobs")
        self.wrap(trainer.accelerator, "backward", "backward")
        if getattr(trainer, "extra_loss", None) is not None and hasattr(trainer, "extra_loss_term"):
            self.wrap(trainer, "extra_loss_term", "extra_loss")


def compose(overrides: list[str], output_dir: Path):
    from grpo_exp.config.compose import compose as compose_config

    return compose_config("train", [*overrides, f"paths.output_dir={output_dir}"])


def plain_trl_config(train, output_dir: Path, reward_weights: list[float], max_steps: int,
                     trl_defaults: bool = False, generation_kwargs: dict | None = None):
    """GRPOConfig as a plain user writes it: TRL's defaults, fp32 (on the GPU where there is one, else the
    CPU), the GRPO settings of the run. `trl_defaults`: TRL's own precision default too (bf16 on)."""
    import torch
    from trl import GRPOConfig

    precision = {} if trl_defaults else {"bf16": False}  # GRPOConfig defaults to bf16=True
    return GRPOConfig(
        output_dir=str(output_dir),
        **precision,
        use_cpu=not torch.cuda.is_available(),  # on a GPU machine the baseline runs on the GPU too
        # gradient checkpointing: TRL's default (on), as a plain user gets it
        per_device_train_batch_size=train.per_device_train_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        # the recipe's generation rounds (TRL supports them natively), so both variants run one algorithm
        steps_per_generation=train.steps_per_generation,
        generation_batch_size=train.generation_batch_size,
        num_generations=train.num_generations,
        max_completion_length=train.max_completion_length,
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_scheduler_type,
        warmup_steps=train.warmup_steps,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        beta=train.beta,
        epsilon=train.epsilon,
        loss_type=train.loss_type,
        scale_rewards=train.scale_rewards,
        temperature=train.temperature,
        top_p=train.top_p,
        top_k=train.top_k,
        repetition_penalty=train.repetition_penalty,
        mask_truncated_completions=train.mask_truncated_completions,
        num_iterations=train.num_iterations,
        seed=train.seed,
        max_steps=max_steps,
        reward_weights=list(reward_weights),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        generation_kwargs=generation_kwargs or None,
    )


def child_main(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    out = Path(spec["dir"])
    ours = spec["kind"] == "grpo-exp"
    env_names = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")
    cfg = compose(spec["common"] + (spec["overrides"] if ours else []), out)
    from grpo_exp.base import cpu

    if ours:
        cpu.prepare_env(cfg.cpu)  # as the entrypoint does: OpenMP settings before torch loads
    env_at_start = {k: os.environ.get(k) for k in env_names}
    import torch

    from grpo_exp.base.cpu import resolve_precision
    from grpo_exp.config.checks import validate
    from grpo_exp.config.schema import generation_batch
    from grpo_exp.core import models
    from grpo_exp.training.stage import prepare

    loadavg_start = os.getloadavg()
    gen_batch, spg = generation_batch(cfg.train)
    measured = math.ceil(spec["steps"] / spg) * spg  # whole generation rounds
    total = max(spec["warmup"] + measured, spec["reward_curve_steps"])
    measured = (total - spec["warmup"]) // spg * spg
    cfg.train.max_steps = total
    cfg.train.save_steps = total + 1  # no checkpoint inside the measurement
    cfg.stage.num_train = max(64, 2 * total * spec["prompts_per_step"])
    # --fixed-length: no EOS before the token limit (generate's min_new_tokens; the engine honours it too), so
    # every variant generates and trains on the same number of tokens and tokens/s compares speed alone
    from omegaconf import OmegaConf

    generation_kwargs = {"min_new_tokens": cfg.train.max_completion_length} if spec.get("fixed_length") else {}
    if ours and generation_kwargs:
        cfg.train.extra = {**OmegaConf.to_container(cfg.train.extra), "generation_kwargs": generation_kwargs}
    validate(cfg)
    models.check_available(cfg.model, cfg.paths.cache_dir)

    if ours:
        threads = cpu.apply(cfg.cpu)
    else:
        torch.set_num_threads(spec["threads"])  # same thread count; everything else as TRL sets it
        threads = {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads()}
    t0 = time.perf_counter()
    parts = prepare(cfg)  # the same seeded rewards, problems and model as a training run, for every variant
    load_s = time.perf_counter() - t0

    recorder = StepRecorder(gen_batch, spec["profile"])
    if ours:
        from grpo_exp.training.trainer import build_trainer

        trainer = build_trainer(cfg, parts, output_dir=out, callbacks=[recorder.callback])
    else:
        from trl import GRPOTrainer

        trainer = GRPOTrainer(model=parts.model, reward_funcs=parts.reward_funcs, train_dataset=parts.train_dataset,
                              processing_class=parts.tokenizer, callbacks=[recorder.callback],
                              args=plain_trl_config(cfg.train, out / "checkpoints", parts.reward_weights, total,
                                                    trl_defaults=spec.get("trl_defaults", False),
                                                    generation_kwargs=generation_kwargs))
    if spec["profile"]:
        recorder.instrument(trainer)
    a = trainer.args
    settings = {
        "bf16": bool(a.bf16), "gradient_checkpointing": bool(a.gradient_checkpointing),
        "steps_per_generation": a.steps_per_generation, "generation_batch_size": a.generation_batch_size,
        "cache_implementation": a.cache_implementation, "threads": threads["threads"],
        "precision": resolve_precision(cfg.train.precision) if ours else ("bf16" if a.bf16 else "fp32"),
        "learning_rate": a.learning_rate, "num_generations": a.num_generations,
        "per_device_train_batch_size": a.per_device_train_batch_size,
        "max_completion_length": a.max_completion_length,
        "gradient_accumulation_steps": a.gradient_accumulation_steps,
        # what sampled the completions (train.rollout=auto resolves by machine; the engine may decline a model)
        "rollout": "engine" if getattr(trainer, "rollout_engine", None) is not None else "trl",
        # the engine's copy (bfloat16, bfloat16 autocast, float32) and whether its Linear weights are packed
        "rollout_copy": getattr(getattr(trainer, "rollout_engine", None), "label", None),
        "rollout_packed": bool(getattr(getattr(trainer, "rollout_engine", None), "packed", None)),
        "fixed_length": bool(generation_kwargs),
        "shared_prefix": bool(getattr(trainer, "share_prefixes", False)),
        "attention": getattr(parts.model.config, "_attn_implementation", None),
        # peft=lora: the adapter rank and how many parameters train (the optimizer state scales with them)
        "peft": f"lora r={cfg.peft.r}" if ours and cfg.peft.name == "lora" else "none",
        "trainable_params": sum(p.numel() for p in parts.model.parameters() if p.requires_grad),
    }
    assert a.generation_batch_size == gen_batch, (a.generation_batch_size, gen_batch)
    trainer.train()
    import shutil

    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a final checkpoint is no benchmark output
    for i, row in enumerate(recorder.steps):
        row.setdefault("tokens", 0.0)
        row["measured"] = spec["warmup"] <= i < spec["warmup"] + measured
    settings_text = (f"{settings['precision']}, grad-ckpt {'on' if settings['gradient_checkpointing'] else 'off'}, "
                     f"gen batch {gen_batch}" + (f", cache {settings['cache_implementation']}"
                                                 if settings["cache_implementation"] else "")
                     + (", shared prefix" if settings["shared_prefix"] else "")
                     + (f", {settings['attention']} attention" if settings["attention"] not in (None, "sdpa") else "")
                     + (f", {settings['peft']}" if settings["peft"] != "none" else "")
                     + (f", rollout engine ({settings['rollout_copy']} copy"
                        f"{', packed' if settings['rollout_packed'] else ''})"
                        if settings["rollout"] == "engine" else "")
                     + (", fixed length" if settings["fixed_length"] else "") + f", {settings['threads']} thr")
    result = {
        "name": spec["name"], "kind": spec["kind"], "overrides": spec["overrides"], "settings": settings,
        "settings_text": settings_text, "prompts_per_step": spec["prompts_per_step"], "model": cfg.model.name,
        "model_load_s": round(load_s, 2), "warmup_steps": spec["warmup"], "total_steps": total,
        "child_vmhwm_mb": _vmhwm_mb(), "steps": recorder.steps,
        "model_shape": model_shape(parts.model, parts.tokenizer, parts.train_dataset),
        "profile_steps": recorder.profile_steps or None,
        "peak_rss_part": recorder.peak_part, "peak_rss_rise_mb": recorder.peak_rise_mb or None,
        "torch": torch.__version__, "env": {k: os.environ.get(k) for k in env_names},
        "env_at_start": env_at_start,  # what OpenMP read when torch loaded (grpo-exp: after grpo_exp's default)
        "loadavg_end": os.getloadavg(), "loadavg_start": loadavg_start,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return 0


def model_shape(model, tokenizer, dataset, prompts: int = 64) -> dict:
    """What the floor needs: the parameters that multiply (a tied LM head counts once, the input embedding is a
    lookup) and the mean chat-templated prompt length of the first training prompts."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    total = sum(p.numel() for p in inner.parameters())
    embed = inner.get_input_embeddings().weight
    head = inner.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    matmul = total - (0 if tied else embed.numel())
    rows = [dataset[i]["prompt"] for i in range(min(prompts, len(dataset)))]
    lengths = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
               if isinstance(p, list) else len(tokenizer(p)["input_ids"]) for p in rows]
    return {"total_params": total, "matmul_params": matmul, "tied_lm_head": tied,
            "prompt_tokens_mean": statistics.mean(lengths) if lengths else 0.0}


def _vmhwm_mb() -> float:
    """The child's peak RSS so far, in MB: the kernel's high-water mark, as training's own monitor reads it."""
    from grpo_exp.base.monitor import peak_rss_mb

    return round(peak_rss_mb(), 1)


def _minor_faults() -> int:
    """The process's minor page faults so far (getrusage): each maps one page in, zero-filled when it is new."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
