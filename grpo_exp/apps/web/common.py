"""What more than one part of the web app uses: the refusal prefix, the bad-input exit code, and the
small formatting helpers (a code span, rounded figures, a file's modification time)."""

from __future__ import annotations

from pathlib import Path

EXIT_BAD_INPUT = 2  # the app's own exit code for bad input, and the trainer's (apps/task)
REFUSED = "refused: "  # how a refusal starts, in the Launch tab and the /launch API


def verbatim(text: str) -> str:
    """`text` as Markdown shows it letter for letter (a code span): a refusal quotes overrides such as
    `+hydra.callbacks.x._target_=...`, whose underscores Markdown would read as emphasis."""
    return f"`` {text} ``"


def rounded(df):
    """Floats to 4 significant digits for reading (5.710170178500448 -> 5.71); the files keep every digit."""
    def short(value):
        return float(f"{value:.4g}") if isinstance(value, float) else value

    return df.apply(lambda col: col.map(short)) if len(df) else df


def mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
