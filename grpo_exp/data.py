"""`python -m grpo_exp.data ...`: the command users know; the app is grpo_exp.apps.data."""

from grpo_exp.apps.data import main

if __name__ == "__main__":
    raise SystemExit(main())
