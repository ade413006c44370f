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


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run where CUDA is; elsewhere they are skipped with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine (run them on one: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
