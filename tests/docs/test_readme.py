"""The README stays a first page: at most 300 lines, with a Limits section and the glossary linked; the glossary
explains the words the README's Results table and feature list use in a sense of their own; and every `make`
target the README names exists in the Makefile, so its commands work after `make train`."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GLOSSARY = ROOT / "docs" / "glossary.md"
# words of the README that a newcomer cannot look up elsewhere (issue: "a newcomer's first hour")
OWN_WORDS = ("the ladder", "branching recipe", "the machine's floor", "shared-prefix scoring", "rollout engine",
             "McNemar", "not yet shown", "t interval")


def test_readme_is_short_and_says_its_limits():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, f"README.md has {len(text.splitlines())} lines; keep it to 300"
    assert re.search(r"^## Limits$", text, re.M), "README.md has no Limits section"
    assert "(docs/glossary.md)" in text, "README.md does not link the glossary"


def test_glossary_explains_the_readmes_own_words():
    glossary = " ".join(GLOSSARY.read_text().lower().split())
    readme = " ".join(README.read_text().lower().split())
    for words in OWN_WORDS:
        if words.lower() in readme:
            assert f"**{words.lower()}" in glossary or f"{words.lower()}**" in glossary, (
                f"docs/glossary.md has no entry for '{words}', which the README uses")


def test_every_make_target_the_readme_names_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README.read_text()))
    assert named, "the README names no make target"
    assert named <= targets, f"the README names make targets the Makefile lacks: {sorted(named - targets)}"
