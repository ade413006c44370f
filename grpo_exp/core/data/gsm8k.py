"""GSM8K loading from a local JSONL file or the Hugging Face hub; ground truth is '#### N'."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from grpo_exp.base.errors import ConfigError
from grpo_exp.base.text import error_line, one_line

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


class DataFileError(ConfigError):
    """A data source could not be read; the message is one line saying where and why."""


def parse_gsm8k_answer(answer_text: str) -> str:
    """The number after ``####`` with commas, ``$`` and whitespace removed."""
    if not isinstance(answer_text, str) or "####" not in answer_text:
        raise ValueError("answer has no '####' marker")
    raw = answer_text.rsplit("####", 1)[1]
    number = raw.replace(",", "").replace("$", "").strip()
    if not _NUMBER.fullmatch(number):
        raise ValueError(f"answer after '####' is not a number: {one_line(raw.strip())!r}")
    return number


def _example(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in ("question", "answer"):
        if key not in row:
            raise DataFileError(f"{where}: missing {key!r} key")
        if not isinstance(row[key], str):
            raise DataFileError(f"{where}: {key!r} must be a string")
    try:
        answer = parse_gsm8k_answer(row["answer"])
    except ValueError as err:
        raise DataFileError(f"{where}: {err}") from None
    return {
        "question": row["question"].strip(),
        "answer": answer,
        "rationale": row["answer"].rsplit("####", 1)[0].strip(),
        "level": "gsm8k",
    }


def json_lines(path: Path, kind: str):
    """(the JSON value, '<kind> file <path>, line N') of each non-blank line of `path`; a line that is not UTF-8 or
    not JSON is a DataFileError naming the file and the line."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{kind} file {path}, line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataFileError(f"{where}: not valid UTF-8") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataFileError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None
            yield value, where


def load_jsonl(path: str | Path) -> list[dict]:
    """Parse a GSM8K-format JSONL file; blank lines are skipped."""
    path = Path(path)
    if not path.exists():
        raise DataFileError(f"GSM8K file not found: {path}")
    if not path.is_file():
        raise DataFileError(f"GSM8K path is not a file: {path}")
    examples = [_example(row, where) for row, where in json_lines(path, "GSM8K")]
    if not examples:
        raise DataFileError(f"GSM8K file is empty: {path}")
    return examples


def load_hub(hub_id: str = "openai/gsm8k", config: str = "main",
             split: str = "test") -> list[dict]:
    """Load a GSM8K split with ``datasets.load_dataset`` (needs network or a warm cache)."""
    try:
        import datasets

        rows = datasets.load_dataset(hub_id, config, split=split)
    except Exception as err:  # offline, auth, bad id or split: the remedy is the same
        reason = one_line(error_line(err))
        raise DataFileError(
            f"could not load GSM8K from the hub ({hub_id}): {reason}; "
            f"pass stage.path=<local JSONL> instead") from err
    return [_example(row, f"GSM8K hub dataset {hub_id} ({config}/{split}), row {i}")
            for i, row in enumerate(rows, start=1)]


def load(path: str | Path | None, split: str, hub_id: str, hub_config: str) -> list[dict]:
    """A local file (a directory means ``<dir>/<split>.jsonl``) if given, else the hub."""
    if path is None or str(path) == "":
        return load_hub(hub_id, hub_config, split)
    path = Path(path)
    if path.is_dir():
        path = path / f"{split}.jsonl"
    return load_jsonl(path)
