"""The project logger. Modules log through `get_logger(__name__)` (children of "grpo_exp"), and the
entrypoints set its level from `log_level` (e.g. `log_level=WARNING` to quiet a run, `DEBUG` for more).
Under Hydra the records go through Hydra's job logging (console and <run dir>/<task>.log); outside it
a plain stderr handler prints them as "[grpo-exp] message"."""

from __future__ import annotations

import logging

ROOT = "grpo_exp"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def get_logger(name: str = ROOT) -> logging.Logger:
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")


def set_level(level: str) -> None:
    """Level of every grpo_exp logger; adds a stderr handler where nothing else handles the records."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(level.upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[grpo-exp] %(message)s"))
        logger.addHandler(handler)
