"""A bench's results page: `grpo-bench ... --page docs/results/<name>.md --machine NAME` writes it after the
bench, and `grpo-report <bench out dir> --page docs/results/<name>.md --machine NAME` writes it again from
the bench's bench.json alone (its PNGs into docs/results/<name>/).

Like the runs' pages (analysis/results_page.py) it is generated, never edited: it opens with where its figures
came from (the bench's command, the page's, the commits, the dates, the machine, the versions, from
analysis/provenance.py), and each table (tables.sections: the main table, the rounds, the profile, the
machine's floor) is followed by the `grpo-report --table` command that prints it again.
"""

from __future__ import annotations

import json
import shlex
from datetime import datetime, timezone
from pathlib import Path

from grpo_exp.analysis import provenance
from grpo_exp.analysis.bench.tables import plot_rewards, sections

PLOTS = ("reward_curve.png",)


def is_bench(path: str | Path) -> bool:
    """Whether `path` is a bench's output folder (it holds bench.json)."""
    return (Path(path) / "bench.json").is_file()


def load(bench_dir: str | Path) -> dict:
    path = Path(bench_dir) / "bench.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: give a bench's output folder (grpo-bench --out)")
    return json.loads(path.read_text())


def report_command(bench_dir: str, *options: str) -> str:
    return shlex.join(["grpo-report", str(bench_dir), *options])


def page_command(bench_dir: str, page: str | Path, machine: str | None) -> str:
    return report_command(bench_dir, "--page", str(page), *(["--machine", machine] if machine else []))


def _dates(report: dict, bench_json: Path) -> str:
    if report.get("started") and report.get("ended"):
        start, end = (datetime.fromisoformat(report[k]) for k in ("started", "ended"))
        return f"bench ran from {provenance.stamp(start)} to {provenance.stamp(end)}"
    written = datetime.fromtimestamp(bench_json.stat().st_mtime, timezone.utc)
    return (f"bench.json written {provenance.stamp(written)} (the file's modification time: this bench recorded "
            f"no dates)")


def _recorded_versions(report: dict) -> list[str]:
    if report.get("versions"):
        return [report["versions"]]
    torch = sorted({v["torch"] for v in (report.get("variants") or {}).values() if v.get("torch")})
    return [f"torch {', '.join(torch)} (its children; nothing else recorded)"] if torch else []


def _variants_line(report: dict) -> str:
    variants = report.get("variants") or {}
    ok = sum(v.get("status") == "ok" for v in variants.values())
    settings = report.get("settings") or {}
    parts = []
    for name, v in variants.items():
        what = "plain TRL" if v.get("kind") == "trl" else "grpo-exp"
        if v.get("overrides"):
            what += ": " + " ".join(v["overrides"])
        parts.append(f"`{name}` ({what})" + ("" if v.get("status") == "ok" else " FAILED"))
    rounds = settings.get("rounds") or 1
    extra = [f"{rounds} rounds" if rounds > 1 else "1 round", *(["profiled"] if settings.get("profile") else [])]
    return f"{len(variants)} variants, {ok} ran to the end: {', '.join(parts)}; {', '.join(extra)}"


def _settings_line(report: dict) -> str:
    s = report.get("settings") or {}
    if not s:
        return "not recorded"

    def given(key, text):
        return text if s.get(key) is not None else None

    parts = [f"model `{s.get('model')}`, stage `{s.get('stage')}`",
             f"{s.get('prompts_per_step')} prompts x {s.get('num_generations')} completions per step",
             f"at most {s.get('max_completion_length')} completion tokens"
             + (" (every completion that long: --fixed-length)" if s.get("fixed_length") else ""),
             f"{s.get('steps')} measured steps after {s.get('warmup')} warm-up (rounded up to whole generation rounds)",
             f"{s.get('threads')} threads", f"seed {s.get('seed')}",
             given("beta", f"beta {s.get('beta')} (every variant)"), given("lr", f"learning rate {s.get('lr')}"),
             f"reward curves over {s['reward_curve_steps']} steps" if s.get("reward_curve_steps") else None]
    return ", ".join(p for p in parts if p)


