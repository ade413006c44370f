"""The report's PNGs: throughput and memory against threads and batch size, reward and held-out
accuracy curves, forgetting KL, curriculum accuracy matrices and fp32 vs int8. Each function takes the
jobs (report.load_job) or the report's frame and returns the PNG's path, or None when the runs hold
nothing to draw."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pandas as pd

from grpo_exp.analysis import aggregates


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _numeric(series: pd.Series) -> pd.Series:
    return pd.to_numeric(series, errors="coerce")


def plot_throughput_memory(df: pd.DataFrame, out: Path) -> Path | None:
    done = df[df["status"] == "completed"].copy()
    if done.empty or not {"threads", "batch_size"} <= set(done.columns):
        return None
    done["threads"] = _numeric(done["threads"])
    done["batch_size"] = _numeric(done["batch_size"])
    done["completion_tokens_per_s"] = _numeric(done["completion_tokens_per_s"])
    done["peak_rss_mb"] = _numeric(done["peak_rss_mb"])
    if done[["completion_tokens_per_s", "peak_rss_mb"]].isna().all().all():
        return None
    multi_model = "model" in done.columns and done["model"].nunique() > 1
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("threads", "batch_size", "completion_tokens_per_s", "completion tokens / s"),
              ("batch_size", "threads", "completion_tokens_per_s", "completion tokens / s"),
              ("threads", "batch_size", "peak_rss_mb", "peak RSS (MB)"),
              ("batch_size", "threads", "peak_rss_mb", "peak RSS (MB)")]
    for ax, (x, by, y, ylabel) in zip(axes.flat, panels):
        keys = [by, "model"] if multi_model else [by]
        for key, group in done.dropna(subset=[x, y]).groupby(keys):
            key = key if isinstance(key, tuple) else (key,)
            group = group.sort_values(x)
            label = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in zip(keys, key))
            ax.plot(group[x], group[y], marker="o", label=label)
        ticks = sorted(done[x].dropna().unique())
        if ticks:
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Throughput and peak memory vs threads and batch size")
    return _save(plt, fig, out / "throughput_memory.png")


def _history_points(history: list[dict], key: str) -> list[tuple[int, float]]:
    """(cumulative step, value) of every history row that logged `key`."""
    return [(r.get("global_step", r.get("step")), r[key]) for r in history if isinstance(r.get(key), (int, float))]


def step_label(jobs: list[dict]) -> str:
    """The x label: "cumulative over stages" only where some job's steps continue an earlier stage's."""
    later = any(r.get("global_step", r.get("step")) != r.get("step") for job in jobs for r in job["history"])
    return "step (cumulative over stages)" if later else "step"


def _line_plot(curves: list[tuple[str, list]], ylabel: str, title: str, path: Path,
               marker: str | None = None, xlabel: str = "step") -> Path | None:
    """One line per (label, points), against the (cumulative) step."""
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    for label, points in curves:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker=marker or ("." if len(xs) < 50 else None), label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_reward_curves(jobs: list[dict], labels: list[str], out: Path) -> Path | None:
    curves = [(label, points) for job, label in zip(jobs, labels)
              if (points := _history_points(job["history"], "reward"))]
    return _line_plot(curves, "mean reward", "Reward per variant", out / "reward_curves.png", xlabel=step_label(jobs))


def base_level(job: dict, name: str) -> tuple[str, float] | None:
    """The learning curve's dashed level: aggregates.validation_start as (label, accuracy)."""
    start = aggregates.validation_start(job, name)
    return None if start is None else (f"{start[0]}, n={start[2]}", start[1])


