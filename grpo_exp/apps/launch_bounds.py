"""The most a run started from the web app may ask of this machine, in one table: steps, checkpoints kept,
curriculum stages, the tiny model's sizes, tokens per completion, sample counts; and the app's own limits
(the override box, the Playground's new tokens, Gradio's upload size).

Whoever reaches the page starts processes as the app's user, so a value that would fill the disk (a checkpoint
every step, none deleted), hold the cores for days or build a model larger than memory is refused with one line
before anything starts. The command line has none of these bounds. docs/app.md lists them (a test reads both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_OVERRIDE_BYTES = 10_000  # the override box, refused before it is split or composed
MAX_OVERRIDE_ITEMS = 200
PLAYGROUND_MAX_NEW_TOKENS = 1024
MAX_QUESTION_CHARS = 4000  # the Playground's question box
MAX_FILE_SIZE = "1mb"  # Gradio's upload route: the page has no upload control, so nothing needs more


@dataclass(frozen=True)
class Bound:
    """`key` must lie in [low, high]; a list is bounded item by item, and its length by `max_items`. `null_ok`:
    null is accepted (it means a default that is itself bounded, or off)."""

    key: str
    low: int
    high: int
    why: str
    null_ok: bool = True
    max_items: int | None = None


TOKENS = "new tokens per completion"
SAMPLES = "completions per step"
PROBLEMS = "held-out problems scored"

BOUNDS: tuple[Bound, ...] = (
    Bound("train.max_steps", 1, 5000, "optimizer steps per stage"),
    # save_total_limit=null keeps every checkpoint: a run saving every step fills the disk
    Bound("train.save_total_limit", 1, 5, "checkpoints kept per stage", null_ok=False),
    Bound("curriculum.stages", 0, 0, "stages of a curriculum", max_items=8),
    Bound("model.tiny_layers", 1, 16, "layers of the tiny model"),
    Bound("model.tiny_hidden", 8, 1024, "hidden size of the tiny model"),
    Bound("model.tiny_heads", 1, 32, "attention heads of the tiny model"),
    Bound("model.tiny_kv_heads", 1, 32, "key/value heads of the tiny model"),
    Bound("model.tiny_intermediate", 8, 4096, "MLP size of the tiny model"),
    Bound("train.max_completion_length", 1, 2048, TOKENS),
    Bound("eval.max_new_tokens", 1, 2048, TOKENS),
    Bound("ewc.fisher_max_new_tokens", 1, 2048, TOKENS),
    Bound("train.num_generations", 1, 64, SAMPLES),
    Bound("train.per_device_train_batch_size", 1, 256, SAMPLES),
    Bound("train.generation_batch_size", 1, 1024, SAMPLES),
    Bound("train.gradient_accumulation_steps", 1, 64, SAMPLES),
    Bound("train.steps_per_generation", 1, 64, SAMPLES),
    Bound("train.num_iterations", 1, 16, "passes over each generation round"),
    Bound("train.dynamic_sampling_max_draws", 1, 16, "extra generation rounds per step"),
    Bound("eval.limit", 1, 2000, PROBLEMS),
    Bound("eval.every_limit", 1, 2000, PROBLEMS),
    Bound("curriculum.eval_limit", 1, 2000, PROBLEMS),
    Bound("eval.num_samples", 1, 64, "samples per held-out problem"),
    Bound("eval.pass_k", 1, 64, "samples per held-out problem", max_items=8),
    Bound("eval.maj_k", 1, 64, "samples per held-out problem", max_items=8),
    Bound("eval.batch_size", 1, 256, "prompts per evaluation batch"),
    Bound("curriculum.eval_batch_size", 1, 256, "prompts per evaluation batch"),
    Bound("ewc.fisher_samples", 1, 2000, "problems the Fisher information is estimated on"),
    Bound("ewc.fisher_batch_size", 1, 256, "prompts per Fisher batch"),
    Bound("stage.num_train", 0, 100_000, "training problems (0: the whole split)"),
    Bound("stage.num_validation", 1, 5000, "validation problems"),
    Bound("stage.num_test", 1, 5000, "test problems"),
)


def _number(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def violation(bound: Bound, value: Any) -> str | None:
    """Why `value` breaks `bound`, in one line, or None."""
    span = f"{bound.low}-{bound.high}"
    if value is None:
        return None if bound.null_ok else f"{bound.key}=null is not offered by the app ({bound.why}: {span})"
    if isinstance(value, (list, tuple)):
        if bound.max_items is not None and len(value) > bound.max_items:
            return f"{bound.key} has {len(value)} items; the app takes at most {bound.max_items} ({bound.why})"
        if bound.high == 0:  # a list bounded by its length only
            return None
        for item in value:
            if _number(item) and not bound.low <= item <= bound.high:
                return f"{bound.key} holds {item}; the app takes {span} ({bound.why})"
        return None
    if _number(value) and not bound.low <= value <= bound.high:
        return f"{bound.key}={value} is outside what the app offers: {span} ({bound.why})"
    return None


def check(cfg) -> str | None:
    """The first bound the composed config breaks, as one line, or None."""
    from omegaconf import OmegaConf

    for bound in BOUNDS:
        value = OmegaConf.select(cfg, bound.key)
        if value is not None and OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        why = violation(bound, value)
        if why:
            return why
    return None


def request_size(text: str) -> str | None:
    """Why the override box's text is too big to look at, or None (checked before splitting: a huge box would
    hold the compose lock and the cores)."""
    size = len((text or "").encode("utf-8", errors="replace"))
    if size > MAX_OVERRIDE_BYTES:
        return f"the overrides are {size} bytes; the app takes at most {MAX_OVERRIDE_BYTES}"
    return None


def item_count(items: list[str]) -> str | None:
    if len(items) > MAX_OVERRIDE_ITEMS:
        return f"{len(items)} overrides; the app takes at most {MAX_OVERRIDE_ITEMS}"
    return None


def markdown_rows() -> list[str]:
    """The bounds as the rows of docs/app.md's table (a test holds the page to them)."""
    rows = []
    for bound in BOUNDS:
        if bound.high == 0:
            allowed = f"at most {bound.max_items} items"
        else:
            allowed = f"{bound.low}-{bound.high}"
            if bound.max_items:
                allowed = f"at most {bound.max_items} items, each {allowed}"
            if not bound.null_ok:
                allowed += ", not null"
        rows.append(f"| `{bound.key}` | {allowed} ({bound.why}) |")
    return rows
