"""`grpo-bench --matrix`'s figures for reading, all from matrix.json (matrix.py writes it): matrix.csv (one row
per point), matrix.md (the table and the machine's probe), matrix.png (grpo-exp's tokens/s ratio to each
baseline and each variant's x floor, per point) and, with --page, a results page with the header the bench's
pages have (page.provenance_lines), the table and the plot."""

from __future__ import annotations

import csv
import shlex
from datetime import datetime
from pathlib import Path

from grpo_exp.analysis import provenance
from grpo_exp.analysis.bench.floor import moved_line
from grpo_exp.analysis.bench.page import provenance_lines
from grpo_exp.analysis.bench.parent import shown
from grpo_exp.analysis.bench.tables import fmt

OVER_MEMORY = "left out: over memory"  # the status of a point --skip-over-memory did not run

# the variants as the matrix names them (bench.json's names), and as its columns and legends show them
LABELS = {"grpo-exp": "grpo-exp", "baseline": "TRL fp32", "trl-defaults": "TRL defaults"}
COLUMN = {"grpo-exp": "grpo_exp", "baseline": "trl_fp32", "trl-defaults": "trl_defaults"}
BASELINES = ("baseline", "trl-defaults")
VARIANTS = ("grpo-exp", *BASELINES)


def summary(row: dict) -> str:
    """A point's figures in a line (the log line as a point ends)."""
    parts = [f"grpo-exp {fmt(r)}x {LABELS[b]} tok/s" for b, r in (row.get("ratio") or {}).items() if r]
    floor = (row.get("x_floor_point") or {}).get("grpo-exp")
    rss = (row.get("rss_ratio") or {}).get("grpo-exp")
    return ", ".join(parts + ([f"{fmt(floor, 1)}x its floor"] if floor else [])
                     + ([f"peak RSS {fmt(rss)}x TRL fp32's"] if rss else []))


def csv_rows(report: dict) -> list[dict]:
    """matrix.csv's rows: every column on every row (empty where a variant did not run), so two matrices'
    files have the same columns."""
    rows = []
    for p in report["points"]:
        probe = p.get("probe") or {}
        best, spread = probe.get("best") or {}, probe.get("spread") or {}
        row = {k: p.get(k) for k in ("point", "model", "length", "group", "status", "estimate_mb")}
        for key in ("s_per_step", "tokens_per_s", "x_floor", "peak_rss_mb"):
            row.update({f"{key}_{COLUMN[n]}": (p.get(key) or {}).get(n) for n in VARIANTS})
        for key in ("ratio", "step_speedup"):
            row.update({f"{key}_vs_{COLUMN[b]}": (p.get(key) or {}).get(b) for b in BASELINES})
        row.update({f"rss_ratio_{COLUMN[n]}": (p.get("rss_ratio") or {}).get(n) for n in ("grpo-exp", "trl-defaults")})
        row.update(probe_gemm_fp32_gflops=(best.get("gemm_gflops") or {}).get("fp32"),
                   probe_gemm_bf16_gflops=(best.get("gemm_gflops") or {}).get("bf16"),
                   probe_read_gb_s=best.get("read_gb_s"), probe_spread_fp32=spread.get("fp32"),
                   probe_spread_bf16=spread.get("bf16"))
        rows.append(row)
    return rows


