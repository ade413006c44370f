"""Results pages: `grpo-report <dirs> --page docs/results/<name>.md --machine NAME` writes a Markdown page
of the runs' held-out and reward tables and its plots (docs/results/<name>/*.png, linked relatively).

The page is generated, never edited: it opens with where its figures came from (provenance.header: the
commands that made the runs and the page, the commit, the date, the machine, the versions), and each
table is followed by the `grpo-report --table` command that prints it again from the same runs.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from grpo_exp.analysis import continual, plots, provenance, report

PLOTS = ("learning_curve.png", "reward_curves.png", "forgetting_kl.png")


def report_command(dirs: list[str], *options: str) -> str:
    """`grpo-report <dirs> <options>` as a shell line."""
    return shlex.join(["grpo-report", *map(str, dirs), *options])


def page_command(dirs: list[str], page: str | Path, machine: str | None) -> str:
    return report_command(dirs, "--page", str(page), *(["--machine", machine] if machine else []))


def write_page(dirs: list[str], page: str | Path, machine: str | None = None) -> Path:
    """Write the results page of the runs under `dirs` to `page`, its PNGs into the folder named after it;
    returns the page's path."""
    loaded = report.load_report(dirs)
    jobs, df, labels = loaded["jobs"], loaded["df"], loaded["labels"]
    page = Path(page)
    # read before the plots are redrawn: new PNGs would make the commit look changed
    header = provenance.header(jobs, page_command(dirs, page, machine), machine)
    assets = page.with_suffix("")  # docs/results/<name>.md -> docs/results/<name>/
    assets.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:  # a plot the runs no longer make must not linger from an earlier page
        (assets / name).unlink(missing_ok=True)
    made = [plots.plot_learning_curve(jobs, labels, assets / "learning_curve.png"),
            plots.plot_reward_curves(jobs, labels, assets),
            # one line per method (the swept settings but the seed), over its seeds
            plots.plot_forgetting_kl(jobs, continual.method_labels(jobs, report.seed_labels(df)), assets)]

    done = int((df["status"] == "completed").sum())
    lines = [f"# Results: {page.stem}", "",
             "<!-- Written by grpo-report from the runs' files; do not edit: rerun the page's command. -->", "",
             *header,
             f"- **Runs:** {', '.join(f'`{d}`' for d in dirs)}: {len(df)} job{'s' * (len(df) != 1)}, {done} completed",
             ""]
    if report.split_note(df):
        lines += [report.split_note(df), ""]
    for section in loaded["sections"]:
        lines += [f"## {section.title}", "", *section.markdown(),
                  f"Reproduce: `{report_command(dirs, '--table', section.name)}`", ""]
    made = [p for p in made if p]
    if made:
        lines += ["## Plots", ""]
        for path in made:
            lines += [f"![{path.stem}]({assets.name}/{path.name})", ""]
    page.write_text("\n".join(lines))
    return page


def table_markdown(dirs: list[str], name: str) -> str:
    """The Markdown of one of the page's tables (tables.Section.name), as the page shows it."""
    sections = {s.name: s for s in report.load_report(dirs)["sections"]}
    if name not in sections:
        raise KeyError(f"no table '{name}' for these runs; they have: {', '.join(sections) or 'none'}")
    return "\n".join(sections[name].markdown()).rstrip() + "\n"
