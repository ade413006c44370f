"""Analysis layer: sweep reports, the benchmark and the generation profile."""

# The report's tables by the names `grpo-report --table` takes, in the order reports give them (tables.py builds
# them). Here rather than in tables.py, which needs pandas, so that `grpo-report --help` lists them at once.
TABLES = ("before_after", "seeds", "stage_gains", "continual", "continual_vs_baseline", "forgetting_kl", "reward_fifths",
          "validation_accuracy")
# Tables named after the set they show, one per set the runs evaluated: compute_curve_basic, compute_curve_two_step, ...
PER_SET_TABLES = ("compute_curve",)


def is_table(name: str) -> bool:
    """Whether `grpo-report --table` takes this name: a table above, or a per-set one with its set named."""
    return name in TABLES or any(name.startswith(f"{prefix}_") and len(name) > len(prefix) + 1
                                 for prefix in PER_SET_TABLES)
