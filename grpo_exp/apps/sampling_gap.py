"""`python -m grpo_exp.apps.sampling_gap --eval <evaluate dir> --runs <run> ... --page <page.md> --machine NAME`:
sampled correctness in training runs against `evaluate`'s pass@1 on the same model (analysis/sampling_gap.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpo_exp.base import log
from grpo_exp.base.run_files import EVAL_FILE


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m grpo_exp.apps.sampling_gap", description=(
        "Write a results page comparing how often training runs' sampled completions were correct with "
        "`python -m grpo_exp.evaluate`'s pass@1 on the same model (docs/results/two-step-gap.md is one)."))
    parser.add_argument("--eval", required=True, help="a `python -m grpo_exp.evaluate` output with eval.pass_k")
    parser.add_argument("--runs", nargs="+", required=True, help="training runs from the evaluated model")
    parser.add_argument("--page", required=True, help="the Markdown page to write")
    parser.add_argument("--machine", help="its entry in docs/machines.md")
    args = parser.parse_args(argv)
    log.set_level("INFO")
    for path in [args.eval, *args.runs]:
        if not Path(path).is_dir():
            parser.error(f"{path} is not a directory")
    if not (Path(args.eval) / EVAL_FILE).is_file():
        parser.error(f"--eval {args.eval} has no eval.json: give the output directory of python -m grpo_exp.evaluate")
    from grpo_exp.analysis import sampling_gap

    try:
        page = sampling_gap.write_page(Path(args.eval), [Path(r) for r in args.runs], Path(args.page), args.machine,
                                       sampling_gap.page_command(argv))
    except ValueError as err:
        parser.error(str(err))
    print(f"page: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
