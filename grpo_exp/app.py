"""`python -m grpo_exp.app [--host H] [--port P] [--outputs DIR]`: the web app; it lives in grpo_exp.apps.web."""

from grpo_exp.apps.app import main

if __name__ == "__main__":
    raise SystemExit(main())
