"""`python -m grpo_exp.train ...`: the command users know; the app is grpo_exp.apps.train."""

from grpo_exp.apps.train import main

if __name__ == "__main__":
    main()
