"""Run files: atomic JSON and model directories, JSONL reading, and where a run continues from."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from grpo_exp.base.errors import ConfigError, DiskFullError


def write_json(path: str | Path, data) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see half a file."""
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def write_jsonl(path: str | Path, rows) -> None:
    """One JSON object a line, written as write_json writes: the file is replaced whole or not at all."""
    write_text(path, "".join(json.dumps(row, default=str) + "\n" for row in rows))


def write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def disk_full_reason(err: BaseException, target: str | Path, needed_bytes: int) -> str | None:
    """One line saying that writing `target` failed because its disk is full, else None (the caller then
    keeps the original error).

    Full means errno ENOSPC, or a failed write with less free space left than the `needed_bytes` it was
    writing: torch.save reports a full disk only as "unexpected pos", with no errno. Call it before
    cleaning up the partial write, which frees space again."""
    target = Path(target)
    probe = next((p for p in (target, *target.parents) if p.exists()), Path(os.sep))
    free = shutil.disk_usage(probe).free
    if getattr(err, "errno", None) != errno.ENOSPC and free >= needed_bytes:
        return None
    return (f"{target.name} not written: the disk holding {probe} is full ({free // 2**20} MB free, "
            f"about {needed_bytes // 2**20} MB needed)")


def state_bytes(model) -> int:
    """Bytes of a model's parameters and buffers: what saving its weights writes."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


RETIRED_SUFFIX = ".retired"
# Tests set this to a callable(step, final) to kill the process at a step of publish_dir ("retired":
# the old copy moved aside; "published": the new copy renamed in) and check that repair_publish copes.
publish_fault_hook: Callable[[str, Path], None] | None = None


def retired_dir(final: Path) -> Path:
    return final.with_name(final.name + RETIRED_SUFFIX)


def publish_dir(staging: Path, final: Path) -> None:
    """Put the complete directory `staging` at `final` with no moment lacking a complete copy: move the
    old copy aside (`<final>.retired`), rename the new one in, then delete the old. A kill at any point
    leaves a complete copy at `final` or at `<final>.retired`, and `repair_publish` restores the rule
    "exactly one copy, at `final`"."""
    retired = retired_dir(final)
    if final.exists():
        if retired.exists():
            shutil.rmtree(retired)
        os.replace(final, retired)
        if publish_fault_hook:
            publish_fault_hook("retired", final)
    os.replace(staging, final)
    if publish_fault_hook:
        publish_fault_hook("published", final)
    if retired.exists():
        shutil.rmtree(retired)


def repair_publish(final: Path) -> str | None:
    """Finish or undo a publish_dir that a kill interrupted; returns what it did, or None."""
    retired = retired_dir(final)
    if not retired.exists():
        return None
    if final.exists():  # the new copy was already in place: the old one only had to go
        shutil.rmtree(retired)
        return f"removed the previous copy {retired.name} left by an interrupted save"
    os.replace(retired, final)  # killed between moving the old copy aside and renaming the new one in
    return f"restored {final.name} from {retired.name} (an interrupted save)"


def save_model_dir(model, tokenizer, target: str | Path, keep_existing: bool = False) -> Path:
    """Save an HF model directory atomically: a complete new one replaces the old one, or nothing changes.

    keep_existing: a directory already at `target` wins (a cache another process may be reading)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if keep_existing:
            try:
                os.replace(tmp, target)
            except OSError:
                if not target.exists():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # another process's directory is already in place
            return target
        publish_dir(tmp, target)
    except BaseException as err:
        full = disk_full_reason(err, target, state_bytes(model)) if isinstance(err, Exception) else None
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(f"{full}; nothing at {target} was changed") from err
        raise
    return target


def read_jsonl(path: str | Path, tolerant: bool = False) -> list[dict]:
    """The rows of a JSONL file ([] when it does not exist). `tolerant` skips lines that do not parse
    (the last line of a job killed while writing it) and unreadable files, for readers such as the
    report that must show whatever a run left."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    try:
        with path.open() as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    if not tolerant:
                        raise
    except OSError:
        if not tolerant:
            raise
    return rows


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
