"""The default run's first steps do not change when code moves: its losses, gradient norms and rewards for the
first 4 steps equal the ones recorded for this kind of machine (tests/data/default_steps.json).

Numbers differ between machines (bf16 or fp32 training, the CPU's kernels) and torch versions, so each record is
keyed by what decides them; a machine with no record skips, naming its key. To record this machine's figures
(on code whose numbers are known to be right), run with GRPO_RECORD_DEFAULT_STEPS=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

RECORDS = Path(__file__).resolve().parent.parent / "data" / "default_steps.json"
STEPS = 4
FIELDS = ("loss", "grad_norm", "reward")
COMMAND = ["-m", "grpo_exp.train", "stage=basic", f"train.max_steps={STEPS}", "eval.after_train=false",
           "eval.every_steps=null", "logger=none", "train.save_steps=1000"]


def machine_key() -> str:
    """What decides the default run's numbers here: the CPU's native bf16, torch's CPU capability, torch's
    version and the threads."""
    import torch

    from grpo_exp.base.cpu import resolve_precision, resolve_threads

    flags = [name for name, has in (("avx512_bf16", torch.cpu._is_avx512_bf16_supported()),
                                    ("amx", torch.cpu._is_amx_tile_supported())) if has]
    return (f"{'+'.join(flags) or 'no-native-bf16'} {torch.backends.cpu.get_cpu_capability()} "
            f"precision={resolve_precision('auto')} torch={torch.__version__} threads={resolve_threads('auto')}")


def first_steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    # a step that trains on the second half of a generation round logs no reward of its own
    return [{k: steps[i][k] for k in FIELDS if k in steps[i]} for i in range(STEPS)]


@pytest.mark.slow
def test_default_run_first_steps_match_the_record(tmp_path):
    from grpo_exp.core.models import check_available
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["stage=basic"], tmp_path)
    try:
        check_available(cfg.model, cfg.paths.cache_dir)
    except Exception as err:  # the packaged model is part of `make setup`; elsewhere say why
        pytest.skip(f"the default model is not available here: {err}")
    records = json.loads(RECORDS.read_text()) if RECORDS.is_file() else {}
    key = machine_key()
    recording = os.environ.get("GRPO_RECORD_DEFAULT_STEPS") == "1"
    if key not in records and not recording:
        pytest.skip(f"no record of the default run's first steps for this machine ({key}); "
                    f"recorded: {', '.join(records) or 'none'}")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, *COMMAND, f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = first_steps(run_dir)
    assert len(got) == STEPS and all("loss" in row and "grad_norm" in row for row in got) and "reward" in got[0], got
    if recording:
        records[key] = got
        RECORDS.parent.mkdir(parents=True, exist_ok=True)
        RECORDS.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    assert got == records[key], f"the first {STEPS} steps changed on {key}"
