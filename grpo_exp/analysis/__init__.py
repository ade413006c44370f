"""Analysis layer: sweep reports, the benchmark and the generation profile."""

# The report's tables by the names `grpo-report --table` takes, in the order reports give them (tables.py builds
# them). Here rather than in tables.py, which needs pandas, so that `grpo-report --help` lists them at once.
TABLES = ("before_after", "seeds", "stage_gains", "continual", "continual_vs_baseline", "forgetting_kl", "reward_fifths",
          "validation_accuracy")
