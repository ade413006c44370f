"""Datasets: the one place that turns a dataset name (or a stage node, splits.py) into problems and prompt
datasets."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from . import gsm8k, prompt_table
from .generators import (LEVELS, SPLITS, TEST_FRACTION, VALIDATION_FRACTION, band, canonical, generate,
                         generate_split, sample_stream, split_of)
from .gsm8k import DataFileError
from .prompts import DEFAULT_SYSTEM_PROMPT, prompt_messages, to_messages
from .splits import split_seed, stage_split

if TYPE_CHECKING:
    import datasets

# prompts: a TRL-shaped dataset of the user's own (prompt_table); gsm8k and prompts are read from files or the hub,
# and their held-out sets are whole splits of them (stage.num_<split> is the least a split must hold)
DATASETS = (*LEVELS, "gsm8k", "prompts")

__all__ = [
    "DATASETS", "DEFAULT_SYSTEM_PROMPT", "DataFileError", "LEVELS", "SPLITS", "TEST_FRACTION",
    "VALIDATION_FRACTION", "band", "build_examples", "canonical", "generate", "generate_split", "prompt_messages",
    "split_of", "split_seed", "stage_split", "to_dataset", "to_messages",
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
    a GSM8K validation or test split smaller than ``size`` is a one-line DataFileError. A prompts dataset (a
    `prompt` column; `path` or the hub's ``hub_id``) is cut in three by a seeded hash of each prompt
    (prompt_table.split_examples).
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; valid datasets: {', '.join(DATASETS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if dataset in LEVELS:
        return generate_split(dataset, split, size, seed, test_fraction, validation_fraction, sample_seed)
    if dataset == "prompts":
        return prompt_table.split_examples(prompt_table.load(path, hub_id, hub_config), split, size=size, seed=seed,
                                           test_fraction=test_fraction, validation_fraction=validation_fraction,
                                           sample_seed=sample_seed)
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
    """A ``datasets.Dataset`` with conversational ``prompt`` plus ``answer``/``question``/``level`` (a prompts
    stage's rows: their own columns instead, as TRL passes a dataset's columns to the rewards); with
    `stage_column`, also each example's ``stage`` (a curriculum's mixed training set: replay, adaptive)."""
    import datasets  # heavy import, only needed when a dataset is actually built

    if any("columns" in ex for ex in examples):
        return _table_dataset(examples, system_prompt, stage_column)
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
    return _dataset(columns, features.encode_batch(columns), features)


def _table_dataset(examples: list[dict], system_prompt: str, stage_column: bool) -> "datasets.Dataset":
    """Rows of a prompts stage (and, mixed in by a curriculum, generated problems with their own three columns):
    the chat prompt and every column any row has, None where a row lacks it; the types are Arrow's reading."""
    def own(ex: dict) -> dict:
        return ex["columns"] if "columns" in ex else {k: str(ex[k]) for k in ("answer", "question", "level")}

    names = list(dict.fromkeys(k for ex in examples for k in own(ex)))
    columns = {"prompt": [prompt_messages(ex, system_prompt) for ex in examples],
               **{name: [own(ex).get(name) for ex in examples] for name in names}}
    if stage_column:
        columns["stage"] = [ex["stage"] for ex in examples]
    return _dataset(columns, columns, None)


def _dataset(columns: dict, encoded: dict, features) -> "datasets.Dataset":
    """The dataset of `encoded` columns, with `features` (None: read from the Arrow table)."""
    import hashlib
    import json

    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    # The fingerprint is a hash of the content, given up front: `from_dict` would pickle the Arrow table
    # with dill to make one, which fails on some pyarrow/Python pairs (seen on Python 3.12, pyarrow 26).
    fingerprint = hashlib.sha256(json.dumps(columns, sort_keys=True, default=str).encode()).hexdigest()[:16]
    table = InMemoryTable(pa.Table.from_pydict(encoded, schema=None if features is None else features.arrow_schema))
    features = features or datasets.Features.from_arrow_schema(table.schema)
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint=fingerprint)
