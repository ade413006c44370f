"""`grpo-report outputs/train/multiruns/<sweep> [more dirs...] [--out DIR]` (or `python -m grpo_exp.apps.report`):
report.md, report.csv and PNG plots of sweeps and runs (into the first directory unless --out is given),
and the main table printed. `--page docs/results/<name>.md --machine NAME` writes a results page instead
(its plots in docs/results/<name>/; runs of uncommitted code only with --allow-dirty); `--table NAME` prints one
of its tables; `--compare <page or run dir>` says whether the runs given reproduce that page's figures. Given a bench's output folder
(one holding bench.json), `--page` and `--table` do the same for the bench. The logic lives in
grpo_exp.analysis.report, grpo_exp.analysis.results_page and grpo_exp.analysis.bench.page.

`--help` imports neither pandas nor matplotlib nor torch: the table names come from grpo_exp.analysis's
package module and the bench's light tables module, and the rest loads once the arguments are parsed."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = ("Report on training runs and sweeps: report.md, report.csv and plots (into the first directory, or "
               "--out), the main table printed. --page writes a results page instead, --table prints one table, "
               "--compare checks runs against a results page; a bench's output folder takes --page and --table.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from grpo_exp.analysis import PER_SET_TABLES, is_table
    from grpo_exp.analysis import TABLES as NAMES
    from grpo_exp.analysis.bench.tables import NAMES as BENCH_NAMES

    parser = argparse.ArgumentParser(prog="grpo-report", description=DESCRIPTION)
    parser.add_argument("dirs", nargs="+", help="multirun directories (outputs/train/multiruns/...) or run "
                                                "directories; or one bench output folder (with bench.json)")
    parser.add_argument("--out", help="where report.md, report.csv and the plots go (default: the first dir)")
    parser.add_argument("--page", help="write a results page here (e.g. docs/results/<name>.md), its plots into "
                                       "the folder of the same name, instead of the report")
    parser.add_argument("--machine", help="the machine the runs ran on, an entry of docs/machines.md (page header)")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="write a page from runs of uncommitted code (the page marks them); refused without it")
    parser.add_argument("--compare", metavar="PAGE_OR_RUN_DIR",
                        help="compare the runs given (dirs) with a results page or a run directory: per figure the "
                             "page's mean and seed spread, yours, and whether yours falls inside it")
    names = [*NAMES, *(f"{prefix}_<set>" for prefix in PER_SET_TABLES)]

    def table(name: str) -> str:
        if is_table(name) or name in BENCH_NAMES:
            return name
        choices = ", ".join([*names, *BENCH_NAMES])
        raise argparse.ArgumentTypeError(f"invalid choice: '{name}' (choose from {choices})")

    parser.add_argument("--table", type=table, metavar="NAME",
                        help=f"print this table of the page (Markdown) and write nothing: {', '.join(names)} (the "
                             f"set a run trained or evaluated, as the page names it); a bench's: "
                             + ", ".join(BENCH_NAMES))
    args = parser.parse_args(argv)
    if args.machine and not args.page:
        parser.error("--machine names the machine in a results page; give --page too")
    if args.compare and (args.page or args.table or args.out):
        parser.error("--compare prints a comparison and writes nothing; leave out --page, --table and --out")
    if args.allow_dirty and not args.page:
        parser.error("--allow-dirty is for --page")
    if args.table and (args.page or args.out):
        parser.error("--table prints one table and writes nothing; leave out --page and --out")
    from grpo_exp.analysis.bench.page import is_bench

    benches = [d for d in args.dirs if is_bench(d)]
    if benches and len(args.dirs) > 1:
        parser.error(f"{benches[0]} is a bench's output (bench.json): give it alone")
    if benches and not (args.page or args.table):
        parser.error(f"{benches[0]} is a bench's output (bench.json): give --page or --table (its bench.md is "
                     f"the bench's own report)")
    if benches and args.out:
        parser.error("--out is for runs' reports; a bench's page goes where --page says")
    args.bench = bool(benches)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from grpo_exp.base import log

    log.set_level("INFO")  # the page's warnings (no --machine, a name not in docs/machines.md) reach stderr
    if args.compare:
        from grpo_exp.analysis.compare_page import compare

        try:
            print(compare(args.compare, args.dirs))
        except (KeyError, SystemExit) as err:  # CompareError, or no runs found under the dirs
            message = err.args[0] if err.args else err
            print(f"error: {str(message).removeprefix('error: ')}", file=sys.stderr)
            return 2
        return 0
    if not (args.page or args.table):
        from grpo_exp.analysis.report import run

        return run(args.dirs, args.out)
    if args.bench:
        from grpo_exp.analysis.bench import page as results_page

        where = args.dirs[0]
    else:
        from grpo_exp.analysis import results_page

        where = args.dirs
    try:
        if args.table:
            print(results_page.table_markdown(where, args.table), end="")
        else:
            extra = {"allow_dirty": args.allow_dirty} if not args.bench else {}
            print(f"results page: {results_page.write_page(where, args.page, args.machine, **extra)}")
    except (FileNotFoundError, KeyError) as err:
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