def table(report: dict) -> str:
    """One row per point: s/step of each variant, grpo-exp's tokens/s ratio to each baseline, x floor of each
    variant (against the matrix's best probe reading), grpo-exp's peak RSS and each peak RSS ratio to TRL fp32."""
    bases = [b for b in BASELINES if b in report.get("baselines", [])]
    names = ["grpo-exp", *bases]
    head = ("| point | model | length | group | " + " | ".join(f"{LABELS[n]} s/step" for n in names)
            + " | " + " | ".join(f"tok/s vs {LABELS[b]}" for b in bases)
            + " | " + " | ".join(f"x floor {LABELS[n]}" for n in names)
            + " | grpo-exp peak RSS MB | " + " | ".join(f"{LABELS[n]} RSS vs TRL fp32" for n in names if n != "baseline")
            + " |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for p in report["points"]:
        cells = [f"`{p['point']}`", p["model"], str(p["length"]), str(p["group"])]
        if p["status"] != "ok":
            what = (p["status"] if p["status"] == "not run" else
                    f"{p['status']} (estimated peak {p['estimate_mb'] / 1024:.1f} GB)" if p["status"] == OVER_MEMORY
                    else f"FAILED ({', '.join(p.get('failed') or []) or 'no variant ran'})")
            lines.append("| " + " | ".join(cells + [what] + [""] * (head.count("|") - 6)) + " |")
            continue
        cells += [fmt(p["s_per_step"].get(n)) for n in names]
        cells += [fmt(p["ratio"].get(b)) for b in bases]
        cells += [fmt(p["x_floor"].get(n), 1) for n in names]
        cells += [fmt(p["peak_rss_mb"].get("grpo-exp"), 0)]
        cells += [fmt(p["rss_ratio"].get(n)) for n in names if n != "baseline"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def probe_text(report: dict) -> str:
    """The machine's probe over the matrix: its best readings (what every x floor is against) and their spread."""
    best, probe = report.get("machine_limits"), report.get("probe")
    if not best or not probe:
        return "No point was measured: no probe reading."
    threads = f"{best.get('threads')} thread{'' if best.get('threads') == 1 else 's'}"
    peaks, spread = best["gemm_gflops"], probe["spread"]
    text = (f"The machine's probe, best of {probe['readings']} readings over the points (before, between and after "
            f"each point's variants, with {threads}): GEMM peak fp32 {fmt(peaks['fp32'], 0)} GFLOP/s, bf16 "
            f"{fmt(peaks['bf16'], 0)} GFLOP/s; memory read {fmt(best['read_gb_s'], 1)} GB/s; their spread: fp32 "
            f"{spread['fp32']:.0%}, bf16 {spread['bf16']:.0%}. Every x floor is against these best figures.")
    moved = moved_line(probe)
    return text + (f"\n\n**Warning:** {moved.replace('the bench', 'the matrix')}." if moved else "")


def notes(report: dict) -> list[str]:
    """The lines every reading of the matrix carries: a baseline left out, and why."""
    return [f"**{LABELS.get(n, n)} left out:** {why}." for n, why in (report.get("skipped_baselines") or {}).items()]


def markdown(report: dict) -> str:
    return "\n\n".join([*notes(report), probe_text(report), table(report)]) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Two panels of grouped bars: grpo-exp's tokens/s ratio to each baseline per point (1 = as fast), and each
    variant's x floor per point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    points = [p for p in report["points"] if p["status"] == "ok"]
    if not points:
        return False
    bases = [b for b in BASELINES if b in report.get("baselines", [])]
    labels = [f"{p['model']}\nL{p['length']} G{p['group']}" for p in points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 1.3 * len(points) + 2), 7), sharex=True)
    for ax, names, key, title in ((top, bases, "ratio", "grpo-exp tokens/s over each baseline's (1 = as fast)"),
                                  (bottom, ["grpo-exp", *bases], "x_floor",
                                   "step time as a multiple of the machine's floor (best probe reading)")):
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(points))]
            ys = [(p.get(key) or {}).get(name) or 0.0 for p in points]
            ax.bar(xs, ys, width, label=f"vs {LABELS[name]}" if key == "ratio" else LABELS[name])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    top.axhline(1.0, color="black", linewidth=0.8)
    bottom.set_xticks(range(len(points)))
    bottom.set_xticklabels(labels, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_all(report: dict, out: Path) -> list[Path]:
    """matrix.csv, matrix.md and matrix.png into `out`; returns the files written."""
    rows = csv_rows(report)
    with open(out / "matrix.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["point"])
        writer.writeheader()
        writer.writerows(rows)
    (out / "matrix.md").write_text(f"# Scale matrix: grpo-exp against plain TRL\n\n`{report['command']}`\n\n"
                                   + markdown(report))
    written = [out / "matrix.json", out / "matrix.csv", out / "matrix.md"]
    if plot(report, out / "matrix.png"):
        written.append(out / "matrix.png")
    return written


def _dates(report: dict) -> str:
    """When the points were measured (the earliest start and latest end of their benches)."""
    started = [p["started"] for p in report["points"] if p.get("started")]
    ended = [p["ended"] for p in report["points"] if p.get("ended")]
    if not started or not ended:
        return "no point measured"
    first, last = datetime.fromisoformat(min(started)), datetime.fromisoformat(max(ended))
    return f"points measured from {provenance.stamp(first)} to {provenance.stamp(last)}"


def write_page(report: dict, out: Path, page: str | Path, machine: str | None, now: datetime | None = None) -> Path:
    """The results page: the header (page.provenance_lines), the skipped baselines, the probe, the table and the
    plot (into docs/results/<name>/matrix.png). Rerunning the matrix's command writes it again without measuring
    anything (every point is kept)."""
    page = Path(page)
    commits = list(dict.fromkeys(p["commit"] for p in report["points"] if p.get("commit")))
    made_by = (f"`{report['command']}` (with the matrix); rerunning it keeps every measured point and writes "
               f"matrix.json and this page again")
    points = report["points"]
    ok = sum(p["status"] == "ok" for p in points)
    s = report.get("settings") or {}
    lines = [f"# Results: {page.stem}", "",
             "<!-- Written by grpo-bench --matrix from matrix.json; do not edit: rerun the page's command. -->", "",
             *provenance_lines(report, made_by, machine, "grpo-bench", _dates(report), commits, now, what="matrix"),
             f"- **Matrix:** `{shown(out)}`: {len(points)} points ({ok} ran to the end), models "
             f"{', '.join(f'`{m}`' for m in s.get('models') or [])} x completion lengths "
             f"{', '.join(map(str, s.get('lengths') or []))} x groups {', '.join(map(str, s.get('groups') or []))}; "
             f"each point one bench of grpo-exp against {', '.join(LABELS[b] for b in report['baselines'])}, its "
             f"folder `{shown(out)}/<point>/` (`grpo-report <that folder> --page ...` gives its own page)",
             f"- **Settings:** {s.get('prompts_per_step')} prompts per step, {s.get('steps')} measured steps after "
             f"{s.get('warmup')} warm-up, {s.get('rounds')} round(s), {s.get('threads')} threads, seed {s.get('seed')}, "
             f"stage `{s.get('stage')}`"
             + (f", beta {s['beta']}" if s.get("beta") is not None else ", the stage's beta")
             + (", fixed length" if s.get("fixed_length") else "")
             + (f", overrides {shlex.join(s['override'])}" if s.get("override") else ""), ""]
    lines += ["## The points", "", *[n + "\n" for n in notes(report)], probe_text(report), "",
              "`tok/s vs`: grpo-exp's completion tokens/s over the baseline's, in the same point; `x floor`: the mean "
              "step as a multiple of the machine's floor (docs/performance.md, \"The bench and the floor\"); `RSS vs "
              "TRL fp32`: the variant's peak RSS over plain TRL fp32's.", "", table(report), ""]
    assets = page.with_suffix("")
    (assets / "matrix.png").unlink(missing_ok=True)  # a plot of an earlier matrix must not linger
    if ok:
        assets.mkdir(parents=True, exist_ok=True)
    if ok and plot(report, assets / "matrix.png"):
        lines += ["## The plot", "", f"![matrix]({assets.name}/matrix.png)", ""]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines))
    return page
