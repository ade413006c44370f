"""The bench's figures for reading: each variant's ratios to a baseline (whole runs and round by round), the
main table, the rounds table, the profile tables (time and peak-RSS rise by part of a step), and the reward
curves' plot."""

from __future__ import annotations

import statistics
from pathlib import Path

PROFILE_PARTS = ("generation", "old_logprobs", "rewards", "policy_forward", "extra_loss", "backward", "optimizer")


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