def provenance_lines(report: dict, made_by: str, machine: str | None, tool: str, dates: str, commits: list[str],
                     now: datetime | None = None, what: str = "bench") -> list[str]:
    """The header's first bullets, from a bench.json or a matrix.json (`what`): the command that made its figures,
    the page's command, the commits (this code's, then `commits`), the dates (`dates`: when the figures were
    measured), the machine and the versions."""
    command = report.get("command")
    recorded_machine = report.get("machine")
    threads = (report.get("machine_limits") or {}).get("threads")
    return [f"- **{what.capitalize()} made by:** "
            + (f"`{command}`" if command else f"not recorded ({what}.json has no command)"),
            f"- **Page made by:** {made_by}",
            provenance.commit_line(what, commits, f"no commit recorded in {what}.json"),
            provenance.date_line(now, dates),
            f"- **Machine:** {provenance.machine_line(machine, tool=tool)}"
            + (f"; the {what} recorded: {recorded_machine}" + (f", {threads} threads per variant" if threads else "")
               if recorded_machine else ""),
            provenance.versions_line(tool, _recorded_versions(report), f"the {what}")]


def header(report: dict, bench_json: Path, made_by: str, machine: str | None, tool: str,
           shown_dir: str, now: datetime | None = None) -> list[str]:
    """The page's header block, as the runs' pages have it (provenance.header), read from bench.json."""
    commits = [report["commit"]] if report.get("commit") else []
    return [*provenance_lines(report, made_by, machine, tool, _dates(report, bench_json), commits, now),
            f"- **Bench:** `{shown_dir}`: {_variants_line(report)}",
            f"- **Settings:** {_settings_line(report)}"]


def write_page(bench_dir: str | Path, page: str | Path, machine: str | None = None, tool: str = "grpo-report",
               shown_dir: str | None = None, now: datetime | None = None) -> Path:
    """Write the results page of the bench in `bench_dir` to `page` (its PNGs into the folder named after it);
    `tool` is what writes it (grpo-bench, right after the bench, or grpo-report), `shown_dir` the bench folder
    as the page names it (default: as given). Returns the page's path."""
    report = load(bench_dir)
    shown_dir = shown_dir or str(bench_dir)
    page = Path(page)
    again = page_command(shown_dir, page, machine)
    if tool == "grpo-report" or not report.get("command"):
        made_by = f"`{again}`"
    else:
        made_by = f"`{report['command']}` (with the bench); again from its bench.json: `{again}`"
    lines = [f"# Results: {page.stem}", "",
             f"<!-- Written by {tool} from the bench's bench.json; do not edit: rerun the page's command. -->", "",
             *header(report, Path(bench_dir) / "bench.json", made_by, machine, tool, shown_dir, now), ""]
    for section in sections(report):
        lines += [f"## {section.title}", "", section.intro, "", section.markdown, "",
                  f"Reproduce: `{report_command(shown_dir, '--table', section.name)}`", ""]
    assets = page.with_suffix("")  # docs/results/<name>.md -> docs/results/<name>/
    for name in PLOTS:  # a plot the bench no longer makes must not linger from an earlier page
        (assets / name).unlink(missing_ok=True)
    if report.get("reward_curves"):
        assets.mkdir(parents=True, exist_ok=True)
        if plot_rewards(report.get("variants") or {}, assets / "reward_curve.png"):
            lines += ["## Reward per step", "",
                      "Each variant's mean reward per optimizer step (TRL's `reward`), the same prompts and seed "
                      "(the first round's).", "", f"![reward_curve]({assets.name}/reward_curve.png)", ""]
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines))
    return page


def table_markdown(bench_dir: str | Path, name: str) -> str:
    """The Markdown of one of the page's tables (tables.Section.name), as the page shows it."""
    found = {s.name: s for s in sections(load(bench_dir))}
    if name not in found:
        raise KeyError(f"no table '{name}' in this bench; it has: {', '.join(found) or 'none'}")
    return found[name].markdown.rstrip() + "\n"
