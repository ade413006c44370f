"""The web app (Gradio) behind `python -m grpo_exp.app` and `grpo-app`: launch, watch and compare runs.

Tabs:
- Launch: every config group and a few train options, from conf/ itself; starts `python -m grpo_exp.train`
  with exactly those overrides (the command is shown), streams its progress and log, and stops it with
  SIGTERM, which makes the trainer finish its step and save a checkpoint. Only what the form offers runs
  (apps/launch_check.py: an allowlist, then the composed config's validation); the same check guards the
  `/launch` API endpoint, which takes the override list as text and returns the run directory or the refusal.
- Runs: the runs and sweeps under the outputs folder: metrics table, reward and held-out accuracy curves,
  the curriculum matrix, and the report's plots (grpo_exp.analysis.report).
- Completions: a run's completions.jsonl with rewards and advantages, filtered by step and reward.
- Playground: one question answered by the run's base model and its trained model, side by side.

Whoever reaches the page can start processes as the app's user. It binds 127.0.0.1 unless --host says
otherwise, and 127.0.0.1 is shared with every user of the machine; --auth (or GRPO_APP_AUTH) sets a login,
without which another --host is refused.

Modules: `server` (the command line, the login, starting Gradio), `page` (the Blocks: the four tabs and
when they refresh), `state` (the App: the outputs folder, the launched run, the loaded models, the /launch
function), `runner` (the training subprocess: start, stop, its status and log), `common` (small formatting
helpers), and one module per tab: `launch_tab`, `runs_tab`, `completions_tab`, `playground_tab`.
"""
