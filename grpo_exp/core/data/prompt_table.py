"""A TRL-shaped dataset (stage.dataset=prompts): JSONL files or a hub dataset with a `prompt` column, cut by a seeded hash."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_exp.base.text import error_line, one_line

from .generators import sample_stream, split_of
from .gsm8k import DataFileError, json_lines

PROMPT = "prompt"
# TRL calls a reward with these keywords beside the dataset's columns: a column of the same name would be passed
# twice (a TypeError at the first step), and TRL drops `completion`/`completion_ids` columns from the call
RESERVED = ("prompts", "completions", "completion", "completion_ids", "trainer_state", "log_extra", "log_metric",
            "environments")
LEVEL = "prompts"  # the `level` of every row, as generated problems carry theirs
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Table:
    """The rows of a prompts dataset as read, where they came from, and the columns besides `prompt`."""

    rows: tuple[dict, ...]
    where: str  # "my_data/prompts.jsonl", "hub dataset org/name (train split)"
    columns: tuple[str, ...]


def load(path: str | Path | None, hub_id: str | None = None, hub_config: str | None = None) -> Table:
    """The dataset at `path` (a JSONL file, or a directory whose *.jsonl files are read in name order), else the
    train split of the hub dataset `hub_id`; checked row by row (DataFileError, one line naming the file and line)."""
    if path is not None and str(path) != "":
        path = Path(path)
        if not path.exists():
            raise DataFileError(f"prompts file not found: {path}")
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not files:
            raise DataFileError(f"prompts directory {path} holds no .jsonl file")
        # read once per file version: the pre-check, training and evaluation each ask for the table
        stamps = tuple((str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
        return _local(stamps, str(path))
    if not hub_id:
        raise DataFileError("stage.dataset=prompts needs stage.path=<JSONL file or directory> or "
                            "stage.hub_id=<hub dataset id>")
    return _hub(str(hub_id), str(hub_config or ""))


@functools.lru_cache(maxsize=8)
def _local(stamps: tuple[tuple[str, int, int], ...], shown: str) -> Table:
    read = [pair for name, _, _ in stamps for pair in _read_jsonl(Path(name))]
    if not read:
        raise DataFileError(f"prompts file is empty: {shown}")
    return _checked([row for row, _ in read], shown, [label for _, label in read])


def _read_jsonl(path: Path) -> list[tuple[dict, str]]:
    """(row, 'prompts file F, line N') of each non-blank line."""
    rows = []
    for row, where in json_lines(path, "prompts"):
        if not isinstance(row, dict):
            raise DataFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
        rows.append((row, where))
    return rows


@functools.lru_cache(maxsize=2)
def _hub(hub_id: str, hub_config: str) -> Table:
    try:
        import datasets

        loaded = datasets.load_dataset(hub_id, hub_config or None, split="train")
    except Exception as err:  # offline, auth, bad id, no train split: the remedy is the same
        raise DataFileError(f"could not load the hub dataset {hub_id}: {one_line(error_line(err))}; pass "
                            f"stage.path=<local JSONL with a prompt column> instead") from err
    where = f"hub dataset {hub_id} (train split)"
    rows = loaded.to_list()
    if not rows:
        raise DataFileError(f"{where} is empty")
    return _checked(rows, where, [f"{where}, row {i}" for i in range(1, len(rows) + 1)])


def _checked(rows: list[dict], where: str, labels: list[str]) -> Table:
    """The rows, refused in one line where one has no usable prompt, a column is named as a reward keyword, or a
    column holds values of different types (Arrow, and so the trainer's dataset, could not hold it)."""
    names = list(dict.fromkeys(k for row in rows for k in row))
    if PROMPT not in names:
        raise DataFileError(f"{where} has no '{PROMPT}' column (its columns: {', '.join(map(str, names)) or 'none'}); "
                            f"rename the column holding the prompts to '{PROMPT}' (text or chat messages)")
    clash = [n for n in names if n in RESERVED]
    if clash:
        raise DataFileError(f"{where} has a column named '{clash[0]}', a keyword TRL passes to every reward "
                            f"function itself; rename the column")
    for row, label in zip(rows, labels):
        problem = _prompt_problem(row.get(PROMPT))
        if problem:
            raise DataFileError(f"{label}: '{PROMPT}' {problem}")
    columns = [n for n in names if n != PROMPT]
    for column in columns:
        kinds = {_kind(row[column]): label for row, label in zip(rows, labels) if row.get(column) is not None}
        if len(kinds) > 1:
            (first, _), (other, at) = list(kinds.items())[:2]
            raise DataFileError(f"column '{column}' of {where} holds both {first} and {other} values ({at}); "
                                f"give it one type")
    return Table(tuple(rows), where, tuple(columns))


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"  # Arrow widens int to float in one column
    return {str: "text", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _prompt_problem(prompt: Any) -> str | None:
    """Why `prompt` is neither text nor a list of chat messages, or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is empty"
    if not isinstance(prompt, list):
        return f"must be text or a list of chat messages, not {'missing' if prompt is None else type(prompt).__name__}"
    if not prompt:
        return "is an empty list of messages"
    for message in prompt:
        if not (isinstance(message, dict) and message.get("role") in _ROLES
                and isinstance(message.get("content"), str)):
            return (f"message {one_line(json.dumps(message, default=str), 80)} is not "
                    f"{{\"role\": system|user|assistant, \"content\": text}}")
    if prompt[-1]["role"] == "assistant":
        return "ends with an assistant message; the model is asked to write the next one"
    return None


def prompt_key(prompt: str | list[dict]) -> str:
    """What a prompt's split is hashed from: its text, or its messages as canonical JSON. Rows with the same prompt
    land in the same split, so a held-out prompt is never one training saw."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def prompt_text(prompt: str | list[dict]) -> str:
    """The text a person reads as the question: the prompt, or its last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return users[-1] if users else prompt[-1]["content"]


def example(row: dict) -> dict:
    """A row as a problem: the prompt as given, the other columns (passed to the rewards as they are), and the
    fields every problem has (question, answer: the `answer` column or "", level, key)."""
    prompt = row[PROMPT]
    columns = {k: v for k, v in row.items() if k != PROMPT}
    answer = columns.get("answer")
    return {"prompt": prompt, "columns": columns, "question": prompt_text(prompt),
            "answer": "" if answer is None else str(answer), "level": LEVEL, "key": prompt_key(prompt)}


def split_examples(table: Table, split: str, *, size: int, seed: int, test_fraction: float,
                   validation_fraction: float, sample_seed: int | None = None) -> list[dict]:
    """One split (train, validation or test) of `table`, cut by a seeded hash of each prompt (`split_of`: test below
    test_fraction, validation next, train the rest). The held-out splits must hold `size` rows (stage.num_<split>);
    the train split must hold one. `size` 0 means all; a larger split is shuffled (training: by `sample_seed`)
    and cut to `size`."""
    examples = [example(row) for row in table.rows
                if split_of(prompt_key(row[PROMPT]), seed, test_fraction, validation_fraction) == split]
    if split != "train" and len(examples) < size:
        raise DataFileError(f"the {split} split of {table.where} holds {len(examples)} of its {len(table.rows)} rows, "
                            f"fewer than the {size} asked for (stage.num_{split}); lower stage.num_{split}, raise "
                            f"stage.{'test' if split == 'test' else 'validation'}_fraction or add rows")
    if split == "train" and not examples:
        raise DataFileError(f"the train split of {table.where} is empty ({len(table.rows)} rows, all held out); "
                            f"lower stage.test_fraction and stage.validation_fraction or add rows")
    # Shuffle before truncating so a small subset is not just the file's first rows.
    random.Random(sample_stream(split, seed, sample_seed)).shuffle(examples)
    return examples[:size] if size > 0 else examples


def required_columns(funcs: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """(entry, column) for each keyword a reward function needs (no default) that TRL does not pass itself: the
    dataset must have that column."""
    import inspect

    needed = []
    for entry, func in funcs:
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            continue
        needed += [(entry, p.name) for p in params
                   if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
                   and p.name not in (*RESERVED, PROMPT)]
    return needed


def check_columns(table: Table, funcs: list[tuple[str, Any]], key: str = "reward.funcs") -> None:
    """One line where a reward of `funcs` ((entry, function) pairs, named under `key`) needs a column `table` lacks;
    TRL would fail at the first step, after the model loaded."""
    for entry, column in required_columns(funcs):
        if column not in table.columns:
            raise DataFileError(f"{key} entry '{entry}' needs the column '{column}', which {table.where} lacks "
                                f"(its columns: {', '.join((PROMPT, *table.columns))}); add the column or choose "
                                f"another reward")
