"""`python -m grpo_exp.export_trl <run> --out <file.yaml>`: the command users know; the app is grpo_exp.apps.export_trl."""

from grpo_exp.apps.export_trl import main

if __name__ == "__main__":
    raise SystemExit(main())
