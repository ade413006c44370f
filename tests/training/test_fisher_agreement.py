"""scripts/fisher_agreement.py: two seeds' Fisher estimates of one model, compared by rank correlation."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_script_writes_each_sample_counts_rank_correlation(tmp_path):
    out = tmp_path / "agree"
    proc = subprocess.run([sys.executable, "scripts/fisher_agreement.py", "--model", "tiny_random", "--samples", "2",
                           "4", "--seeds", "1", "2", "--threads", "1", "--out", str(out),
                           "--page", str(tmp_path / "page.md"), "--machine", "epyc-avx2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "fisher_agreement.json").read_text())
    assert [r["samples"] for r in result["by_samples"]] == [2, 4]
    for row in result["by_samples"]:
        assert set(row["raw_mean"]) == {"1", "2"} and all(v > 0 for v in row["raw_mean"].values())
        assert -1.0 <= row["spearman"]["1-2"] <= 1.0
        # different seeds draw different prompts and completions: not the same estimate
        assert row["raw_mean"]["1"] != row["raw_mean"]["2"]
    page = (tmp_path / "page.md").read_text()
    assert "scripts/fisher_agreement.py --model tiny_random" in page and "**Commit:**" in page
    assert f"| 4 | {result['by_samples'][1]['spearman']['1-2']:.3f} |" in page


@pytest.mark.slow
def test_one_seed_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, "scripts/fisher_agreement.py", "--seeds", "1", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "at least two different --seeds" in proc.stderr
