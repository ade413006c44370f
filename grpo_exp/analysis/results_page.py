"""Results pages: `grpo-report <dirs> --page docs/results/<name>.md --machine NAME` writes a Markdown page
of the runs' held-out and reward tables and its plots (docs/results/<name>/*.png, linked relatively).

The page is generated, never edited: it opens with where its figures came from (provenance.header: the
commands that made the runs and the page, the commit, the date, the machine, the versions), and each
table is followed by the `grpo-report --table` command that prints it again from the same runs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from grpo_exp.analysis import compute_curve, continual, forgetting_fit, plots, provenance, report

PLOTS = ("learning_curve.png", "reward_curves.png", "forgetting_kl.png", "compute_curve.png", "forgetting_vs_kl.png",
         "continual_metrics.png")


def report_command(dirs: list[str], *options: str) -> str:
    """`grpo-report <dirs> <options>` as a shell line."""
    return shlex.join(["grpo-report", *map(str, dirs), *options])


def page_command(dirs: list[str], page: str | Path, machine: str | None) -> str:
    return report_command(dirs, "--page", str(page), *(["--machine", machine] if machine else []))


class PageError(KeyError):
    """A page that must not be written as asked (runs of uncommitted code, a path outside the repository)."""


def dirty_runs(jobs: list[dict]) -> list[str]:
    """The job directories whose recorded commit says they ran with uncommitted changes."""
    from grpo_exp.base.commit import is_dirty

    return [str(job["row"]["dir"]) for job in jobs
            if any(is_dirty(c) for c in provenance.run_commits([Path(job["row"]["dir"])]))]


ABSOLUTE = re.compile(r"(?<![\w.])/(?:work|home|tmp|root|Users|mnt|var)/[^\s`'\")\]]*")


def repo_relative(text: str, repo: Path = provenance.REPO, strict: bool = True) -> str:
    """`text` with paths inside the repository made relative to it; with `strict` (a page inside the
    repository), a PageError naming the first absolute path left (one outside the repository would not exist on
    a reader's machine)."""
    for root in {str(repo), str(repo.resolve())}:
        text = text.replace(root + "/", "").replace(root, ".")
    found = ABSOLUTE.search(text) if strict else None
    if found:
        raise PageError(f"the page would cite {found.group(0)}, outside the repository ({repo}); keep the runs "
                        f"under it (outputs/...) so the page can name them by a relative path")
    return text


def write_page(dirs: list[str], page: str | Path, machine: str | None = None, allow_dirty: bool = False) -> Path:
    """Write the results page of the runs under `dirs` to `page`, its PNGs into the folder named after it;
    returns the page's path. Runs of uncommitted code are refused unless `allow_dirty` (then the page marks
    them); a path outside the repository is refused."""
    loaded = report.load_report(dirs)
    jobs, df, labels = loaded["jobs"], loaded["df"], loaded["labels"]
    dirty = dirty_runs(jobs)
    if dirty and not allow_dirty:
        raise PageError(f"{len(dirty)} run(s) ran with uncommitted changes ({', '.join(dirty[:3])}"
                        f"{', ...' if len(dirty) > 3 else ''}); rerun them from a commit, or pass --allow-dirty "
                        f"to write a page that says so")
    page = Path(page)
    # read before the plots are redrawn: new PNGs would make the commit look changed
    header = provenance.header(jobs, page_command(dirs, page, machine), machine)
    assets = page.with_suffix("")  # docs/results/<name>.md -> docs/results/<name>/
    assets.mkdir(parents=True, exist_ok=True)
    for name in [*PLOTS, *(p.name for p in assets.glob("accuracy_matrix_*.png"))]:  # nothing lingers from an
        (assets / name).unlink(missing_ok=True)  # earlier page that the runs no longer make
    made = [plots.plot_learning_curve(jobs, labels, assets / "learning_curve.png"),
            plots.plot_reward_curves(jobs, labels, assets),
            # one line per method (the swept settings but the seed), over its seeds
            plots.plot_forgetting_kl(jobs, continual.method_labels(jobs, report.seed_labels(df)), assets),
            compute_curve.plot(jobs, report.seed_labels(df), assets / "compute_curve.png"),
            forgetting_fit.plot(forgetting_fit.points(jobs, report.seed_labels(df)), assets / "forgetting_vs_kl.png"),
            # each method's accuracy matrix, the mean over its seeds
            *plots.plot_curriculum_means(continual.curriculum_jobs(jobs, report.seed_labels(df)), assets),
            # each metric per method: the seeds and the mean with its interval over seeds
            plots.plot_continual_metrics({m: continual.seed_metrics(curs) for m, curs
                                          in continual.by_method(jobs, report.seed_labels(df)).items()},
                                         assets / "continual_metrics.png")]

    done = int((df["status"] == "completed").sum())
    lines = [f"# Results: {page.stem}", "",
             "<!-- Written by grpo-report from the runs' files; do not edit: rerun the page's command. -->", "",
             *header,
             f"- **Runs:** {', '.join(f'`{d}`' for d in dirs)}: {len(df)} job{'s' * (len(df) != 1)}, {done} completed",
             *([f"- **Uncommitted code:** {len(dirty)} run(s) ran with uncommitted changes (their commit above "
                f"carries the diff's hash): {', '.join(f'`{d}`' for d in dirty)}"] if dirty else []),
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
    lines += ["", figures_block(df, report.seed_labels(df))]
    in_repo = page.resolve().is_relative_to(provenance.REPO.resolve())
    page.write_text(repo_relative("\n".join(lines), strict=in_repo))
    return page


FIGURES_MARK = "grpo-exp figures:"


def figures(df, labels: list[str]) -> dict:
    """Per variant and held-out figure (eval_<set>_accuracy, eval_<set>_diff), each completed seed's value: what
    `grpo-report --compare` reads back from a page."""
    import pandas as pd

    done = df[df["status"] == "completed"] if "status" in df.columns else df
    out: dict = {}
    columns = [c for c in done.columns if c.startswith("eval_") and c.endswith(("_accuracy", "_diff"))]
    stage = sorted({str(s) for s in done.get("stage", pd.Series(dtype=str)).dropna()})
    for label, jobs in done.groupby(pd.Series(labels, index=df.index)[done.index], sort=False):
        for column in columns:
            values = {str(seed): float(v) for seed, v in zip(jobs.get("seed", [None] * len(jobs)), jobs[column])
                      if pd.notna(v)}
            if values:
                out.setdefault(str(label), {})[column] = values
    return {"stages": stage, "split": sorted({str(s) for s in done.get("split", pd.Series(dtype=str)).dropna()}),
            "figures": out}


def figures_block(df, labels: list[str]) -> str:
    import json

    return f"<!-- {FIGURES_MARK} {json.dumps(figures(df, labels), sort_keys=True)} -->"


def table_markdown(dirs: list[str], name: str) -> str:
    """The Markdown of one of the page's tables (tables.Section.name), as the page shows it."""
    sections = {s.name: s for s in report.load_report(dirs)["sections"]}
    if name not in sections:
        raise KeyError(f"no table '{name}' for these runs; they have: {', '.join(sections) or 'none'}")
    return "\n".join(sections[name].markdown()).rstrip() + "\n"
