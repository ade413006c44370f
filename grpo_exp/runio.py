"""Small file helpers shared by every writer of run outputs: atomic JSON and model directories."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from grpo_exp.errors import ConfigError


def write_json(path: str | Path, data) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_model_dir(model, tokenizer, target: str | Path) -> Path:
    """Save an HF model directory atomically: a complete new one replaces the old one, or nothing changes."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        old = None
        if target.exists():
            old = target.with_name(target.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    with path.open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def resolve_init(init_from: str | None) -> tuple[Path, Path] | None:
    """(model directory, directory holding the EWC state) for `init_from` = a run dir or its model/."""
    if not init_from:
        return None
    path = Path(init_from)
    if (path / "model" / "config.json").is_file():
        return path / "model", path
    if (path / "config.json").is_file():
        return path, path.parent
    raise ConfigError(f"init_from={init_from} holds no model (expected {path}/model/config.json); "
                      f"give the run directory of a finished stage")


def eval_sets(evaluation) -> dict[str, dict]:
    """{set name: metrics} from the shapes evaluation results come in: eval.json's {"sets": {...}},
    metrics.json's {name: {...}}, or one flat metrics dict (named "eval")."""
    if not isinstance(evaluation, dict):
        return {}
    if isinstance(evaluation.get("sets"), dict):
        evaluation = evaluation["sets"]
    if "accuracy" in evaluation and not isinstance(evaluation["accuracy"], dict):
        return {"eval": evaluation}
    return {str(k): v for k, v in evaluation.items() if isinstance(v, dict) and "accuracy" in v}
