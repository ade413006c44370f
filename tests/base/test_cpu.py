"""OpenMP settings reach the environment before torch loads, and say so when they cannot; the malloc policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch  # noqa: F401  (loaded, as in any process that already ran torch code)
from omegaconf import OmegaConf

from grpo_exp.base import cpu
from grpo_exp.base.errors import ConfigError
from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch):
    """prepare_env writes process-wide variables; later tests' subprocesses must not inherit them."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY"):
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:
            monkeypatch.delenv(var, raising=False)


def _cpu_cfg(policy: str, threads="1"):
    return OmegaConf.create({"threads": threads, "interop_threads": 1, "omp_wait_policy": policy})


@pytest.mark.slow
def test_settings_are_in_place_when_torch_loads():
    code = ("import os, sys; from omegaconf import OmegaConf; from grpo_exp.base import cpu\n"
            "cpu.prepare_env(OmegaConf.create({'threads': 1, 'interop_threads': 1, 'omp_wait_policy': 'passive'}))\n"
            "assert 'torch' not in sys.modules\n"
            "import torch\n"
            "print(os.environ['OMP_WAIT_POLICY'], torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    # torch picked its thread count from OMP_NUM_THREADS, which it reads only when it loads
    assert out.stdout.split() == ["PASSIVE", "1"]


def test_default_policy_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cpu.prepare_env(_cpu_cfg("default"))
    assert "OMP_WAIT_POLICY" not in os.environ


def test_a_policy_that_comes_too_late_warns_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with pytest.warns(UserWarning, match="torch is already loaded"):
        cpu.prepare_env(_cpu_cfg("active"))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # still what OpenMP actually read


def test_bad_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="cpu.omp_wait_policy='spin'.*default, passive, active"):
        cpu.prepare_env(_cpu_cfg("spin"))


@pytest.mark.slow
def test_precision_auto_is_fp32_where_torch_is_held_to_avx2():
    """The emulated AVX2-only runs (ATEN_CPU_CAPABILITY=avx2) choose what an AVX2-only CPU chooses, on any CPU."""
    code = "from grpo_exp.base.cpu import resolve_precision; print(resolve_precision('auto'))"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "fp32"
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    held = torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2")
    assert cpu.resolve_precision("auto") == ("bf16" if native and not held else "fp32")


_MALLOC_RUN = """
import json, resource, sys
import torch
from grpo_exp.base import cpu
from grpo_exp.core import rewards
from tests.conftest import compose_cfg
from tests.spread_reward_main import SPREAD_REWARD, TEST_REWARDS
from tests.training.briefly import train_briefly

rewards.REGISTRY.update(TEST_REWARDS)  # as tests/spread_reward_main.py registers them for its subprocesses
policy, out = sys.argv[1], sys.argv[2]
cfg = compose_cfg(["debug=smoke", "logger=none", "cpu.threads=1", f"cpu.malloc={policy}", *SPREAD_REWARD], out)
trainer, _, losses, moved = train_briefly(cfg)  # applies cfg.cpu, as every entrypoint does before the model loads


def touch():  # 64 MB: above glibc's largest mmap threshold (32 MiB), so glibc's own policy maps it afresh each time
    return float(torch.ones(16 * 2**20)[::4096].sum())


touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    touch()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
# a later job of a sweep in this process cannot turn glibc's own policy back on: it must not claim to have
later = cpu.apply_malloc("glibc")
print(json.dumps({"malloc": cpu.apply(cfg.cpu)["malloc"], "later_glibc": later, "losses": losses, "moved": moved,
                  "faults": faults}))
"""


@pytest.mark.long  # two training runs in subprocesses
def test_malloc_retain_reuses_freed_memory_and_changes_no_number(tmp_path):
    """cpu.malloc=retain keeps freed blocks for reuse (a 64 MB tensor allocated again faults no fresh pages in,
    where glibc's own policy maps and zero-fills it anew every time), and a GRPO run computes the same losses,
    to the last bit, under either policy."""
    runs = {}
    for policy in ("glibc", "retain"):
        proc = subprocess.run([sys.executable, "-c", _MALLOC_RUN, policy, str(tmp_path / policy)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[policy] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["glibc"]["malloc"] == "glibc" and runs["retain"]["malloc"] == "retain"
    assert runs["glibc"]["later_glibc"] == "glibc" and runs["retain"]["later_glibc"] == "retain"
    # five reallocations of 16384 pages each: all faulted in again under glibc's policy, none under retain
    assert runs["glibc"]["faults"] > 5 * 16384 * 0.9, runs["glibc"]
    assert runs["retain"]["faults"] < 1000, runs["retain"]
    assert runs["retain"]["moved"] and len(runs["retain"]["losses"]) == 2
    assert runs["retain"]["losses"] == runs["glibc"]["losses"]


_RELEASE_RUN = """
import json, psutil, torch
from grpo_exp.base import cpu

def rss_mb():
    return psutil.Process().memory_info().rss / 2**20

cpu.apply_malloc("retain")
# a stage's worth of tensors of many sizes, touched, then freed: under retain they stay resident
blocks = [torch.ones(2**20 + 4096 * i) for i in range(64)]  # about 270 MB
held = rss_mb()
del blocks
freed = rss_mb()
released = cpu.release_freed_memory()
print(json.dumps({"held": held, "freed": freed, "after": rss_mb(), "released": released}))
"""


@pytest.mark.slow  # a process of its own: retain, once set, stays for the process
@pytest.mark.skipif(cpu._glibc() is None, reason="malloc_trim is glibc's; this C library keeps its own policy")
def test_release_gives_memory_kept_by_retain_back_between_stages():
    """What a finished stage freed stays resident under retain until release_freed_memory, which every stage and
    every matrix evaluation of a curriculum calls first: then it goes back to the kernel."""
    proc = subprocess.run([sys.executable, "-c", _RELEASE_RUN], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mb = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mb["freed"] > mb["held"] - 20, mb  # retain: nothing went back when the tensors were freed
    assert mb["released"] and mb["after"] < mb["freed"] - 200, mb


def test_bad_malloc_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="cpu.malloc='jemalloc'.*auto, retain, glibc"):
        cpu.apply_malloc("jemalloc")
