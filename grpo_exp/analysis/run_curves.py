"""curves.png of one run: its reward and its validation accuracy against steps, with the level the model
started from, written when the run ends so that a run draws its own picture."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_exp.base.run_files import BEFORE_AFTER_FILE, CURVES_FILE, HISTORY_FILE
from grpo_exp.analysis.plots import _history_points
from grpo_exp.base.io import read_jsonl


def write_curves(run_dir: str | Path) -> Path | None:
    """Draw `run_dir`/curves.png from history.jsonl and before_after.json; None when nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    history = read_jsonl(run_dir / HISTORY_FILE, tolerant=True)
    reward = _history_points(history, "reward")
    accuracy = {key.split("/")[1]: _history_points(history, key) for key in
                sorted({k for r in history for k in r if k.startswith("eval/") and k.endswith("/accuracy")})}
    if not reward and not accuracy:
        return None
    try:
        comparison = json.loads((run_dir / BEFORE_AFTER_FILE).read_text())
    except (OSError, ValueError):
        comparison = {}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if reward:
        left.plot(*zip(*reward), lw=1)
    left.set(xlabel="step", ylabel="mean reward (sampled completions)", title="Training reward")
    for k, (name, points) in enumerate(accuracy.items()):
        if points:
            right.plot(*zip(*points), marker="o", color=f"C{k}", label=f"{name}, validation")
    start = comparison.get("validation_before") or {}
    if isinstance(start.get("accuracy"), (int, float)):
        who = "starting model" if comparison.get("before") == "start" else "base model"
        right.axhline(start["accuracy"], ls="--", color="C0", label=f"{who}, validation (n={start['n']})")
    for name, figures in (comparison.get("sets") or {}).items():
        if isinstance(figures.get("after"), (int, float)) and reward:  # the run's reported figure, at its end
            right.plot([reward[-1][0]], [figures["after"]], marker="*", ms=12, ls="", color="C3",
                       label=f"{name}, {comparison.get('split', 'test')} after training (n={figures['n']})")
    right.set(xlabel="step", ylabel="greedy accuracy", title="Held-out accuracy", ylim=(0, 1))
    right.set_xlim(left=0)
    if right.get_legend_handles_labels()[0]:
        right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = run_dir / CURVES_FILE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
