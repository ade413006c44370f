"""Shared fixtures: configs composed with Hydra's compose API, as the entrypoint composes them; the tiny random
model, loaded once; the test rewards, registered once."""

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
def fresh_hydra():
    """Hydra uninitialised before and after the test (another test may have left it initialised), for tests that
    compose through the entrypoint's own pre-check."""
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


@pytest.fixture
def smoke_cfg(tmp_path):
    """The 2-step tiny-model config, writing into a fresh temporary run directory."""
    return compose_cfg(["debug=smoke"], tmp_path / "run")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(model, tokenizer): debug=smoke's tiny random model (model=tiny_random, seed 0), loaded once for the session
    and shared by every test that asks for it. A test leaves it as it found it (a weight it moves, it puts back); a
    module whose tests patch it (a fused LM head, another attention, the tokenizer's padding side) works on
    copy.deepcopy(tiny_model). At the end of the session the weights, the attention and the padding side must still
    be the loaded ones: a test that changed them for the others fails the session's last test."""
    import torch

    from grpo_exp.core import models

    cfg = compose_cfg(["debug=smoke"], tmp_path_factory.mktemp("tiny_model"))
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    loaded = ({n: t.detach().clone() for n, t in model.state_dict().items()}, model.config._attn_implementation,
              tokenizer.padding_side)
    yield model, tokenizer
    now = model.state_dict()
    changed = sorted(n for n, t in loaded[0].items() if n not in now or not torch.equal(now[n], t))
    assert not changed, f"a test changed the shared tiny model's weights: {changed[:5]}"
    assert (model.config._attn_implementation, tokenizer.padding_side) == loaded[1:], \
        "a test changed the shared tiny model's attention or its tokenizer's padding side"


@pytest.fixture(scope="session")
def test_rewards():
    """tests/spread_reward_main.py's rewards (vowel_fraction, with spread on the tiny model's random text, and
    nan_after, NaN on request) in rewards.REGISTRY for the rest of the session, as that runner registers them for
    its subprocesses. Returns the module: SPREAD_REWARD (the overrides that select vowel_fraction), reset_calls()
    (nan_after counts its calls from 0 again)."""
    from grpo_exp.core import rewards
    from tests import spread_reward_main

    with pytest.MonkeyPatch.context() as mp:
        for name, func in spread_reward_main.TEST_REWARDS.items():
            mp.setitem(rewards.REGISTRY, name, func)
        yield spread_reward_main


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
