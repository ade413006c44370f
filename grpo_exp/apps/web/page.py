"""The page: the Gradio Blocks with the four tabs (Launch, Runs, Completions, Playground), each reading the
outputs folder again when opened, so that a run launched meanwhile shows up."""

from __future__ import annotations

from grpo_exp.apps.web.completions_tab import completions_tab
from grpo_exp.apps.web.launch_tab import launch_tab
from grpo_exp.apps.web.playground_tab import playground_tab
from grpo_exp.apps.web.runs_tab import runs_tab
from grpo_exp.apps.web.state import App


def build(app: App):
    """The Blocks over `app` (not yet launched)."""
    import gradio as gr

    with gr.Blocks(title="grpo-exp", analytics_enabled=False) as demo:
        gr.Markdown(f"## grpo-exp\nRuns in `{app.outputs}`", elem_id="header")
        with gr.Tabs():
            with gr.Tab("Launch", id="launch", elem_id="tab-launch"):
                launch_tab(app, gr, demo)
            with gr.Tab("Runs", id="runs", elem_id="tab-runs") as runs_page:
                refresh_runs = runs_tab(app, gr)
            with gr.Tab("Completions", id="completions", elem_id="tab-completions") as comp_page:
                refresh_completions = completions_tab(app, gr)
            with gr.Tab("Playground", id="playground", elem_id="tab-playground") as play_page:
                refresh_models = playground_tab(app, gr)
        # each tab reads the folder again when opened: a run launched meanwhile shows up
        runs_page.select(**refresh_runs)
        comp_page.select(**refresh_completions)
        play_page.select(**refresh_models)
        demo.load(**refresh_runs)
    return demo
