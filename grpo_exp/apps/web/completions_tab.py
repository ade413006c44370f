"""The Completions tab: a run's completions.jsonl (every `completions_every` steps), each completion with its
reward, each reward function's and its advantage, filtered by step and by reward bounds."""

from __future__ import annotations

from pathlib import Path

from grpo_exp.apps.web.common import rounded
from grpo_exp.apps.web.state import App


def completions_tab(app: App, gr) -> dict:
    from grpo_exp.analysis import runs

    gr.Markdown("A run's `completions.jsonl` (every `completions_every` steps): each completion with its reward "
                "(the weighted sum trained on), each reward function, and its advantage.")
    with gr.Row():
        pick = gr.Dropdown([], label="run", elem_id="comp-pick", scale=3)
        step = gr.Dropdown(["all"], value="all", label="step", elem_id="comp-step")
        # text, not numbers: an empty box means no bound (a Number box would show 0)
        low = gr.Textbox(label="reward at least", placeholder="any", elem_id="comp-min")
        high = gr.Textbox(label="reward at most", placeholder="any", elem_id="comp-max")
    summary = gr.Markdown(elem_id="comp-summary")
    table = gr.Dataframe(interactive=False, wrap=True, elem_id="comp-table", max_height=600)

    def list_dirs():
        choices = app.run_choices("completions")
        if not choices:
            return (gr.update(choices=[], value=None),
                    f"**No completions under `{app.outputs}` yet** (a run writes completions.jsonl as it trains).")
        return gr.update(choices=choices, value=choices[0][1]), gr.update()

    def steps_of(path):
        path = app.ours(path)
        if not path:
            return gr.update(choices=["all"], value="all")
        df = runs.read_completions(path)
        return gr.update(choices=["all", *[str(s) for s in sorted(df["step"].dropna().unique())]], value="all")

    def show(path, step_choice, min_reward, max_reward):
        path = app.ours(path)
        if not path:
            return f"**No completions under `{app.outputs}` yet** (a run writes completions.jsonl as it trains).", None
        try:
            bounds = [float(b) if str(b or "").strip() else None for b in (min_reward, max_reward)]
        except ValueError:
            return "**Not a number:** reward bounds are numbers like 0.5 or -1 (empty: no bound).", None
        df = runs.read_completions(path)
        chosen = None if step_choice in (None, "all") else int(step_choice)
        shown = runs.filter_completions(df, chosen, *bounds)
        if df.empty:
            return f"`{path}` has no completions yet.", None
        text = (f"{len(shown)} of {len(df)} completions (steps {int(df['step'].min())}-{int(df['step'].max())}) "
                f"in `{runs.label(Path(path), app.outputs)}`")
        if not shown.empty:
            text += f"; shown: mean reward {shown['reward'].mean():.3f}, mean advantage {shown['advantage'].mean():.3f}"
        # the figures first: a completion can be long enough to push them off screen
        first = ["step", "reward", "advantage", *[c for c in shown.columns if c.startswith("reward:")]]
        return text, rounded(shown[first + [c for c in shown.columns if c not in first]])

    inputs = [pick, step, low, high]
    pick.change(steps_of, pick, step).then(show, inputs, [summary, table])
    for control in (step, low, high):
        control.change(show, inputs, [summary, table])
    return {"fn": list_dirs, "inputs": None, "outputs": [pick, summary]}
