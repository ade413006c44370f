"""The Python examples of docs/customize.md run as written, in order, from the root of a checkout.

They run in a copy of the package and conf/ in a temporary directory, so the stage file and data they
write stay out of the repository. A block whose first line is `# file: <name>` is a file the page asks
the reader to save; it is written there, and a later block runs it. Every other block runs as a script.
Each trains the tiny random model for 2 steps (the page's `QUICK` settings)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "customize.md"
FILE_LINE = re.compile(r"#\s*file:\s*(\S+)")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_the_page_has_its_examples():
    blocks = python_blocks(PAGE.read_text())
    saved = [b for b in blocks if FILE_LINE.match(b)]
    run = [b for b in blocks if not FILE_LINE.match(b)]
    assert len(saved) >= 1 and len(run) >= 4, (len(saved), len(run))
    for block in run:  # quick to test, and what the page promises: remove QUICK for the real thing
        if "grpo_exp.train" in block or "my_train.py" in block:
            assert "*QUICK" in block, block


@pytest.mark.slow
def test_customize_examples_run_in_order(tmp_path):
    repo = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "grpo_exp", repo / "grpo_exp", ignore=ignore)
    shutil.copytree(ROOT / "conf", repo / "conf", ignore=ignore)
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for number, block in enumerate(python_blocks(PAGE.read_text()), start=1):
        saved = FILE_LINE.match(block)
        if saved:
            (repo / saved.group(1)).write_text(block)
            continue
        script = repo / f"_customize_example_{number}.py"
        script.write_text(block)
        proc = subprocess.run([sys.executable, script.name], cwd=repo, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"example {number} failed:\n{block}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert (repo / "outputs" / "my_data_run" / "before_after.md").is_file()
    assert (repo / "outputs" / "beads_run" / "before_after.json").is_file()
    assert "rewards/brevity/mean" in (repo / "outputs" / "brevity_run" / "history.jsonl").read_text()
    assert "rewards/near_miss/mean" in (repo / "outputs" / "near_miss_run" / "history.jsonl").read_text()
    prompts_run = repo / "outputs" / "prompts_run"  # stage=prompts: the columns reached the rewards, which logged
    assert "Accuracy of prompts: solved where my_task_rewards:solved >= 1" in (prompts_run / "before_after.md").read_text()
    history = (prompts_run / "history.jsonl").read_text()
    assert "rewards/max_exact/mean" in history and "parsed_share" in history
    assert '"extra": {"parsed": ' in (prompts_run / "completions.jsonl").read_text()
    assert (repo / "outputs" / "my_model_run" / "model" / "config.json").is_file()
    assert not (ROOT / "conf" / "stage" / "beads.yaml").exists()
