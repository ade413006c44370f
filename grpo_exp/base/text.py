"""One-line renderings of errors and user data: every message grpo-exp prints for bad input, a failed
plugin or a broken file stays on one line, whatever the library or the data put in it."""

from __future__ import annotations

import difflib
import re


def one_line(text: object, limit: int = 200) -> str:
    """`text` with its whitespace folded, cut to `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_line(err: BaseException, chain: bool = False) -> str:
    """"Type: first line" of an exception; with `chain`, the first lines of it and its causes, joined
    by ": " (Hydra wraps the useful message several levels deep)."""
    if not chain:
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[0] if text else ''}"
    parts: list[str] = []
    while err is not None:
        text = str(err).strip().splitlines()
        # OmegaConf chains its own unfilled message template ("Value '$VALUE' of type '$VALUE_TYPE' ...")
        # under the filled one: it says nothing the user can act on
        if text and text[0] not in parts and not _TEMPLATE.search(text[0]):
            parts.append(text[0])
        err = err.__cause__ or err.__context__
    return ": ".join(parts)


_TEMPLATE = re.compile(r"\$(VALUE|VALUE_TYPE|KEY|FULL_KEY|OBJECT_TYPE|REF_TYPE|MSG)\b")


def did_you_mean(word: str, choices) -> str:
    """" (did you mean 'x'?)" for the choice closest to a misspelt `word`, or "" when none is close."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def markdown_table(header: list[str], rows: list[list[object]], align: str = "") -> str:
    """A Markdown table; `align` gives one character per column ("l" or "r", default left)."""
    marks = ["---:" if (align[i:i + 1] == "r") else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)
