"""Shared fixtures: configs composed with Hydra's compose API, as the entrypoint composes them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.core.global_hydra import GlobalHydra

from grpo_exp.config.compose import compose

ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = ROOT / "conf"
SHARED_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"


def compose_cfg(overrides: list[str], output_dir: Path | str, config_name: str = "train"):
    GlobalHydra.instance().clear()  # a test may have left Hydra initialised
    return compose(config_name, [*overrides, f"paths.output_dir={output_dir}"])


@pytest.fixture
def smoke_cfg(tmp_path):
    """The 2-step tiny-model config, writing into a fresh temporary run directory."""
    return compose_cfg(["debug=smoke"], tmp_path / "run")


def run_module(module: str, *args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m module args...` from the repo root, as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def assert_fails_fast_with_one_line(run_dir: Path, args: list[str], needle: str) -> None:
    """`python -m grpo_exp.train args` exits 2 with one `error:` line holding `needle`, and writes no run dir."""
    proc = run_module("grpo_exp.train", *args, f"hydra.run.dir={run_dir}", timeout=120, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert not run_dir.exists()


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run where CUDA is; elsewhere they are skipped with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine (run them on one: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
