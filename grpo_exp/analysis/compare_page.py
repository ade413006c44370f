"""`grpo-report --compare <results page or run dir> <my runs...>`: does a run reproduce a page?

Per figure (each held-out accuracy and difference from the start model, per variant) it prints the page's mean
and spread over its training seeds, the user's value, and whether that value falls inside the page's seed range
(the spread another training seed of the same recipe is expected to land in). A page carries its per-seed figures
in a comment block (results_page.figures_block); a run directory is read as `grpo-report` reads it.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from grpo_exp.base.text import markdown_table
from grpo_exp.evaluation.stats import mean_interval


class CompareError(KeyError):
    """What makes a comparison meaningless (no figures, other stages): one line, exit 2."""


def _from_runs(dirs: list[str]) -> dict:
    from grpo_exp.analysis import report, results_page

    loaded = report.load_report(dirs)
    return results_page.figures(loaded["df"], report.seed_labels(loaded["df"]))


def reference_figures(ref: str) -> dict:
    """The per-seed figures of a results page (its figures block) or of the runs under a directory."""
    from grpo_exp.analysis.results_page import FIGURES_MARK

    path = Path(ref)
    if path.is_file():
        found = re.search(rf"<!-- {re.escape(FIGURES_MARK)} (\{{.*\}}) -->", path.read_text())
        if not found:
            raise CompareError(f"{ref} holds no figures block (a page written before grpo-report recorded its "
                               f"per-seed figures, or not a results page); give the directory of its runs instead")
        data = json.loads(found.group(1))
    elif path.is_dir():
        data = _from_runs([ref])
    else:
        raise CompareError(f"{ref} is neither a results page nor a run directory")
    if not data.get("figures"):
        raise CompareError(f"{ref} has no held-out figures to compare against (no completed run scored a test or "
                           f"validation set)")
    return data


def _pick(ref: dict, mine: dict) -> list[tuple[str, str]]:
    """(page variant, my variant) pairs: the same label, or the only variant on each side."""
    same = [(v, v) for v in ref if v in mine]
    if same:
        return same
    if len(ref) == 1 and len(mine) == 1:
        return [(next(iter(ref)), next(iter(mine)))]
    return []


def compare(ref: str, dirs: list[str]) -> str:
    """The comparison table (Markdown); a CompareError where nothing matches."""
    page, mine = reference_figures(ref), _from_runs(dirs)
    if not mine.get("figures"):
        raise CompareError(f"{', '.join(dirs)}: no completed run with held-out figures")
    if page.get("stages") and mine.get("stages") and not set(page["stages"]) & set(mine["stages"]):
        raise CompareError(f"{ref} is about stage {', '.join(page['stages'])}, but these runs trained stage "
                           f"{', '.join(mine['stages'])}")
    if page.get("split") and mine.get("split") and not set(page["split"]) & set(mine["split"]):
        raise CompareError(f"{ref} reports the {', '.join(page['split'])} split, but these runs scored "
                           f"{', '.join(mine['split'])}")
    rows = []
    for theirs, ours in _pick(page["figures"], mine["figures"]):
        for column, seeds in page["figures"][theirs].items():
            if column not in mine["figures"][ours]:
                continue
            values = list(seeds.values())
            interval = mean_interval(values)
            low, high = min(values), max(values)
            my_values = mine["figures"][ours][column]
            inside = sum(low <= v <= high for v in my_values.values())
            verdict = ("inside the page's seed range" if inside == len(my_values) else
                       "outside the page's seed range" if inside == 0 else
                       f"{inside} of {len(my_values)} seeds inside the page's seed range")
            rows.append([theirs, column.removeprefix("eval_"), len(values), f"{statistics.fmean(values):.3f}",
                         f"{low:.3f}..{high:.3f}",
                         f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "",
                         ", ".join(f"{v:.3f} (seed {s})" for s, v in my_values.items()), verdict])
    if not rows:
        raise CompareError(f"no figure of {ref} ({', '.join(page['figures'])}) matches one of these runs "
                           f"({', '.join(mine['figures'])})")
    return markdown_table(["variant", "figure", "page seeds", "page mean", "page min..max",
                           "page 95% CI over seeds (t)", "yours", "verdict"], rows)
