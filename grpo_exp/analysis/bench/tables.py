"""The bench's figures for reading: each variant's ratios to a baseline (whole runs and round by round), the
main table, the rounds table, the profile tables (time and peak-RSS rise by part of a step), the floor
table, and the reward curves' plot; `sections` makes every table of a bench from its bench.json alone
(bench.md and the results page show the same)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

PROFILE_PARTS = ("generation", "old_logprobs", "rewards", "policy_forward", "extra_loss", "backward", "optimizer")
# the tables of a bench (Section.name), as `grpo-report <bench dir> --table NAME` names them
NAMES = ("bench", "rounds", "profile", "floor")


def ratios(base: dict, other: dict) -> dict:
    def r(key, invert=False):
        a, b = base.get(key), other.get(key)
        if not a or not b:
            return None
        return round(a / b if invert else b / a, 3)

    return {"completion_tokens_per_s": r("completion_tokens_per_s"), "prompts_per_s": r("prompts_per_s"),
            "step_time_s_mean": r("step_time_s_mean"), "step_time_s_median": r("step_time_s_median"),
            "peak_rss_mb": r("peak_rss_mb"), "speedup_step_time_mean": r("step_time_s_mean", invert=True)}


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


def floor_table(results: dict, limits: dict) -> str:
    """The machine's measured limits in one line, then each variant's floor per optimizer step and its parts."""
    peaks = limits["gemm_gflops"]
    lines = [f"The best floor probe, with {limits.get('threads')} threads ({fmt(limits.get('seconds'), 1)} s of probing): "
             f"GEMM peak fp32 {fmt(peaks.get('fp32'), 0)} GFLOP/s, bf16 {fmt(peaks.get('bf16'), 0)} GFLOP/s; memory "
             f"read {fmt(limits.get('read_gb_s'), 1)} GB/s.\n",
             "| variant | floor s | scoring fwd+bwd s | generation s | decode bound | dtype | matmul params (M) "
             "| decoding steps | completion tok per step | prompt tok (mean) | step s (mean) | x floor |",
             "|---" * 12 + "|"]
    for name, res in results.items():
        floor = res.get("floor")
        if not floor:
            continue
        params = floor.get("matmul_params")
        lines.append(f"| {name} | {fmt(floor.get('floor_s'), 3)} | {fmt(floor.get('train_s'), 3)} "
                     f"| {fmt(floor.get('generation_s'), 3)} | {fmt(floor.get('decode_bound'))} | {fmt(floor.get('dtype'))} "
                     f"| {fmt(params / 1e6 if params else None, 1)} | {fmt(floor.get('decode_steps'), 1)} "
                     f"| {fmt(floor.get('completion_tokens_per_step'), 1)} | {fmt(floor.get('prompt_tokens_mean'), 1)} "
                     f"| {fmt(res.get('step_time_s_mean'))} | {fmt(floor.get('multiple'), 1)} |")
    return "\n".join(lines)


@dataclass
class Section:
    """One table of a bench: its name (NAMES), heading, a paragraph on how to read it, and the table."""

    name: str
    title: str
    intro: str
    markdown: str


def sections(report: dict) -> list[Section]:
    """Every table a bench has, from its bench.json (`report`): the main table, the rounds table (--rounds > 1),
    the profile tables (--profile) and the floor table."""
    results = report.get("variants") or {}
    ratios_vs = report.get("ratios_vs") or {}
    ratio_of = report.get("ratio_vs_baseline") or {}
    first = next((b for b, r in ratios_vs.items() if r == ratio_of), None) if ratio_of else None
    others = [b for b in ratios_vs if b != "baseline"]
    against = (f"`tok/s ratio` and `RSS ratio`: against `{first}`" if first
               else "`tok/s ratio` and `RSS ratio`: none (no baseline ran to its end)")
    against += "".join(f"; `tok/s vs {b}`: against `{b}`" for b in others)
    found = [Section("bench", "grpo-exp against plain TRL",
                     "Each variant in its own process on the same prompts, model and GRPO settings. `steps`: the "
                     "measured optimizer steps (after the warm-up, pooled over rounds); tok/s and prompts/s are their "
                     "sums over their time; peak RSS is the child's own (ru_maxrss; over rounds, the highest). "
                     f"{against}; `x floor`: the mean step as a multiple of the machine's floor.",
                     table(results, ratio_of, ratios_vs))]
    orders = report.get("round_order")
    if orders:
        found.append(Section("rounds", "Rounds",
                             "Every variant ran once per round, the order reversed every other round; each round's "
                             "tokens/s, and each variant's ratio to every baseline of the same round with their "
                             "median and range.",
                             rounds_table(results, report.get("round_ratios_vs") or {}, orders)))
    profile = profile_table(results)
    if profile:
        found.append(Section("profile", "Profile",
                             "Seconds per measured step in each part of a step (mean; share of the step), and the MB "
                             "each part raised the child's peak RSS by over its whole run ((peak): the part in which "
                             "the run's peak was reached).", profile))
    if report.get("machine_limits"):
        probe = report.get("floor_probe")
        measured = (f"the best of {probe['readings']} probes of the GEMM peak and memory bandwidth, taken before, "
                    f"between and after the variants (their spread: fp32 {probe['spread']['fp32']:.0%}, bf16 "
                    f"{probe['spread']['bf16']:.0%}{'; the machine moved during the bench' if probe['moved'] else ''})"
                    if probe else "the measured GEMM peak and memory bandwidth")
        found.append(Section("floor", "The machine's floor",
                             "The least time one optimizer step could take on this machine: scoring forward and "
                             f"backward, prefill and decoding at {measured} "
                             "(docs/performance.md, \"The bench and the floor\"). Attention, norms and the optimizer "
                             "are left out, so it is a lower bound.",
                             floor_table(results, report["machine_limits"])))
    return found

