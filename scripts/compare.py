"""`python scripts/compare.py ...`: the same as `grpo-compare ...` (the app is grpo_exp.apps.compare); needs the package
installed (`make setup` does it)."""

from grpo_exp.apps.compare import main

if __name__ == "__main__":
    raise SystemExit(main())
