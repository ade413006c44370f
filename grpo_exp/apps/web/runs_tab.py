"""The Runs tab: every run and sweep under the outputs folder (an overview table), and for the one picked its
status, the report's metrics table, reward, held-out accuracy and forgetting curves, the curriculum matrix,
and the report's plots (written into the app's own folder, not into the run)."""

from __future__ import annotations

from pathlib import Path

from grpo_exp.apps.web.common import rounded
from grpo_exp.apps.web.state import App
from grpo_exp.base import log

logger = log.get_logger(__name__)


def runs_tab(app: App, gr) -> dict:
    from grpo_exp.analysis import runs

    header = gr.Markdown(elem_id="runs-header")
    refresh = gr.Button("Refresh", size="sm", elem_id="runs-refresh")
    overview = gr.Dataframe(label="all runs", interactive=False, elem_id="runs-overview", max_height=300)
    with gr.Column(visible=False) as area:  # shown once there is a run to show
        pick = gr.Dropdown([], label="run or sweep", elem_id="runs-pick", allow_custom_value=False)
        detail = gr.Markdown(elem_id="runs-detail")
        table = gr.Dataframe(label="metrics (the report's table)", interactive=False, elem_id="runs-table",
                             max_height=300)
        with gr.Row():
            reward = gr.LinePlot(None, x="step", y="value", color="series", title="reward", height=260,
                                 elem_id="runs-reward")
            heldout = gr.LinePlot(None, x="step", y="value", color="series", title="held-out accuracy (greedy)",
                                  height=260, elem_id="runs-heldout")
        forgetting = gr.LinePlot(None, x="step", y="value", color="series", visible=False, height=240,
                                 title="forgetting: KL from the previous stage's policy", elem_id="runs-forgetting")
        matrix = gr.Dataframe(label="curriculum matrix R[after][evaluated]", visible=False, interactive=False,
                              elem_id="runs-matrix")
        plots = gr.Gallery(label="report plots (grpo-report)", columns=2, height=640, elem_id="runs-plots",
                           interactive=False, object_fit="contain")

    def list_runs():
        choices = app.run_choices("runs")
        if not choices:
            return (f"**{runs.empty_message(app.outputs)}**", gr.update(value=None, visible=False),
                    gr.update(visible=False), gr.update(choices=[], value=None))
        frame = rounded(runs.overview(app.outputs))
        n_sweeps = sum(label.startswith("sweep:") for label, _ in choices)
        return (f"{len(frame)} runs, {n_sweeps} sweeps under `{app.outputs}`",
                gr.update(value=frame, visible=True), gr.update(visible=True),
                gr.update(choices=choices, value=choices[0][1]))

    def show(path):
        path = app.ours(path)
        empty = ("", None, None, None, gr.update(visible=False), gr.update(visible=False), [])
        if not path:
            return empty
        target = Path(path)
        dirs = runs.find_runs(target)
        if not dirs:
            return (f"No runs in `{target}` (yet).",) + empty[1:]
        jobs = runs.load(dirs, target if runs.is_sweep(target) else target.parent)
        rows = [j["row"] for j in jobs]
        failed = [r for r in rows if r.get("status") not in ("completed", None)]
        text = f"`{target}`: {len(rows)} run(s), " + ", ".join(
            f"{s} {sum(r.get('status') == s for r in rows)}" for s in sorted({str(r.get('status')) for r in rows}))
        for row in failed:
            if row.get("error"):
                text += f"\n\n- **{row['job']}** {row['status']}: {row['error']}"
        heldout_points = runs.curves(jobs, "eval/*/accuracy")
        forgetting_points = runs.curves(jobs, "forgetting/*/kl")
        matrices = [m for j in jobs if (m := runs.curriculum_table(j)) is not None]
        return (text, rounded(runs.metrics_table(jobs)), runs.curves(jobs, "reward"), heldout_points,
                gr.update(value=forgetting_points, visible=not forgetting_points.empty),
                gr.update(value=matrices[0] if matrices else None, visible=bool(matrices)),
                report_plots(app, target))

    outputs = [detail, table, reward, heldout, forgetting, matrix, plots]
    listed = [header, overview, area, pick]
    refresh.click(list_runs, None, listed).then(show, pick, outputs)
    pick.change(show, pick, outputs)
    return {"fn": list_runs, "inputs": None, "outputs": listed}


def report_plots(app: App, target: Path) -> list[tuple[str, str]]:
    """The report's PNGs for a run or sweep (grpo_exp.analysis.report.write_report), into the app's own folder."""
    from grpo_exp.analysis.report import write_report

    out = app.report_dir / "".join(c if c.isalnum() else "_" for c in str(target.resolve()))[-120:]
    try:
        write_report([target], out)
    except (SystemExit, Exception) as err:  # write_report exits when it finds no runs
        logger.warning("no report for %s: %s", target, err)
        return []
    return [(str(p), p.stem.replace("_", " ")) for p in sorted(out.glob("*.png"))]
