"""Every file of the repository that README.md or a page of docs/ names by its path exists.

docs/log.md named files that had since moved (the kernels out of core/, the scripts/ shims): a reader who followed
one found nothing. A path counts when it starts at a top folder of the repository (`grpo_exp/training/stage.py`,
`tests/...`, `conf/...`, `scripts/...`, `tools/...`, `docs/...`) or at a folder of the package
(`training/stage.py`, as the pages abbreviate) and ends in a file name with a suffix, or is one of those folders
with a trailing slash. Left out, because they are not files of the repository: paths with a placeholder (`<run>`),
a wildcard or braces; the page a command is told to write (`--page docs/results/<name>.md`); a file a page's own
example creates (`Path("conf/stage/beads.yaml").write_text(...)`); and, in docs/log.md, the bullet that records
the old names of moved files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("grpo_exp", "tests", "conf", "scripts", "tools", "docs")
PACKAGE = tuple(p.name for p in (ROOT / "grpo_exp").iterdir() if p.is_dir() and p.name != "__pycache__")
PATH = re.compile(r"(?<![\w/.<>{*-])((?:%s)/(?:[\w.-]+/)*(?:[\w-]+\.(?:py|yaml|yml|md|sh|json|txt|toml|png)\b|(?=[\s`)'\"])))"
                  % "|".join(TOP + PACKAGE))
WRITTEN = re.compile(r"(?:--page\s+|Path\(\")(\S+?)[\"`\s)]")
MOVES_NOTE = re.compile(r"^- Paths of the repository's own files are today's.*?(?=^- |^\S)", re.M | re.S)


def cited(page: Path) -> list[str]:
    text = page.read_text()
    if page.name == "log.md":
        text = MOVES_NOTE.sub("", text, count=1)
    written = set(WRITTEN.findall(text))
    found = []
    for match in PATH.finditer(text):
        path = match.group(1)
        if path not in written:
            found.append(path)
    return sorted(set(found))


def exists(path: str) -> bool:
    return (ROOT / path).exists() or (ROOT / "grpo_exp" / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_cited_file_exists(page):
    missing = [path for path in cited(page) if not exists(path)]
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


def test_the_pattern_finds_paths():
    """The check reads what it should: a moved file's old path is found, and a placeholder path is not."""
    sample = ("see `grpo_exp/core/attention.py` and `training/rollout.py`, `tests/kernels/`; "
              "`outputs/train/runs/<run>/model/`, `docs/results/<name>.md`, `grpo_exp/config/*.py`")
    found = {m.group(1) for m in PATH.finditer(sample)}
    assert found == {"grpo_exp/core/attention.py", "training/rollout.py", "tests/kernels/"}, found
    assert not exists("grpo_exp/core/attention.py") and exists("training/stage.py") and exists("tests/kernels/")
