"""Reward functions for GRPO on numeric-answer math tasks, registered by name (open-r1 style).

Every reward has TRL's signature ``fn(completions, answer, **kwargs) -> list[float]`` and returns
exactly one float per completion, whatever the completion holds. `reward.funcs` names registered rewards
or a user's own by import path (``my_package.my_module:fn``), checked when the config is (before any model
loads): the module imports, the name is a function, and it takes TRL's keyword arguments.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from grpo_exp.base.errors import ConfigError

# Tags of Unsloth's Qwen3 GRPO notebook; the notebook prepends REASONING_START in the prompt, so
# completions usually begin mid-reasoning.
REASONING_START = "<start_working_out>"
REASONING_END = "<end_working_out>"
SOLUTION_START = "<SOLUTION>"
SOLUTION_END = "</SOLUTION>"

# Models emit typographic minus signs; normalising them keeps "−7" from parsing as 7.
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})

# The minus must not follow a word character so "5-3" and "step-2" do not yield negative numbers.
# Thousands groups need the (?!\d) guard, otherwise "1,2345" would read as 1234.
_NUMBER = (
    r"(?:(?<![\w.])(?P<neg1>-))?[$€£]?\s*(?:(?<![\w.])(?P<neg2>-))?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])\.\d+)"
    r"(?:/(?P<den>\d+(?:\.\d+)?)(?![\d/]))?"
)
_NUMBER_RE = re.compile(_NUMBER)

_SOLUTION_RE = re.compile(
    re.escape(SOLUTION_START) + r"(.*?)" + re.escape(SOLUTION_END), re.IGNORECASE | re.DOTALL
)
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")
# One level of nested braces covers \boxed{\frac{3}{4}}, the deepest form seen in practice.
_BOXED_RE = re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}")
_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
# "answer is" also covers "the answer is" and "final answer is"; the filler admits markdown bold,
# a colon and a TeX dollar between the phrase and the number.
_ANSWER_PHRASE_RE = re.compile(
    r"\banswer\s*(?:is\b\s*:?|:)[\s:*$(\\]*" + _NUMBER, re.IGNORECASE
)

# Mirrors the notebook's match_format, but anchored with \Z instead of MULTILINE's "$" so that
# trailing text after a newline does not count as the exact format.
_COOKBOOK_FORMAT_RE = re.compile(
    r"\s*(?:" + re.escape(REASONING_START) + r")?.*?" + re.escape(REASONING_END) + r".*?"
    + re.escape(SOLUTION_START) + r"(.+?)" + re.escape(SOLUTION_END) + r"\s*",
    re.DOTALL,
)
_COOKBOOK_NUMBER_RE = re.compile(re.escape(SOLUTION_START) + r"\s*([-\u2212\d\.,]+)")

_EQUATION_RE = re.compile(r"\d\s*[-+*/×÷x^]\s*\(?\s*[$€£]?\d[^=\n]*?=\s*[$€£]?\s*-?\d")
_STEP_WORD_RE = re.compile(r"\b(?:first|then|so|therefore|step)\b", re.IGNORECASE)


def _number_value(match: re.Match[str]) -> float | None:
    value = float(match.group("num").replace(",", ""))
    den = match.group("den")
    if den is not None:
        den_value = float(den)
        if den_value == 0:
            return None
        value /= den_value
    if match.group("neg1") or match.group("neg2"):
        value = -value
    return value


def parse_number(text: str) -> float | None:
    """Parse the first number in ``text``: "$1,234.50", "−7", "45%", "3/4", "12 apples"."""
    if not text:
        return None
    match = _NUMBER_RE.search(str(text).translate(_MINUS_SIGNS))
    return _number_value(match) if match else None


def _last_number(text: str) -> float | None:
    matches = list(_NUMBER_RE.finditer(text))
    return _number_value(matches[-1]) if matches else None


def _solution_number(text: str) -> float | None:
    # The last tag wins because models sometimes draft a solution before restating the final one.
    for match in reversed(list(_SOLUTION_RE.finditer(text))):
        value = parse_number(match.group(1))
        if value is not None:
            return value
    return None


def _phrase_number(text: str) -> float | None:
    matches = list(_ANSWER_PHRASE_RE.finditer(text))
    return _number_value(matches[-1]) if matches else None


def extract_answer(text: str) -> float | None:
    """The final numeric answer of a completion, or None when it holds no number.

    Priority: <SOLUTION>n</SOLUTION>, "#### n", \\boxed{n}, the last "the answer is n" /
    "answer: n", then the last number anywhere.
    """
    if not text:
        return None
    text = str(text).translate(_MINUS_SIGNS)
    value = _solution_number(text)
    if value is not None:
        return value
    for match in reversed(list(_HASHES_RE.finditer(text))):
        value = parse_number(match.group(1))
        if value is not None:
            return value
    for match in reversed(list(_BOXED_RE.finditer(text))):
        content = _LATEX_FRAC_RE.sub(r"\1/\2", match.group(1)).replace("\\,", "").replace("\\!", "")
        value = parse_number(content.replace(" ", ""))
        if value is not None:
            return value
    value = _phrase_number(text)
    if value is not None:
        return value
    return _last_number(text)


def answers_match(pred: float | None, truth: float | str) -> bool:
    """Numeric equality within 1e-6 (relative or absolute); False when either side is missing."""
    if pred is None:
        return False
    truth_value = parse_number(truth) if isinstance(truth, str) else truth
    if truth_value is None:
        return False
    try:
        return math.isclose(float(pred), float(truth_value), rel_tol=1e-6, abs_tol=1e-6)
    except (TypeError, ValueError):
        return False


def _message_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # Multimodal chat messages carry a list of typed parts; only text parts matter here.
    if isinstance(content, list):
        return "".join(
            part.get("text") or "" if isinstance(part, dict) else str(part) for part in content
        )
    return str(content)


def completion_text(completion: Any) -> str:
    """The assistant text of a completion given as a string or as a list of chat messages."""
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    # Newline-joined so numbers at message boundaries ("12", "5") cannot fuse into "125".
    return "\n".join(
        _message_content(message.get("content"))
        for message in completion
        if isinstance(message, dict) and message.get("role", "assistant") == "assistant"
    )


def _texts(completions: Sequence[Any]) -> list[str]:
    return [completion_text(c) for c in completions]


def _checked_answers(completions: Sequence[Any], answer: Sequence[Any] | None, name: str) -> list[Any]:
    # zip() would silently truncate and TRL would then fail with a less specific length error.
    if answer is None:
        raise ValueError(f"reward '{name}' needs the dataset's 'answer' column, which was not passed")
    answers = list(answer)
    if len(answers) != len(completions):
        raise ValueError(
            f"reward '{name}' got {len(completions)} completions but {len(answers)} answers"
        )
    return answers


def correctness(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the extracted final answer equals the ground truth numerically, else 0.0."""
    answers = _checked_answers(completions, answer, "correctness")
    return [
        1.0 if answers_match(extract_answer(text), truth) else 0.0
        for text, truth in zip(_texts(completions), answers)
    ]


