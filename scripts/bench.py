"""`python scripts/bench.py ...`: the same as `grpo-bench ...` (the app is grpo_exp.apps.bench); needs the package
installed (`make setup` does it)."""

from grpo_exp.apps.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
