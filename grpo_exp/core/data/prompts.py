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


def prompt_messages(example: dict, system_prompt: str) -> list[dict]:
    """The chat prompt of a problem: a prompts-stage row's own prompt (text becomes the user message, as a question
    does; messages are kept as they are) with `system_prompt` first where it holds no system message, else its
    question as `to_messages` makes it."""
    prompt = example.get("prompt")
    if prompt is None:
        return to_messages(example["question"], system_prompt)
    if isinstance(prompt, str):
        return to_messages(prompt, system_prompt)
    messages = [dict(m) for m in prompt]
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
