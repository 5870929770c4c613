"""Training data files: JSONL rows read and validated up front, each error naming the file and the row.

A row is either `{"text": ...}` or `{"messages": [...]}` (chat turns with roles; a turn's content is a string or
OpenAI's list of text and image parts, api/chat_content.py); what a row trains on is the training method's business
(workers.methods). The driver also checks every image (workers/data/images.py); workers read rows already checked.
"""

from __future__ import annotations

import json

from moetune.api import storage
from moetune.api.chat_content import content_problem
from moetune.workers.data.images import ImageCheck
from moetune.workers.errors import DatasetError

CHAT_ROLES = ("system", "user", "assistant", "tool")


def _row_problem(row) -> str | None:
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


def load_rows(uri: str, param: str, images: ImageCheck | None = None) -> list[dict]:
    """Reads and validates every row of a JSONL file (and with `images`, every image it names); raises
    DatasetError naming file and row."""
    try:
        text = storage.read_text(uri)
    except FileNotFoundError:
        raise DatasetError(param, f"{param} {uri} does not exist") from None
    except UnicodeDecodeError:
        raise DatasetError(param, f"{param} {uri} is not UTF-8 text") from None
    except OSError as e:
        raise DatasetError(param, f"{param} {uri} cannot be read: {e}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(param, f"{param} {uri} row {number}: not valid JSON ({e.msg})") from None
        problem = _row_problem(row) or (images and images.row_problem(row))
        if problem:
            raise DatasetError(param, f"{param} {uri} row {number}: {problem}")
        rows.append(row)
    if not rows:
        raise DatasetError(param, f"{param} {uri} holds no rows")
    return rows
