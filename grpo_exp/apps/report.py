"""`grpo-report outputs/train/multiruns/<sweep> [more dirs...] [--out DIR]` (or `python -m grpo_exp.apps.report`):
report.md, report.csv and PNG plots of sweeps and runs (into the first directory unless --out is given),
and the main table printed. The logic lives in grpo_exp.analysis.report."""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", help="multirun directories (outputs/train/multiruns/...) or run directories")
    parser.add_argument("--out", help="where report.md, report.csv and the plots go (default: the first dir)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from grpo_exp.analysis.report import run

    return run(args.dirs, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
