"""The documentation's links and the sections that code cites exist.

- Every relative link in README.md, CHANGELOG.md and docs/*.md points at a file that exists, and an anchor
  into a Markdown page at one of its headings. Pages under docs/results/ are written by commands
  (`grpo-report --page`, `grpo-bench`); a link to one fails here until the command has written it.
- Every `docs/<page>.md, "<heading>"` that a comment, docstring or config in grpo_exp/, conf/, scripts/ or
  tests/ cites names a heading of that page (the quoted text may be the heading's beginning), and every
  README section cited that way (`README, "<heading>"`, `README, <Section>`) exists in the README.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING = ["grpo_exp", "conf", "scripts", "tests"]
SUFFIXES = {".py", ".yaml", ".yml", ".sh", ".md"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOCS_CITATION = re.compile(r"\b((?:docs/)?[\w-]+\.md),\s+\"([^\"]+)\"")
README_CITATION = re.compile(r"\bREADME(?!\.)[,:]?\s+(?:([A-Z][A-Za-z]+(?: [a-z]+)*)(?:,\s+\"([^\"]+)\")?|\"([^\"]+)\")")


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where links are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


@functools.lru_cache(maxsize=None)
def headings(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return [" ".join(m.group(1).split()) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    heading = re.sub(r"`", "", heading.lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def links() -> list[tuple[Path, str]]:
    found = []
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text())):
            if not re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                found.append((page, target))
    return found


@pytest.mark.parametrize("page, target", links(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    where = f"{page.relative_to(ROOT)} links to {target}"
    assert file.exists(), f"{where}: {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file} does not exist"
    if anchor and file.suffix == ".md":
        assert anchor in {slug(h) for h in headings(file)}, f"{where}: no heading with the anchor #{anchor}"


def joined(text: str) -> str:
    """Lines joined into one, comment markers and indentation dropped, so a citation may wrap."""
    return " ".join(re.sub(r"\n[ \t]*(?:#+[ \t]?|//[ \t]?)?", " ", text).split())


def citing_files() -> list[Path]:
    files = []
    for folder in CITING:
        files += [p for p in sorted((ROOT / folder).rglob("*")) if p.suffix in SUFFIXES and p.is_file()
                  and "__pycache__" not in p.parts and p.parent != ROOT / "tests" / "docs"]
    return files + [ROOT / "Makefile"]


def citations() -> list[tuple[Path, str, str]]:
    found = []
    for path in citing_files():
        text = joined(path.read_text(errors="replace"))
        for page, heading in DOCS_CITATION.findall(text):
            if page.startswith("docs/") or page in ("CHANGELOG.md",):
                found.append((path, page, heading))
        for section, quoted_after, quoted in README_CITATION.findall(text):
            for name in (section, quoted_after, quoted):
                if name:
                    found.append((path, "README.md", name))
    return found


def test_cited_sections_exist():
    missing = []
    for path, page, heading in citations():
        file = ROOT / page
        where = f"{path.relative_to(ROOT)} cites {page}, \"{heading}\""
        if not file.is_file():
            missing.append(f"{where}: no such page")
        elif not any(h.startswith(heading) for h in headings(file)):
            missing.append(f"{where}: no such heading")
    assert not missing, "\n".join(missing)


def test_citations_are_found():
    """The pattern finds the citations this test exists for (one per form), so an empty list is no pass."""
    text = joined('x (docs/log.md,\n    # "2026-11-28 — a decaying") y README, Performance, "The floor" z README "Results"')
    assert DOCS_CITATION.findall(text) == [("docs/log.md", "2026-11-28 — a decaying")]
    assert [n for m in README_CITATION.findall(text) for n in m if n] == ["Performance", "The floor", "Results"]
    assert len(citations()) > 20
