"""One model, one number: the default model's greedy answers do not depend on the batch size evaluation runs
with, and do not depend on the precision the policy trains in (evaluation always decodes in fp32)."""

from __future__ import annotations

import logging

import pytest
import torch

from grpo_exp.core import models
from grpo_exp.evaluation.generate import EVAL_PRECISION, evaluate, fp32_decoding
from grpo_exp.core.data import stage_split
from grpo_exp.evaluation.run import set_settings
from tests.conftest import compose_cfg

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 7, 32)


def _greedy_completions(cfg, model, tokenizer, problems: int, batch_sizes=BATCH_SIZES,
                        stages=("basic", "intermediate")) -> dict[str, dict[int, list[str]]]:
    """Per stage and batch size: the greedy completions of its first `problems` test problems."""
    out = {}
    for name in stages:
        stage, max_new = set_settings(cfg, name)
        examples = stage_split(stage, "test", cfg.train.seed)[:problems]
        assert len(examples) == problems
        out[name] = {}
        for batch in batch_sizes:
            _, rows = evaluate(model, tokenizer, examples, system_prompt=cfg.reward.system_prompt,
                               max_new_tokens=max_new, batch_size=batch)
            out[name][batch] = [r["completion"] for r in rows]
    return out


def _assert_batch_invariant(found: dict[str, dict[int, list[str]]]) -> None:
    for name, by_batch in found.items():
        differ = {b: sum(x != y for x, y in zip(by_batch[1], by_batch[b])) for b in by_batch}
        logger.warning("%s: %d problems, completions differing from batch size 1: %s", name, len(by_batch[1]), differ)
        assert all(v == 0 for v in differ.values()), f"{name}: completions differ from batch size 1: {differ}"


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    cfg = compose_cfg([], tmp_path_factory.mktemp("one_number"))
    return cfg, *models.load(cfg.model, cfg.paths.cache_dir)


@pytest.mark.slow
def test_default_model_answers_do_not_depend_on_the_batch_size(default_model):
    """Greedy completions at batch sizes 1, 3 (a ragged last batch) and 32 on 4 basic test problems (make test; the
    64-problem test of both stages below is make test-long's)."""
    _assert_batch_invariant(_greedy_completions(*default_model, problems=4, batch_sizes=(1, 3, 32), stages=("basic",)))


@pytest.mark.long
def test_default_model_answers_do_not_depend_on_the_batch_size_on_64_problems(default_model):
    """The same on 64 problems of each stage (about 10 minutes on 2 cores: make test-long)."""
    _assert_batch_invariant(_greedy_completions(*default_model, problems=64))


def test_fp32_decoding_lifts_an_autocast_wrapper_and_refuses_bf16_weights(tiny_model):
    model, _ = tiny_model
    seen = []
    original = type(model).forward

    def wrapped(self, *args, **kwargs):  # what accelerate leaves on a mixed-precision policy
        seen.append("autocast")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return original(self, *args, **kwargs)

    import types

    model._original_forward = model.forward
    model.forward = types.MethodType(wrapped, model)
    try:
        with fp32_decoding(model):
            ids = torch.tensor([[1, 2, 3]])
            logits = model(input_ids=ids).logits
        assert not seen and logits.dtype == torch.float32
        model(input_ids=ids)
        assert seen == ["autocast"]  # restored afterwards
    finally:
        del model.forward, model._original_forward
    copy = models_copy_bf16(model)
    with pytest.raises(ValueError, match=EVAL_PRECISION):
        with fp32_decoding(copy):
            pass


def models_copy_bf16(model):
    import copy

    return copy.deepcopy(model).to(torch.bfloat16)


@pytest.mark.slow
def test_a_run_and_a_fresh_process_give_its_model_the_same_answers(tmp_path):
    """A run trained under bf16 autocast scores its model in-process; `python -m grpo_exp.evaluate` scores the saved
    model/ in a fresh process: the same problems get the same completions, and eval.json says fp32 in both."""
    import json

    from tests.conftest import run_module

    run = tmp_path / "run"
    # the default model: the tiny random one answers blank lines in either precision, so it could not fail
    # the training step is small (bf16 is emulated, and slow, on a CPU without it: one prompt's 2 completions of 8
    # tokens, no KL reference to load and score); the evaluations' are long enough for the default model's answers
    overrides = ["debug=smoke", "model=smollm2_135m", "train.max_steps=1", "train.max_completion_length=8",
                 "train.per_device_train_batch_size=2", "train.beta=0", "train.precision=bf16",
                 "eval.max_new_tokens=48", "eval.limit=8", "stage.num_test=8", "eval.every_steps=null", "logger=none"]
    trained = run_module("grpo_exp.train", *overrides, f"hydra.run.dir={run}", timeout=600, env={"HF_HUB_OFFLINE": "1"})
    assert trained.returncode == 0, trained.stderr[-3000:]
    fresh = tmp_path / "fresh"
    scored = run_module("grpo_exp.evaluate", f"checkpoint={run}", "eval.sets=[basic]", "eval.limit=8",
                        "eval.max_new_tokens=48",
                        f"hydra.run.dir={fresh}", timeout=600, env={"HF_HUB_OFFLINE": "1"})
    assert scored.returncode == 0, scored.stderr[-3000:]

    def answers(folder):
        rows = [json.loads(line) for line in (folder / "eval_samples.jsonl").read_text().splitlines()]
        return [(r["question"], r["completion"]) for r in rows if r["set"] == "basic"]

    assert answers(run) and answers(run) == answers(fresh)
    for folder in (run, fresh):
        assert json.loads((folder / "eval.json").read_text())["config"]["precision"] == EVAL_PRECISION
