"""Datasets: the one place that turns a dataset name into problems and prompt datasets."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from . import gsm8k
from .generators import LEVELS, TEST_FRACTION, canonical, generate, generate_splits, is_test_key
from .gsm8k import DataFileError
from .prompts import DEFAULT_SYSTEM_PROMPT, to_messages

if TYPE_CHECKING:
    import datasets

DATASETS = (*LEVELS, "gsm8k")
SPLITS = ("train", "test")

__all__ = [
    "DATASETS", "DEFAULT_SYSTEM_PROMPT", "DataFileError", "LEVELS", "SPLITS",
    "TEST_FRACTION", "build_examples", "canonical", "generate", "is_test_key", "generate_splits", "to_dataset", "to_messages",
]


def build_examples(dataset: str, split: str, *, num_train: int, num_test: int, seed: int,
                   path: str | Path | None = None, hub_id: str = "openai/gsm8k",
                   hub_config: str = "main", test_fraction: float = TEST_FRACTION) -> list[dict]:
    """Problems (question, answer, level, ...) for one split of ``dataset``.

    The two splits never share a problem: generated levels are split by canonical expression
    (`generators.generate_splits`); GSM8K takes its train and test splits from the hub or a
    directory's train.jsonl/test.jsonl, and a single file is split in two by a seeded hash of each
    question, ``test_fraction`` of it held out.
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; valid datasets: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if dataset in LEVELS:
        if split == "test":
            # The test split never depends on num_train, so skip generating train.
            return generate_splits(dataset, 0, num_test, seed, test_fraction)[1]
        return generate_splits(dataset, num_train, 0, seed, test_fraction)[0]
    if path is not None and str(path) != "" and Path(path).is_file():
        examples = [ex for ex in gsm8k.load(path, split, hub_id, hub_config)
                    if is_test_key(ex["question"], seed, test_fraction) == (split == "test")]
    else:
        examples = gsm8k.load(path, split, hub_id, hub_config)
    # Shuffle before truncating so a small subset is not just the file's first rows.
    random.Random(seed).shuffle(examples)
    limit = num_train if split == "train" else num_test
    return examples[:limit] if limit > 0 else examples


def to_dataset(examples: list[dict], system_prompt: str) -> "datasets.Dataset":
    """A ``datasets.Dataset`` with conversational ``prompt`` plus ``answer``/``question``/``level``."""
    import datasets  # heavy import, only needed when a dataset is actually built

    string = datasets.Value("string")
    # Explicit features keep the schema stable even for an empty example list.
    features = datasets.Features({
        "prompt": [{"role": string, "content": string}],
        "answer": string,
        "question": string,
        "level": string,
    })
    columns = {
        "prompt": [to_messages(ex["question"], system_prompt) for ex in examples],
        "answer": [str(ex["answer"]) for ex in examples],
        "question": [ex["question"] for ex in examples],
        "level": [ex["level"] for ex in examples],
    }
    # The fingerprint is a hash of the content, given up front: `from_dict` would pickle the Arrow table
    # with dill to make one, which fails on some pyarrow/Python pairs (seen on Python 3.12, pyarrow 26).
    import hashlib
    import json

    from datasets.table import InMemoryTable

    fingerprint = hashlib.sha256(json.dumps(columns, sort_keys=True).encode()).hexdigest()[:16]
    table = InMemoryTable.from_pydict(features.encode_batch(columns), schema=features.arrow_schema)
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint=fingerprint)
