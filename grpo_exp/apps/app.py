"""`grpo-app [--host H] [--port P] [--outputs DIR] [--auth USER:PASSWORD]` (or `python -m grpo_exp.app`): a local
web app (Gradio) to launch, watch and compare runs. It lives in grpo_exp.apps.web (web/server.py: this command
line and the login; web/__init__.py: the tabs and who can reach them)."""

from grpo_exp.apps.web.server import main

if __name__ == "__main__":
    raise SystemExit(main())
