"""Rows of a JSONL training file: `{"text": ...}` or `{"messages": [...]}` (chat turns with roles; a turn's content
is a string or OpenAI's list of text and image parts, api/chat_content.py) for supervised jobs, and OpenAI's
preference rows `{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]}` for
dpo jobs. Torch-free: the control plane checks uploaded files with these rules (a fine-tune file may hold either
kind) and the driver checks every job's files with its method's (`training_row_problem`)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from moetune.api.chat_content import content_problem, has_images

CHAT_ROLES = ("system", "user", "assistant", "tool")


class RowError(ValueError):
    """Row `number` (1-based line number) of a JSONL text is not a valid row; `problem` says why."""

    def __init__(self, number: int, problem: str):
        super().__init__(f"row {number}: {problem}")
        self.number, self.problem = number, problem


PREFERENCE_FIELDS = ("input", "preferred_output", "non_preferred_output")


def row_problem(row) -> str | None:
    """What is wrong with one parsed row of a fine-tune file (either kind: the upload does not know the method), or
    None."""
    if isinstance(row, dict) and any(field in row for field in PREFERENCE_FIELDS):
        return preference_row_problem(row)
    return supervised_row_problem(row)


def training_row_problem(method_type: str) -> Callable[[object], str | None]:
    """The rules of a job's training and validation rows, by its method.type."""
    return preference_row_problem if method_type == "dpo" else supervised_row_problem


def supervised_row_problem(row) -> str | None:
    """What is wrong with one parsed row of a supervised job, or None."""
    if not isinstance(row, dict):
        return "must be a JSON object"
    has_text, has_messages = "text" in row, "messages" in row
    if has_text == has_messages:
        hint = " (a preference row trains with method.type 'dpo')" if any(f in row for f in PREFERENCE_FIELDS) else ""
        return "must have exactly one of 'text' or 'messages'" + hint
    if has_text:
        if not isinstance(row["text"], str) or not row["text"]:
            return "'text' must be a non-empty string"
        return None
    if problem := messages_problem(row["messages"]):
        return problem
    if not any(m["role"] == "assistant" for m in row["messages"]):
        return "'messages' must contain an assistant turn (nothing to train on otherwise)"
    return None


def preference_row_problem(row) -> str | None:
    """What is wrong with one parsed row of a dpo job, or None: the prompt's turns in `input.messages`, and one or
    more assistant turns in each of `preferred_output` and `non_preferred_output`, all text (no image parts)."""
    if not isinstance(row, dict) or not all(field in row for field in PREFERENCE_FIELDS):
        return ("a dpo job's rows must have 'input', 'preferred_output' and 'non_preferred_output' "
                '({"input": {"messages": [...]}, "preferred_output": [{"role": "assistant", ...}], ...})')
    if not isinstance(row["input"], dict):
        return "'input' must be an object with 'messages'"
    for field, turns in (("input.messages", row["input"].get("messages")), ("preferred_output",
                         row["preferred_output"]), ("non_preferred_output", row["non_preferred_output"])):
        if problem := messages_problem(turns, field):
            return problem
        for i, turn in enumerate(turns):
            if has_images(turn["content"]):
                return f"'{field}[{i}].content' has an image part; preference rows are text only"
            if field != "input.messages" and turn["role"] != "assistant":
                return f"'{field}[{i}].role' must be 'assistant' (the answer the prompt gets)"
    return None


def messages_problem(messages, field: str = "messages") -> str | None:
    """What is wrong with a list of chat turns (training, preference and evaluation rows alike) found at `field`,
    or None."""
    if not isinstance(messages, list) or not messages:
        return f"'{field}' must be a non-empty list"
    for i, message in enumerate(messages):
        where = f"'{field}[{i}]"
        if not isinstance(message, dict):
            return f"{where}' must be an object with 'role' and 'content'"
        if message.get("role") not in CHAT_ROLES:
            return f"{where}.role' must be one of {', '.join(CHAT_ROLES)}"
        if problem := content_problem(message.get("content"), where, message["role"]):
            return problem
    return None


def evaluation_row_problem(row, metrics=()) -> str | None:
    """What is wrong with one row of an evaluation file (`{"messages": [...], "reference": "..."}`, or messages
    ending with the assistant's answer), or None; with the "regex" metric the reference must compile."""
    if not isinstance(row, dict) or "messages" not in row:
        return 'expected {"messages": [...], "reference": "..."}'
    if problem := messages_problem(row["messages"]):
        return problem
    if texts := [i for i, m in enumerate(row["messages"]) if not isinstance(m["content"], str)]:
        return f"'messages[{texts[0]}].content' must be a string (evaluation prompts are text)"
    if "reference" in row and not isinstance(row["reference"], str):
        return "'reference' must be a string"
    if "reference" not in row and (row["messages"][-1]["role"] != "assistant" or len(row["messages"]) < 2):
        return "no reference: give 'reference' or end the messages with the assistant's answer"
    if "regex" in metrics:
        try:
            re.compile(evaluation_turns(row)[1])
        except re.error as e:
            return f"the reference is the regex metric's pattern: not a regular expression ({e})"
    return None


def evaluation_turns(row: dict) -> tuple[list[dict], str]:
    """An evaluation row's prompt (its messages without the answer) and its reference."""
    if "reference" in row:
        return row["messages"], row["reference"]
    return row["messages"][:-1], row["messages"][-1]["content"]


def parse_rows(text: str, extra_check: Callable[[dict], str | None] | None = None,
               problem: Callable[[object], str | None] = row_problem) -> list[dict]:
    """Every row of a JSONL text (blank lines skipped), checked by `problem` (the training rows' rules unless told)
    and then `extra_check`; RowError at the first bad one."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RowError(number, f"not valid JSON ({e.msg})") from None
        if found := problem(row) or (extra_check and extra_check(row)):
            raise RowError(number, found)
        rows.append(row)
    return rows
