"""Generated problems and their three partitions: train, validation and test, cut by canonical computation
(`split_of`), with held-out sets of distinct computations that keep each level's template mix.

The templates themselves are in `templates`.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from typing import Callable

from grpo_exp.base import log

from .templates import _TEMPLATES, LEVELS, Template

logger = log.get_logger(__name__)

_MAX_CONSECUTIVE_DUPLICATES = 10_000
# Draws in a row after which a template's held-out band counts as used up (no unused computation left).
_EXHAUSTED_AFTER = 3_000

SPLITS = ("train", "validation", "test")
# Shares of each level's computations held out for testing and for validation (`split_of`); the rest trains.
TEST_FRACTION = 0.25
VALIDATION_FRACTION = 0.25


def _templates(level: str) -> tuple[Template, ...]:
    try:
        return _TEMPLATES[level]
    except KeyError:
        raise ValueError(
            f"unknown level {level!r}; valid levels: {', '.join(LEVELS)}") from None


def canonical(expression: str) -> str:
    """The expression's structure with operands of + and * sorted: "3 + 4" and "4 + 3" give one key.

    Two problems with the same key ask for the same computation, whatever their wording, so a
    held-out split must not share a key with training (a model could have memorised the answer).
    Chains of one commutative operator are flattened first, so (a + b) + c equals a + (b + c).
    """
    import ast

    def key(node: ast.AST) -> str:
        if isinstance(node, ast.Expression):
            return key(node.body)
        if isinstance(node, ast.Constant):
            return repr(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return f"(neg {key(node.operand)})"
        if isinstance(node, ast.BinOp):
            op = type(node.op).__name__
            if isinstance(node.op, (ast.Add, ast.Mult)):
                terms: list[str] = []
                stack = [node.left, node.right]
                while stack:
                    term = stack.pop()
                    if isinstance(term, ast.BinOp) and type(term.op) is type(node.op):
                        stack.extend((term.left, term.right))
                    else:
                        terms.append(key(term))
                return f"({op} {' '.join(sorted(terms))})"
            return f"({op} {key(node.left)} {key(node.right)})"
        raise ValueError(f"unsupported expression {expression!r}")

    return key(ast.parse(expression, mode="eval"))


def band(key: str, seed: int) -> float:
    """The (seeded) position in [0, 1) of a canonical computation or a question; `split_of` cuts it into bands."""
    digest = hashlib.sha256(f"grpo-exp/split/{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(key: str, seed: int, test_fraction: float = TEST_FRACTION,
             validation_fraction: float = VALIDATION_FRACTION) -> str:
    """Which split a canonical computation belongs to: test below ``test_fraction``, validation in the next
    ``validation_fraction``, train above. The partition depends on the key and the seed only, so it is the
    same for every level: a computation held out at one level is never trained on at another.

    Hashing keys rather than sampling held-out problems first keeps the train share of every template's
    computations even where a template has few.
    """
    position = band(key, seed)
    if position < test_fraction:
        return "test"
    return "validation" if position < test_fraction + validation_fraction else "train"


def _problem(level: str, template: Template, rng: random.Random) -> dict:
    question, expression, answer = template(rng)
    return {"question": question, "answer": str(answer), "level": level, "expression": expression,
            "key": canonical(expression), "template": template.__name__.lstrip("_")}


def _sample_train(level: str, n: int, rng: random.Random, accept: Callable[[str], bool]) -> list[dict]:
    """``n`` problems with distinct questions whose canonical computation passes ``accept``; a
    computation may recur in other words (the model trains on it either way)."""
    templates = _templates(level)
    seen: set[str] = set()
    problems: list[dict] = []
    misses = 0
    while len(problems) < n:
        problem = _problem(level, rng.choice(templates), rng)
        if problem["question"] in seen or not accept(problem["key"]):
            misses += 1
            # Misses are common (the partition rejects most draws) but never this many in a row
            # until the space is nearly used up.
            if misses >= _MAX_CONSECUTIVE_DUPLICATES:
                raise ValueError(
                    f"could not generate {n} distinct {level!r} problems "
                    f"(got {len(problems)}); ask for fewer")
            continue
        misses = 0
        seen.add(problem["question"])
        problems.append(problem)
    return problems


def _sample_held_out(level: str, split: str, n: int, rng: random.Random,
                     accept: Callable[[str], bool]) -> list[dict]:
    """Up to ``n`` problems whose canonical computations are all different and pass ``accept``, with
    the level's templates in the proportions training draws them (a quota each).

    Where a template's band holds fewer distinct computations than its quota, every quota shrinks by the
    same factor, so the set keeps the level's mix at the size that exists, and a warning says so.
    """
    templates = _templates(level)
    weights = Counter(templates)  # a template listed twice is drawn twice as often
    quota = {t: n * w // len(templates) for t, w in weights.items()}
    for t in list(weights)[: n - sum(quota.values())]:
        quota[t] += 1
    drawn: dict[Template, list[dict]] = {t: [] for t in weights}
    misses = dict.fromkeys(weights, 0)
    keys: set[str] = set()
    open_templates = [t for t in weights if quota[t] > 0]
    while open_templates:
        template = rng.choice(open_templates)
        problem = _problem(level, template, rng)
        if problem["key"] in keys or not accept(problem["key"]):
            misses[template] += 1
            if misses[template] >= _EXHAUSTED_AFTER:
                open_templates.remove(template)  # its band holds no unused computation
            continue
        misses[template] = 0
        keys.add(problem["key"])
        drawn[template].append(problem)
        if len(drawn[template]) == quota[template]:
            open_templates.remove(template)
    scale = min((len(drawn[t]) / quota[t] for t in quota if quota[t]), default=1.0)
    if scale < 1:
        short = ", ".join(f"{t.__name__.lstrip('_')} {len(drawn[t])} of {quota[t]}"
                          for t in quota if len(drawn[t]) < quota[t])
        drawn = {t: rows[: int(quota[t] * scale)] for t, rows in drawn.items()}
        logger.warning(
            "%s %s: %d problems instead of %d, to keep the level's mix with distinct computations (%s)",
            level, split, sum(map(len, drawn.values())), n, short)
    problems = [p for rows in drawn.values() for p in rows]
    rng.shuffle(problems)  # a prefix (eval.limit) keeps the mix too
    return problems


def generate(level: str, n: int, seed: int) -> list[dict]:
    """``n`` distinct problems of ``level``; the same (level, n, seed) gives the same list."""
    return _sample_train(level, n, random.Random(seed), lambda key: True)


def sample_stream(split: str, seed: int, sample_seed: int | None) -> int:
    """The seed of a split's draws: the split seed for held-out sets, the training seed (where given) for training."""
    return seed if split != "train" or sample_seed is None else sample_seed


def generate_split(level: str, split: str, n: int, seed: int, test_fraction: float = TEST_FRACTION,
                   validation_fraction: float = VALIDATION_FRACTION, sample_seed: int | None = None) -> list[dict]:
    """``n`` problems of one split of ``level``; the three splits share no canonical computation.

    ``seed`` (the split seed, `stage.split_seed`) draws the bands and the held-out sets; ``sample_seed``
    (the training seed; default ``seed``) draws which training problems of the train band are used, so
    runs of different training seeds score the same validation and test problems.

    Training problems have distinct questions; validation and test problems have distinct computations,
    each set sized to what its band holds (`_sample_held_out`). Each split has its own seeded random
    stream, so none depends on another's size.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError(f"number of problems must be >= 0, got {n}")
    _templates(level)  # an unknown level fails before any drawing
    rng = random.Random(f"grpo-exp/{level}/{split}/{sample_stream(split, seed, sample_seed)}")  # salted string seeds: independent streams

    def accept(key: str) -> bool:
        return split_of(key, seed, test_fraction, validation_fraction) == split

    if split == "train":
        return _sample_train(level, n, rng, accept)
    return _sample_held_out(level, split, n, rng, accept)
