"""The one-line checks every config group's `check` is written with: each failure a ConfigError naming the key,
the bad value and what would be valid."""

from __future__ import annotations

from typing import Any

from grpo_exp.base.errors import ConfigError


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def require_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    require(value in choices, f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}")


def require_positive(group: str, node: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(node, key)
        require(value >= 1, f"{group}.{key}={value} must be a positive integer")
