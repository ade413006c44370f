"""`python -m grpo_exp.apps.run_signals <run dir>`: every figure of a run's history.jsonl at its first, middle and
last logged step, with its held-out points and what each figure means, as Markdown; `--page
docs/results/<name>.md --machine NAME` writes it as a results page with its provenance header; `--meanings` prints
the metric table docs/guide.md holds. The logic lives in grpo_exp.analysis.run_signals."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = ("Print what a training run logged (history.jsonl) at its first, middle and last logged step, its "
               "held-out points and what each figure means; --page writes it as a results page, --meanings prints "
               "the table of every metric's meaning.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m grpo_exp.apps.run_signals", description=DESCRIPTION)
    parser.add_argument("run_dir", nargs="?", help="a run directory (outputs/train/runs/<timestamp>)")
    parser.add_argument("--page", help="write a results page here (e.g. docs/results/default-run-signals.md)")
    parser.add_argument("--machine", help="the machine the run ran on, an entry of docs/machines.md (page header)")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write a page from a run of uncommitted code (the page says so); refused without it")
    parser.add_argument("--meanings", action="store_true", help="print every metric's meaning and nothing else")
    args = parser.parse_args(argv)
    if args.meanings and (args.run_dir or args.page):
        parser.error("--meanings prints the table of meanings alone; leave out the run directory and --page")
    if not args.meanings and not args.run_dir:
        parser.error("give a run directory (or --meanings)")
    if (args.machine or args.allow_dirty) and not args.page:
        parser.error("--machine and --allow-dirty are for --page")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from grpo_exp.analysis import run_signals
    from grpo_exp.analysis.results_page import PageError
    from grpo_exp.base import log

    log.set_level("INFO")  # the header's warnings (no --machine) reach stderr
    try:
        if args.meanings:
            print(run_signals.meanings_markdown(), end="")
        elif args.page:
            print(f"signals page: {run_signals.write_page(args.run_dir, args.page, args.machine, args.allow_dirty)}")
        else:
            print(run_signals.page_markdown(args.run_dir, []), end="")
    except (FileNotFoundError, PageError) as err:
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
