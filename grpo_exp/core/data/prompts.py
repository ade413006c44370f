"""Chat-format prompts for the policy model."""

from __future__ import annotations

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step in a few short sentences, "
    "then finish with the line: The answer is <number>."
)


def to_messages(question: str, system_prompt: str) -> list[dict]:
    """System + user messages; an empty system prompt is left out entirely."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    return messages