def plot_learning_curve(jobs: list[dict], labels: list[str], path: Path) -> Path | None:
    """Greedy validation accuracy against step (eval.every_steps), one line per job (seed or variant) and
    set, with the starting model's figure (base_level) as a dashed level in the line's colour."""
    curves = [(job, f"{label} ({name})" if len(job.get("periodic") or {}) > 1 else label, name, points)
              for job, label in zip(jobs, labels) for name, points in (job.get("periodic") or {}).items()]
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 5))
    for k, (job, label, name, points) in enumerate(curves):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{k % 10}", label=label)
        level = base_level(job, name)
        if level is not None:
            ax.axhline(level[1], ls="--", lw=1, color=f"C{k % 10}", label=f"{label}: {level[0]}")
    ax.set_xlim(left=0)  # from the start of training, where the dashed levels were measured
    ax.set_xlabel(step_label(jobs))
    ax.set_ylabel("greedy accuracy, validation split")
    ax.set_title("Validation accuracy during training (dashed: the model before training)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def plot_forgetting_kl(jobs: list[dict], labels: list[str], out: Path) -> Path | None:
    """KL from the previous stage's policy on each earlier stage's prompts (eval.forgetting_sets), one line
    per label and earlier stage: how far a later stage moves the policy where it was trained before. Jobs that
    share a label (a method's seeds) make one line, their mean at the steps all of them logged."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for job, label in zip(jobs, labels):
        keys = sorted({k for r in job["history"] for k in r if k.startswith("forgetting/") and k.endswith("/kl")})
        for key in keys:
            runs.setdefault((label, key.split("/")[1]), []).append(dict(_history_points(job["history"], key)))
    curves = []
    for (label, stage), points in runs.items():
        steps = sorted(set.intersection(*(set(p) for p in points)))
        name = f"{label} ({stage})" + (f", mean of {len(points)}" if len(points) > 1 else "")
        curves.append((name, [(s, sum(p[s] for p in points) / len(points)) for s in steps]))
    return _line_plot([c for c in curves if c[1]], "KL(previous stage || now), nats per completion",
                      "Forgetting: KL from the previous stage's policy on earlier stages' prompts",
                      out / "forgetting_kl.png", marker="o", xlabel=step_label(jobs))


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curriculum(curriculum: dict, title: str, path: Path) -> Path | None:
    stages = curriculum.get("stages") or []
    matrix = curriculum.get("matrix") or []
    if not stages or not matrix:
        return None
    # a sequential curriculum's rows are its stages; an adaptive one's single row is named in row_labels
    labels = curriculum.get("row_labels") or stages
    rows = ([("base", curriculum["base"])] if curriculum.get("base") else []) + list(zip(labels, matrix))
    values = [[(r[j] if j < len(r) and r[j] is not None else float("nan")) for j in range(len(stages))]
              for _, r in rows]
    plt = _plt()
    import numpy as np

    data = np.array(values, dtype=float)
    fig, ax = plt.subplots(figsize=(1.6 * len(stages) + 3, 0.8 * len(rows) + 2))
    image = ax.imshow(np.ma.masked_invalid(data), vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(stages)), stages)
    ax.set_yticks(range(len(rows)), [f"after {n}" if n != "base" else "base" for n, _ in rows])
    ax.set_xlabel("evaluated on")
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            if not math.isnan(data[i, j]):
                ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center",
                        color="white" if data[i, j] < 0.5 else "black")
    fig.colorbar(image, ax=ax, label="accuracy")
    extra = f"avg acc {curriculum['average_accuracy']:.3f}" if curriculum.get("average_accuracy") is not None else ""
    if curriculum.get("bwt") is not None:
        extra += f", BWT {curriculum['bwt']:+.3f}"
    ax.set_title(f"{title}\n{extra}".strip())
    return _save(plt, fig, path)


def _mean_cells(rows: list[list[float | None]]) -> list[float | None]:
    """Cell by cell, the mean of the values present (None where no record has one)."""
    width = max(len(r) for r in rows)
    cells = [[r[j] for r in rows if j < len(r) and r[j] is not None] for j in range(width)]
    return [sum(c) / len(c) if c else None for c in cells]


def _mean_of(curricula: list[dict], key: str) -> float | None:
    values = [c.get(key) for c in curricula]
    return sum(values) / len(values) if values and all(v is not None for v in values) else None


def plot_curriculum_means(curricula: list[tuple[str, dict]], out_dir: Path) -> list[Path]:
    """One accuracy-matrix heatmap per method (accuracy_matrix_<method>.png): each cell the mean over the method's
    finished seeds of one stage list, the seeds named in the title; the base row where every seed scored it."""
    by_method: dict[str, list[dict]] = {}
    for label, cur in curricula:
        by_method.setdefault(label, []).append(cur)
    made = []
    for label, curs in by_method.items():
        same = [c for c in curs if c["stages"] == curs[0]["stages"] and len(c["matrix"]) == len(curs[0]["matrix"])]
        mean = {"stages": same[0]["stages"], "row_labels": same[0].get("row_labels"),
                "matrix": [_mean_cells([c["matrix"][i] for c in same]) for i in range(len(same[0]["matrix"]))],
                "base": _mean_cells([c["base"] for c in same]) if all(c.get("base") for c in same) else None,
                "average_accuracy": _mean_of(same, "average_accuracy"), "bwt": _mean_of(same, "bwt")}
        seeds = ", ".join(str(c.get("seed")) for c in same)
        slug = "".join(ch if ch.isalnum() else "_" for ch in label).strip("_").lower()
        title = f"Accuracy matrix: {label}\nmean over {len(same)} seed{'s' * (len(same) != 1)} ({seeds})"
        path = plot_curriculum(mean, title, out_dir / f"accuracy_matrix_{slug}.png")
        if path:
            made.append(path)
    return made


def plot_continual_metrics(values: dict[str, dict[str, list[float]]], path: Path) -> Path | None:
    """continual_metrics.png: one panel per continual-learning metric, one row per method, each seed a dot and the
    mean over seeds a bar with its 95% t interval over seeds. `values`: method -> metric -> one value per seed
    (analysis/continual.seed_metrics)."""
    from grpo_exp.evaluation.stats import mean_interval

    metrics = list(dict.fromkeys(m for per_method in values.values() for m in per_method))
    if not metrics:
        return None
    plt = _plt()
    methods = list(values)
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 0.5 * len(methods) * rows + 1.6 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for y, method in enumerate(methods):
            seeds = values[method].get(metric)
            if not seeds:
                continue
            ax.scatter(seeds, [y] * len(seeds), s=14, color="0.6", zorder=2)
            mean, interval = statistics.fmean(seeds), mean_interval(seeds)
            if interval:
                ax.plot(interval, [y, y], color="black", linewidth=1.5, zorder=3)
            ax.scatter([mean], [y], s=40, color="black", marker="|" if interval else "o", zorder=4)
        ax.axvline(0, color="0.85", linewidth=0.8, zorder=1)
        ax.set_yticks(range(len(methods)), methods if ax in axes[:, 0] else [""] * len(methods), fontsize=8)
        ax.set_ylim(-0.6, len(methods) - 0.4)
        ax.invert_yaxis()
        ax.set_title(metric, fontsize=10)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    fig.suptitle("Continual-learning metrics: seeds (grey), mean and 95% t interval over seeds (black)", fontsize=10)
    return _save(plt, fig, path)


def plot_quantization(jobs: list[dict], out: Path) -> Path | None:
    """Accuracy (and speed, size when recorded) of evaluations with quantization none vs dynamic_int8."""
    by_method: dict[str, dict[str, list[dict]]] = {}
    for job in jobs:
        if job["eval"] and job["row"]["status"] == "completed":
            method = str(job["quantization"] or "none")
            for name, values in job["eval"].items():
                by_method.setdefault(method, {}).setdefault(name, []).append(values)
    if not {"none", "dynamic_int8"} <= set(by_method):
        return None
    sets = sorted(set(by_method["none"]) & set(by_method["dynamic_int8"]))
    if not sets:
        return None
    panels = [(k, t) for k, t in (("accuracy", "accuracy"), ("tokens_per_s", "tokens / s"),
                                  ("model_size_mb", "model size (MB)"))
              if any(k in v for m in ("none", "dynamic_int8") for s in sets for v in by_method[m][s])]
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    width = 0.38
    for ax, (key, title) in zip(axes[0], panels):
        for k, (method, label) in enumerate((("none", "fp32"), ("dynamic_int8", "int8"))):
            means = []
            for s in sets:
                vals = [v[key] for v in by_method[method][s] if isinstance(v.get(key), (int, float))]
                means.append(statistics.mean(vals) if vals else 0.0)
            ax.bar([i + (k - 0.5) * width for i in range(len(sets))], means, width, label=label)
        ax.set_xticks(range(len(sets)), sets)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.suptitle("fp32 vs dynamic int8")
    return _save(plt, fig, out / "quantization.png")
