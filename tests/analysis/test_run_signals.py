"""A run's signals (analysis/run_signals, apps/run_signals): every figure a run logs has a meaning, the guide's
metric table is that dictionary as printed, the settings the guide names compose, and a real run's page holds its
values at the first, middle and last step with its held-out points."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo_exp.analysis import run_signals
from grpo_exp.analysis.run_signals import meaning, meanings_markdown, pattern_of
from grpo_exp.apps import run_signals as app
from tests.conftest import compose_cfg

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
TRL_TRAINER = Path(__import__("trl").__file__).parent / "trainer" / "grpo_trainer.py"


def _literal_keys(text: str) -> set[str]:
    """The metric names a source file appends to a trainer's `_metrics` (or a local alias of it): string
    literals, and f-strings with each {...} replaced by a sample name."""
    found = set()
    for prefix, body in re.findall(r"metrics\[(?:mode|\"train\"|'train')\]\[(f?)\"([^\"]+)\"\]", text):
        found.add(re.sub(r"\{[^}]*\}", "x", body) if prefix else body)
    for body in re.findall(r"\bmetrics\[\"([a-z_]+/[^\"]+)\"\]\.append", text):
        found.add(body)
    return found


def test_the_guide_holds_the_meanings_as_printed():
    text = GUIDE.read_text()
    start = text.index("<!-- meanings:")
    start = text.index("\n", start) + 1
    assert text[start:text.index("<!-- end of meanings -->")] == meanings_markdown(), (
        "docs/guide.md's metric table differs from MEANINGS: paste `python -m grpo_exp.apps.run_signals --meanings`")


def test_every_metric_trl_logs_has_a_meaning():
    keys = _literal_keys(TRL_TRAINER.read_text())
    assert {"reward", "frac_reward_zero_std", "kl", "clip_ratio/high_mean", "rewards/x/mean"} <= keys  # the scan reads
    assert not sorted(k for k in keys if meaning(k) is None), "TRL logs metrics MEANINGS does not explain"


def test_every_metric_grpo_exp_logs_has_a_meaning():
    sources = [p for p in (ROOT / "grpo_exp" / "training").rglob("*.py")]
    keys = set().union(*(_literal_keys(p.read_text()) for p in sources))
    assert {"dynamic_sampling/kept_share", "curriculum/mix/x"} <= keys  # the scan reads what it should
    # written as dict literals (the monitor's row, the guard's and the held-out callbacks' pending logs)
    keys |= {"gpu_mem_mb", "gpu_peak_mem_mb", "skipped_update", "skipped_reason", "ewc_penalty",
             "forgetting/basic/kl", "forgetting/basic/kl_per_token", "forgetting/basic/seconds",
             "eval/intermediate/accuracy", "cpu_percent/core11", "dynamic_sampling/draws"}
    assert not sorted(k for k in keys if meaning(k) is None)


def test_patterns_match_whole_keys_only():
    assert pattern_of("rewards/correctness/mean") == "rewards/<func>/mean"
    assert pattern_of("cpu_percent/core3") == "cpu_percent/core<i>"
    assert pattern_of("cpu_percent/coreX") is None and pattern_of("rewards/a/b/mean") is None
    assert pattern_of("reward_something_new") is None


def _history(tmp_path: Path, rows: list[dict]) -> Path:
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_first_middle_last_and_the_nearest_step(tmp_path):
    rows = [{"step": s, "reward": s / 10, "cpu_percent/core0": 50.0 + s, "cpu_percent/core1": 10.0} for s in range(1, 6)]
    rows[2].pop("reward")  # the middle row (step 3) lacks it: the nearest row's value, with its step
    rows[3]["eval/basic/accuracy"] = 0.25
    rows.append({"step": 5, "reward": 0.9})  # a resumed run logs step 5 again: the last row counts
    text = run_signals.page_markdown(_history(tmp_path, rows), [])
    table = {line.split(" | ")[0].strip("| `"): line for line in text.splitlines() if line.startswith("| `")}
    assert "first (step 1) | middle (step 3) | last (step 5)" in text
    assert table["reward"].startswith("| `reward` | 0.1 | 0.2 (step 2) | 0.9 |")
    assert "| 10-51 (2 cores) |" in table["cpu_percent/core<i>"] and "cpu_percent/core0" not in table
    assert "| 4 | basic | 0.25 |" in text  # the held-out point at its step
    assert "eval/basic/accuracy" not in table  # held-out figures are not training rows


def test_the_command_fails_in_one_line_without_a_history(tmp_path, capsys):
    assert app.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no history.jsonl in")
    with pytest.raises(SystemExit) as stop:
        app.main(["--meanings", str(tmp_path)])
    assert stop.value.code == 2


def test_a_real_run_has_every_figure_explained_and_its_page(smoke_cfg, tmp_path, capsys):
    """A debug=smoke run (2 steps, the tiny model, its held-out point at step 2): every key it logs has a meaning,
    and the command writes its page with the provenance header, the three steps and the validation point."""
    from grpo_exp.training.stage import train

    train(smoke_cfg)
    run_dir = Path(smoke_cfg.paths.output_dir)
    rows = run_signals.read_history(run_dir)
    assert {"reward", "frac_reward_zero_std", "completions/clipped_ratio", "eval/basic/accuracy"} <= set(rows[-1])
    assert run_signals.undocumented(rows) == []
    page = tmp_path / "signals.md"
    assert app.main([str(run_dir), "--page", str(page), "--allow-dirty"]) == 0
    text = page.read_text()
    assert "- **Page made by:** `python -m grpo_exp.apps.run_signals" in text and "- **Commit:**" in text
    assert "| metric | first (step 1) | middle (step 1) | last (step 2) | what it means |" in text
    assert f"| `frac_reward_zero_std` |" in text and meaning("frac_reward_zero_std") in text
    assert re.search(r"^\| 2 \| basic \| [\d.]+ \|", text, re.M), text  # eval/basic/accuracy at step 2
    assert "not documented" not in text


OVERRIDE = re.compile(r"`([a-z_]+(?:\.[a-z_]+)*=[^\s`]+)`")
SETTING = re.compile(r"`((?:train|reward|eval|stage|speed)\.[a-z_]+)`")


def test_every_setting_the_guide_names_composes(tmp_path):
    """Each `key=value` the guide offers as a fix composes and passes the config's checks; each setting it names
    exists."""
    from omegaconf import OmegaConf

    from grpo_exp.config.checks import validate

    text = GUIDE.read_text()
    overrides = sorted(set(OVERRIDE.findall(text)) - {o for o in OVERRIDE.findall(text) if "<" in o})
    assert "train.dynamic_sampling=true" in overrides and "on_nonfinite=skip" in overrides
    for override in overrides:
        cfg = compose_cfg([override], tmp_path / "run")
        validate(cfg)
    cfg = compose_cfg([], tmp_path / "run")
    missing = [s for s in sorted(set(SETTING.findall(text))) if OmegaConf.select(cfg, s, default=KeyError) is KeyError]
    assert not missing, f"docs/guide.md names settings that do not exist: {missing}"