def answer_format(completions: list, answer: list[str] | None = None, **kwargs: Any) -> list[float]:
    """1.0 when the completion states "The answer is <number>" or <SOLUTION>n</SOLUTION>, else 0.0."""
    scores = []
    for text in _texts(completions):
        text = text.translate(_MINUS_SIGNS)
        stated = _phrase_number(text) is not None or _solution_number(text) is not None
        scores.append(1.0 if stated else 0.0)
    return scores


def stated_correctness(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion states its answer in the asked format (`answer_format`) and that answer is right.

    Correctness and format in one reward: a group where every answer is wrong scores all zeros and so has no advantage
    to scale, whereas a separate format bonus is blown up to unit size in such groups by std scaling (docs/log.md,
    "2026-11-27 — no recipe of five learns two_step"); and a right number buried in text after the answer line does
    not count.
    """
    answers = _checked_answers(completions, answer, "stated_correctness")
    return [right * stated for right, stated in zip(correctness(completions, answers), answer_format(completions))]


def cookbook_format_exact(
    completions: list, answer: list[str] | None = None, **kwargs: Any
) -> list[float]:
    """3.0 when the completion is reasoning, REASONING_END, then <SOLUTION>...</SOLUTION> and nothing else."""
    return [3.0 if _COOKBOOK_FORMAT_RE.fullmatch(text) else 0.0 for text in _texts(completions)]


def cookbook_format_approx(
    completions: list, answer: list[str] | None = None, **kwargs: Any
) -> list[float]:
    """+0.5 per tag (REASONING_END, SOLUTION_START, SOLUTION_END) present exactly once, -0.5 otherwise."""
    # REASONING_START is not scored: the notebook puts it in the prompt, so it is rarely generated.
    tags = (REASONING_END, SOLUTION_START, SOLUTION_END)
    return [
        sum(0.5 if text.count(tag) == 1 else -0.5 for tag in tags) for text in _texts(completions)
    ]


def _cookbook_answer_score(text: str, truth: Any) -> float:
    match = _COOKBOOK_FORMAT_RE.fullmatch(text)
    if match is None:
        return 0.0
    guess = match.group(1).strip()
    truth_text = str(truth).strip()
    if guess == truth_text:
        return 3.0
    guess_value = parse_number(guess)
    truth_value = parse_number(truth_text)
    if guess_value is None or truth_value is None:
        return -0.5
    if truth_value == 0:
        # A ratio against zero is undefined; only an exact numeric hit earns the near-miss tier.
        return 1.5 if guess_value == 0 else -0.5
    ratio = guess_value / truth_value
    if 0.9 <= ratio <= 1.1:
        return 1.5
    if 0.8 <= ratio <= 1.2:
        return 0.5
    return -0.5


def cookbook_answer(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """Notebook-style graded answer: 3.0 exact string, 1.5 within 10%, 0.5 within 20%, else -0.5.

    The answer is read only from a completion in the exact cookbook format; without it the
    reward is 0.0, leaving the format penalty to the format rewards.
    """
    answers = _checked_answers(completions, answer, "cookbook_answer")
    return [_cookbook_answer_score(text, truth) for text, truth in zip(_texts(completions), answers)]


def _cookbook_numbers_score(text: str, truth: Any) -> float:
    match = _COOKBOOK_NUMBER_RE.search(text)
    if match is None:
        return 0.0
    guess = parse_number(match.group(1))
    if guess is None:
        return 0.0
    return 1.5 if answers_match(guess, str(truth)) else -0.5


def cookbook_numbers(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.5 when the first number after <SOLUTION> equals the truth, -0.5 when it differs, 0.0 when absent."""
    answers = _checked_answers(completions, answer, "cookbook_numbers")
    return [_cookbook_numbers_score(text, truth) for text, truth in zip(_texts(completions), answers)]


def _reasoning_score(text: str) -> float:
    if not text.strip():
        return 0.0
    equations = _EQUATION_RE.findall(text)
    signs = [
        len(equations) >= 1,
        # A chain of computations is a distinct, stronger sign than a single equation.
        len(equations) >= 2,
        _STEP_WORD_RE.search(text) is not None,
        sum(1 for line in text.splitlines() if line.strip()) >= 2,
    ]
    return min(1.0, 0.25 * sum(signs))


def heuristic_reasoning(
    completions: list, answer: list[str] | None = None, **kwargs: Any
) -> list[float]:
    """Heuristic shaping reward, not a measure of correctness: 0.25 per sign of worked reasoning.

    Signs: an arithmetic equation ("12 + 5 = 17"), a second such equation, a step word ("first",
    "then", "so", "therefore", "step"), and at least two non-empty lines; capped at 1.0, 0.0 for
    an empty completion. Surface cues are easy to game, so never report it as accuracy.
    """
    return [_reasoning_score(text) for text in _texts(completions)]


REGISTRY: dict[str, Callable[..., list[float]]] = {
    fn.__name__: fn
    for fn in (
        correctness,
        answer_format,
        stated_correctness,
        cookbook_format_exact,
        cookbook_format_approx,
        cookbook_answer,
        cookbook_numbers,
        heuristic_reasoning,
    )
}


class RewardConfigError(ConfigError):
    """reward.funcs or reward.weights is invalid; the message names the bad value and the valid ones."""


SIGNATURE = "fn(completions, **kwargs) returning one float per completion"


def _signature_problem(fn: Callable) -> str | None:
    """Why TRL could not call `fn` as it calls a reward (keywords only: prompts, completions, completion_ids,
    trainer_state and the dataset's columns), or None."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: TRL may still call it
        return None
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return "it takes no **kwargs, and TRL passes prompts, completion_ids and the dataset's columns as well"
    required = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if required:
        return f"its positional-only parameter {required[0]} cannot be given, as TRL passes keywords only"
    if not any(p.name == "completions" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return "it has no completions parameter"
    return None


def import_path(entry: str, key: str = "reward.funcs") -> Callable[..., list[float]]:
    """The reward at `package.module:function` (a dotted attribute after the colon also works); errors name `key`,
    the setting that holds it."""
    label = f"{key} entry" if key == "reward.funcs" else key
    module_name, _, attr = entry.partition(":")
    if not all(part.isidentifier() for part in [*module_name.split("."), *attr.split(".")]):
        raise RewardConfigError(f"{label} '{entry}' is not an import path of the form "
                                "package.module:function")
    try:
        found: Any = importlib.import_module(module_name)
    except Exception as err:  # not found, or the module's own code failed on import
        why = " ".join(str(err).split())  # one line, whatever the module raised
        raise RewardConfigError(f"{label} '{entry}': importing {module_name} failed "
                                f"({type(err).__name__}: {why}); the module must be on the Python path (the current "
                                "directory is, for python -m grpo_exp.train)") from None
    for part in attr.split("."):
        if not hasattr(found, part):
            raise RewardConfigError(f"{label} '{entry}': {module_name} has no {attr}")
        found = getattr(found, part)
    if not callable(found):
        raise RewardConfigError(f"{label} '{entry}' is a {type(found).__name__}, not a function; "
                                f"a reward is {SIGNATURE}")
    problem = _signature_problem(found)
    if problem:
        raise RewardConfigError(f"{label} '{entry}' cannot be a reward: {problem}; a reward is {SIGNATURE}")
    return found


def resolve(name: str, key: str = "reward.funcs") -> Callable[..., list[float]]:
    """A reward by registered name, or by import path when the name holds a colon; `key` is the setting named in
    an error (reward.funcs, stage.eval_reward)."""
    if ":" in name:
        return import_path(name, key)
    if name not in REGISTRY:
        raise RewardConfigError(f"unknown reward function '{name}' in {key}; valid names: "
                                f"{', '.join(sorted(REGISTRY))}, or an import path package.module:function")
    return REGISTRY[name]


def build(
    funcs: Sequence[str], weights: Sequence[float] | None
) -> tuple[list[Callable[..., list[float]]], list[float]]:
    """Resolve reward names to functions and validate their weights (None means all 1.0)."""
    valid = ", ".join(sorted(REGISTRY))
    if isinstance(funcs, str):
        funcs = [funcs]
    names = list(funcs) if funcs is not None else []
    if not names:
        raise RewardConfigError(f"reward.funcs is empty; choose at least one of: {valid}")
    functions = [resolve(str(name)) for name in names]
    # TRL logs rewards/<name>/mean per function, so a repeated name would merge two metrics.
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RewardConfigError(
            f"reward.funcs lists {', '.join(duplicates)} more than once; give each function once "
            "and scale it with reward.weights"
        )
    logged = [getattr(fn, "__name__", type(fn).__name__) for fn in functions]
    clashes = sorted({n for n in logged if logged.count(n) > 1})
    if clashes:
        entries = ", ".join(str(n) for n, f in zip(names, logged) if f == clashes[0])
        raise RewardConfigError(f"reward.funcs holds two functions named {clashes[0]} ({entries}), which TRL would "
                                "log as one rewards/<name>/mean; rename one")
    if weights is None:
        resolved = [1.0] * len(names)
    else:
        raw = list(weights)
        if len(raw) != len(names):
            raise RewardConfigError(
                f"reward.weights has {len(raw)} entries but reward.funcs has {len(names)} "
                f"({', '.join(names)}); give one weight per function or leave weights null"
            )
        resolved = []
        for name, weight in zip(names, raw):
            try:
                value = float(weight)
            except (TypeError, ValueError):
                raise RewardConfigError(
                    f"reward.weights entry {weight!r} for '{name}' is not a number"
                ) from None
            if not math.isfinite(value):
                raise RewardConfigError(
                    f"reward.weights entry {weight!r} for '{name}' must be a finite number"
                )
            resolved.append(value)
    return functions, resolved
