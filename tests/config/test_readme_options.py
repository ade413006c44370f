"""The README's configuration table names every option of every config group a user picks from.

It drifted once (an ablation renamed, three added, none listed); this keeps the table and conf/ together.
"""

import re
from pathlib import Path

from grpo_exp.config import options

README = Path(__file__).resolve().parents[2] / "README.md"
INTERNAL_GROUPS = {"paths"}  # set by the task wrapper, not picked on the command line


def _table_rows() -> dict[str, str]:
    text = README.read_text()
    start = text.index("## Configuration")
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_/]+)` \| (.*)$", text[start:], re.M)}


def test_readme_configuration_table_lists_every_option():
    rows = _table_rows()
    missing = {}
    for group in options.groups():
        if group in INTERNAL_GROUPS:
            continue
        assert group in rows, f"README's configuration table has no row for the `{group}` group"
        named = set(re.findall(r"`([^`]+)`", rows[group]))
        absent = [o for o in options.group_options(group) if o not in named]
        if absent:
            missing[group] = absent
    assert not missing, f"options missing from the README's configuration table: {missing}"
