#!/usr/bin/env python
"""Report of a sweep: `python scripts/report.py outputs/train/multiruns/<sweep> [more dirs...] [--out DIR]`.

Writes report.md, report.csv and PNG plots (into the first directory unless --out is given) and
prints the main table. The logic lives in grpo_exp/report.py.
"""

from grpo_exp.report import main

if __name__ == "__main__":
    raise SystemExit(main())
