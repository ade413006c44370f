"""`python scripts/profile_generation.py ...`: the same as `grpo-profile ...` (the app is grpo_exp.apps.profile); needs the package
installed (`make setup` does it)."""

from grpo_exp.apps.profile import main

if __name__ == "__main__":
    raise SystemExit(main())
