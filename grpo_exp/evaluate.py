"""`python -m grpo_exp.evaluate ...`: the command users know; the app is grpo_exp.apps.evaluate."""

from grpo_exp.apps.evaluate import main

if __name__ == "__main__":
    main()
