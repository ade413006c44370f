"""`python scripts/report.py ...`: the same as `grpo-report ...` (the app is grpo_exp.apps.report); needs the package
installed (`make setup` does it)."""

from grpo_exp.apps.report import main

if __name__ == "__main__":
    raise SystemExit(main())
