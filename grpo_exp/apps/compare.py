"""Base vs trained (and fp32 vs INT8) on the same held-out problems: comparison.md + comparison.json.

    grpo-compare --trained outputs/train/runs/<run> --sets basic intermediate --limit 50 --int8
    grpo-compare --base smollm2_135m --sets basic --limit 50 --int8     # fp32 vs int8 only
    grpo-compare --base tiny_random --limit 4 -- eval.max_new_tokens=8 cpu.threads=1

--base is a model option (conf/model) or a model/run directory; without it, the trained run's own
model option (from its .hydra/config.yaml), else the default model. Anything after the options is
a Hydra override of conf/evaluate.yaml (eval.batch_size=8, stage.path=..., cpu.threads=1, ...).
Bad input exits 2 with one line on stderr, before any model loads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from grpo_exp.apps.task import EXIT_BAD_INPUT
from grpo_exp.base.errors import ConfigError
from grpo_exp.config.compose import check_overrides, compose, group_options


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="grpo-compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--base", help="model option (conf/model) or model/run directory of the base model")
    p.add_argument("--trained", help="run directory (holding model/) or model directory of the trained model")
    p.add_argument("--sets", nargs="+", help="eval sets (options of conf/stage); default: the config's stage")
    p.add_argument("--limit", type=int, help="problems per set (default: eval.limit of the config)")
    p.add_argument("--int8", action="store_true", help="also evaluate an INT8 (dynamic_int8) copy of each model")
    p.add_argument("--out", help="output directory (default: outputs/compare/<timestamp>)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of conf/evaluate.yaml")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> tuple[list[str], dict]:
    """(Hydra overrides, label -> checkpoint string or None) from the command line."""
    from grpo_exp.evaluation.run import resolve_checkpoint, run_model_name

    overrides = list(args.overrides)
    if args.sets:
        overrides.append(f"eval.sets=[{','.join(args.sets)}]")
    if args.limit is not None:
        overrides.append(f"eval.limit={args.limit}")
    trained_from = run_model_name(args.trained)
    base = args.base or (trained_from if trained_from in group_options("model") else None)
    models: dict[str, str | None] = {}
    if base and base in group_options("model"):
        overrides.append(f"model={base}")
        models["base"] = None
    elif base:
        overrides.append(f"checkpoint={base}")  # a directory: checked like evaluate's checkpoint
        models["base"] = base
    else:
        models["base"] = None
    if args.trained:
        resolve_checkpoint(args.trained)
        models["trained"] = args.trained
    elif not args.int8:
        raise ConfigError("nothing to compare: give --trained <run dir> and/or --int8")
    return overrides, models


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from grpo_exp.evaluation.run import check, load_sets, resolve_checkpoint

        overrides, checkpoints = plan(args)
        check_overrides("evaluate", overrides, check)  # one-line errors for keys, values, sets, paths
        cfg = compose("evaluate", overrides)
        sets = load_sets(cfg)  # data errors surface before any model loads
        models = {label: resolve_checkpoint(path) for label, path in checkpoints.items()}
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT

    from grpo_exp.base import cpu
    from grpo_exp.evaluation.compare import run_comparison, write_report

    cpu.apply(cfg.cpu)
    report, samples = run_comparison(cfg, models, sets, int8=args.int8)
    out = Path(args.out) if args.out else Path("outputs") / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    write_report(out, report, samples)
    print(report["markdown"])
    print(f"\ncomparison.md, comparison.json and comparison_samples.jsonl in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
