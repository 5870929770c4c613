"""Rows of a JSONL training file: `{"text": ...}` or `{"messages": [...]}` (chat turns with roles; a turn's content
is a string or OpenAI's list of text and image parts, api/chat_content.py). Torch-free: the control plane checks
uploaded files with these rules and the driver checks every job's files with the same ones."""

from __future__ import annotations

import json
from collections.abc import Callable

from moetune.api.chat_content import content_problem

CHAT_ROLES = ("system", "user", "assistant", "tool")


class RowError(ValueError):
    """Row `number` (1-based line number) of a JSONL text is not a valid row; `problem` says why."""

    def __init__(self, number: int, problem: str):
        super().__init__(f"row {number}: {problem}")
        self.number, self.problem = number, problem


def row_problem(row) -> str | None:
    """What is wrong with one parsed row, or None."""
    if not isinstance(row, dict):
        return "must be a JSON object"
    has_text, has_messages = "text" in row, "messages" in row
    if has_text == has_messages:
        return "must have exactly one of 'text' or 'messages'"
    if has_text:
        if not isinstance(row["text"], str) or not row["text"]:
            return "'text' must be a non-empty string"
        return None
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    for i, message in enumerate(messages):
        where = f"'messages[{i}]"
        if not isinstance(message, dict):
            return f"{where}' must be an object with 'role' and 'content'"
        if message.get("role") not in CHAT_ROLES:
            return f"{where}.role' must be one of {', '.join(CHAT_ROLES)}"
        if problem := content_problem(message.get("content"), where, message["role"]):
            return problem
    if not any(m["role"] == "assistant" for m in messages):
        return "'messages' must contain an assistant turn (nothing to train on otherwise)"
    return None


def parse_rows(text: str, extra_check: Callable[[dict], str | None] | None = None) -> list[dict]:
    """Every row of a JSONL text (blank lines skipped), checked by `row_problem` and then `extra_check`;
    RowError at the first bad one."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RowError(number, f"not valid JSON ({e.msg})") from None
        if problem := row_problem(row) or (extra_check and extra_check(row)):
            raise RowError(number, problem)
        rows.append(row)
    return rows
