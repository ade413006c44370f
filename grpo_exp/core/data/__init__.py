"""Datasets: the one place that turns a dataset name (or a stage node, splits.py) into problems and prompt
datasets."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from . import gsm8k
from .generators import (LEVELS, SPLITS, TEST_FRACTION, VALIDATION_FRACTION, band, canonical, generate,
                         generate_split, sample_stream, split_of)
from .gsm8k import DataFileError
from .prompts import DEFAULT_SYSTEM_PROMPT, to_messages
from .splits import split_seed, stage_split

if TYPE_CHECKING:
    import datasets

DATASETS = (*LEVELS, "gsm8k")

__all__ = [
    "DATASETS", "DEFAULT_SYSTEM_PROMPT", "DataFileError", "LEVELS", "SPLITS", "TEST_FRACTION",
    "VALIDATION_FRACTION", "band", "build_examples", "canonical", "generate", "generate_split", "split_of",
    "split_seed", "stage_split", "to_dataset", "to_messages",
]


def build_examples(dataset: str, split: str, *, size: int, seed: int, path: str | Path | None = None,
                   hub_id: str = "openai/gsm8k", hub_config: str = "main", test_fraction: float = TEST_FRACTION,
                   validation_fraction: float = VALIDATION_FRACTION, sample_seed: int | None = None) -> list[dict]:
    """Problems (question, answer, level, key, ...) for one split (train, validation or test) of ``dataset``.

    ``seed`` is the split seed (`stage.split_seed`): it cuts the bands and draws the held-out sets.
    ``sample_seed`` (the training seed; default ``seed``) picks and orders the training problems only.

    The splits never share a problem. Generated levels are cut by canonical computation
    (`generators.split_of`), and their validation and test sets hold distinct computations. GSM8K's test
    split is its test split (the hub's or a directory's test.jsonl); its validation split is the share
    ``validation_fraction`` of its train split picked by a seeded hash of each question, and training gets
    the rest. A single GSM8K file is cut in three bands by that hash. ``size`` 0 means all (GSM8K train);
    a GSM8K validation or test split smaller than ``size`` is a one-line DataFileError.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; valid datasets: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if dataset in LEVELS:
        return generate_split(dataset, split, size, seed, test_fraction, validation_fraction, sample_seed)
    if path is not None and str(path) != "" and Path(path).is_file():
        where = str(path)
        examples = [ex for ex in gsm8k.load(path, "train", hub_id, hub_config)
                    if split_of(ex["question"], seed, test_fraction, validation_fraction) == split]
    elif split == "test":
        where = f"the test split of {path or hub_id}"
        examples = gsm8k.load(path, "test", hub_id, hub_config)
    else:  # validation is carved out of the train split, which keeps the rest
        where = f"the train split of {path or hub_id}"
        examples = [ex for ex in gsm8k.load(path, "train", hub_id, hub_config)
                    if (split_of(ex["question"], seed, 0.0, validation_fraction) == "validation") == (split == "validation")]
    if split != "train" and len(examples) < size:
        raise DataFileError(f"GSM8K {split} split holds {len(examples)} problems of {where}, fewer than the "
                            f"{size} asked for (stage.num_{split}); lower stage.num_{split} or use a larger file")
    # Shuffle before truncating so a small subset is not just the file's first rows.
    random.Random(sample_stream(split, seed, sample_seed)).shuffle(examples)
    return examples[:size] if size > 0 else examples


def to_dataset(examples: list[dict], system_prompt: str, stage_column: bool = False) -> "datasets.Dataset":
    """A ``datasets.Dataset`` with conversational ``prompt`` plus ``answer``/``question``/``level``; with
    `stage_column`, also each example's ``stage`` (a curriculum's mixed training set: replay, adaptive)."""
    import datasets  # heavy import, only needed when a dataset is actually built

    string = datasets.Value("string")
    # Explicit features keep the schema stable even for an empty example list.
    features = datasets.Features({
        "prompt": [{"role": string, "content": string}],
        "answer": string,
        "question": string,
        "level": string,
        **({"stage": string} if stage_column else {}),
    })
    columns = {
        "prompt": [to_messages(ex["question"], system_prompt) for ex in examples],
        "answer": [str(ex["answer"]) for ex in examples],
        "question": [ex["question"] for ex in examples],
        "level": [ex["level"] for ex in examples],
    }
    if stage_column:
        columns["stage"] = [ex["stage"] for ex in examples]
    # The fingerprint is a hash of the content, given up front: `from_dict` would pickle the Arrow table
    # with dill to make one, which fails on some pyarrow/Python pairs (seen on Python 3.12, pyarrow 26).
    import hashlib
    import json

    from datasets.table import InMemoryTable

    fingerprint = hashlib.sha256(json.dumps(columns, sort_keys=True).encode()).hexdigest()[:16]
    table = InMemoryTable.from_pydict(features.encode_batch(columns), schema=features.arrow_schema)
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint=fingerprint)
