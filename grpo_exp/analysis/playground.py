"""One question answered by a run's starting model and by the run's trained model/, side by side: the
same chat prompt (the run's system prompt), the same decoding, each answer parsed by the correctness
reward's parser and checked against an expected answer when one is given. The web app's Playground."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from grpo_exp.base import log

logger = log.get_logger(__name__)
MAX_LOADED = 4  # models kept in memory between questions; a tiny model is MBs, the default model ~0.5 GB


@dataclass
class Answer:
    model: str  # what answered: "base (<model option>)" or the run
    text: str
    predicted: float | None
    correct: bool | None  # None: no expected answer given
    tokens: int
    seconds: float


@dataclass
class RunSettings:
    run_dir: Path
    model_cfg: object  # the run's `model` node
    cache_dir: str
    seed: int
    system_prompt: str
    max_new_tokens: int
    stage: object  # the run's `stage` node

    @property
    def base_label(self) -> str:
        return f"base model ({self.model_cfg.name})"


def run_settings(run_dir: str | Path) -> RunSettings:
    """What a run trained with, from its .hydra/config.yaml (a curriculum stage reads its run's)."""
    from omegaconf import OmegaConf

    from grpo_exp.config.options import group_options
    from grpo_exp.config.recorded import run_config

    run_dir = Path(run_dir)
    found = run_config(run_dir)
    if found is None:
        raise FileNotFoundError(f"{run_dir} has no .hydra/config.yaml (not a training run directory)")
    cfg = found[0]
    stage = cfg.stage
    # a curriculum stage directory is <n>_<stage option> (2_intermediate); a run directory is a timestamp
    number, _, stage_name = run_dir.name.partition("_")
    if number.isdigit() and stage_name in group_options("stage") and stage_name != OmegaConf.select(cfg, "stage.name"):
        # a curriculum stage directory (2_intermediate): that stage's problems, not the run's first stage
        from grpo_exp.config.compose import compose

        stage = compose("train", [f"stage={stage_name}"]).stage
    return RunSettings(
        run_dir=run_dir, model_cfg=cfg.model, cache_dir=str(cfg.paths.cache_dir), seed=int(cfg.train.seed),
        system_prompt=str(OmegaConf.select(cfg, "reward.system_prompt") or ""),
        max_new_tokens=int(cfg.train.max_completion_length), stage=stage)


def held_out_problem(settings: RunSettings, index: int) -> tuple[str, str]:
    """(question, answer) number `index` (wrapping) of the run's validation split, as periodic evaluation
    draws it (the test split is kept for the figure a run reports)."""
    from grpo_exp.core import data

    stage = settings.stage
    examples = data.build_examples(stage.dataset, "validation", size=int(stage.get("num_validation", 200)),
                                   seed=settings.seed, path=stage.get("path"),
                                   hub_id=stage.get("hub_id", "openai/gsm8k"), hub_config=stage.get("hub_config", "main"),
                                   test_fraction=float(stage.get("test_fraction", data.TEST_FRACTION)),
                                   validation_fraction=float(stage.get("validation_fraction", data.VALIDATION_FRACTION)))
    if not examples:
        raise ValueError(f"the validation split of stage {stage.name} is empty")
    example = examples[index % len(examples)]
    return str(example["question"]), str(example["answer"])


class Models:
    """Loaded (model, tokenizer) pairs by key, the least recently used dropped beyond MAX_LOADED;
    one lock, because the app answers requests on several threads and torch models are not shared safely."""

    def __init__(self):
        self._loaded: OrderedDict[str, tuple] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: str, loader):
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        pair = loader()
        self._loaded[key] = pair
        while len(self._loaded) > MAX_LOADED:
            self._loaded.popitem(last=False)
        return pair


def _base(settings: RunSettings):
    from grpo_exp.core import models

    # the seed matters only for tiny_random, whose weights it draws: the run's seed gives the run's start
    return models.load(settings.model_cfg, settings.cache_dir, seed=settings.seed)


def _trained(settings: RunSettings):
    from grpo_exp.core import models

    model_dir = settings.run_dir / "model"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{settings.run_dir} has no model/ yet (the run has not finished or was stopped early)")
    return models.load(settings.model_cfg, settings.cache_dir, seed=settings.seed, init_from=model_dir)


def answer(model, tokenizer, label: str, question: str, *, system_prompt: str, expected: str | None,
           max_new_tokens: int, do_sample: bool, temperature: float, seed: int) -> Answer:
    from grpo_exp.core import rewards
    from grpo_exp.core.data import to_messages
    from grpo_exp.evaluation.generate import generate_completions

    start = time.perf_counter()
    texts, lengths, _, _ = generate_completions(model, tokenizer, [to_messages(question, system_prompt)],
                                                max_new_tokens=max_new_tokens, batch_size=1, do_sample=do_sample,
                                                temperature=temperature, seed=seed, desc=label)
    predicted = rewards.extract_answer(texts[0])
    correct = None
    if expected is not None and str(expected).strip():
        correct = rewards.answers_match(predicted, str(expected).strip())
    return Answer(label, texts[0], predicted, correct, lengths[0], time.perf_counter() - start)


def side_by_side(models: Models, run_dir: str | Path, question: str, *, expected: str | None = None,
                 do_sample: bool = False, temperature: float = 0.8, seed: int = 0,
                 max_new_tokens: int | None = None) -> tuple[Answer, Answer]:
    """(the run's starting model's answer, the trained model's answer) to `question`."""
    settings = run_settings(run_dir)
    tokens = int(max_new_tokens or settings.max_new_tokens)
    common = dict(system_prompt=settings.system_prompt, expected=expected, max_new_tokens=tokens,
                  do_sample=do_sample, temperature=temperature, seed=seed)
    with models.lock:
        base_key = f"base:{settings.model_cfg.name}:{settings.model_cfg.get('id')}:{settings.seed}"
        model, tokenizer = models.get(base_key, lambda: _base(settings))
        base = answer(model, tokenizer, settings.base_label, question, **common)
        model, tokenizer = models.get(f"run:{settings.run_dir.resolve()}", lambda: _trained(settings))
        trained = answer(model, tokenizer, f"trained ({settings.run_dir.name})", question, **common)
    logger.info("playground: %s -> base %r, trained %r", question[:60], base.predicted, trained.predicted)
    return base, trained
