"""Each config group with a page of its own has every option named on that page, as configuration.md has them
(tests/config/test_configuration_doc.py); performance.md's paragraph of old names maps every moved key.

sweeps-and-reports.md once listed 8 of the 14 experiments, and performance.md's "old names" mapped new names to
themselves after a rename ran over the paragraph; both read true again only if a test reads them with conf/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from grpo_exp.config import options
from grpo_exp.config.speed import MOVED

DOCS = Path(__file__).resolve().parents[2] / "docs"
# group -> the page that lists its options for a reader choosing one (configuration.md lists them all)
GROUP_PAGES = {
    "experiment": "sweeps-and-reports.md",
    "curriculum": "curriculum-ewc.md",
    "speed": "performance.md",
    "peft": "curriculum-ewc.md",
    "hydra/launcher": "scale-out.md",
}


def named(text: str, group: str, option: str) -> bool:
    """`option` in code, or `group=option` inside a command."""
    return f"`{option}`" in text or f"{group.split('/')[-1]}={option}" in text


@pytest.mark.parametrize("group, page", sorted(GROUP_PAGES.items()))
def test_group_page_names_every_option(group, page):
    text = (DOCS / page).read_text()
    missing = [o for o in options.group_options(group) if not named(text, group, o)]
    assert not missing, f"docs/{page} does not name these {group} options: {missing}"


def test_sweeps_page_has_a_row_per_experiment():
    """In its table of ready sweeps, not just anywhere on the page."""
    text = (DOCS / "sweeps-and-reports.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    in_rows = {name for row in rows for name in re.findall(r"`([a-z_0-9]+)`", row.split(" | ")[0])}
    missing = sorted(set(options.group_options("experiment")) - in_rows)
    assert not missing, f"docs/sweeps-and-reports.md's experiment table has no row for: {missing}"


def test_old_names_paragraph_maps_every_moved_key():
    text = (DOCS / "performance.md").read_text()
    start = text.index("The old names:")
    paragraph = " ".join(text[start:text.index("\n\n", start)].split())
    for old, new in MOVED.items():
        assert f"`train.{old}`" in paragraph, f"performance.md's old names leave out train.{old}"
        assert f"`{new}`" in paragraph or new.startswith("speed.") and "keep their names under `speed.`" in paragraph
    # the slip this guards against: a new name given as its own old name
    assert not re.search(r"`(speed\.[a-z_*]+)` (?:is|are) `\1`", paragraph), paragraph
