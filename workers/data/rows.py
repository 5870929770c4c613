"""Training data files: JSONL rows read and validated up front, each error naming the file and the row.

The row rules are api/data_rows.py's (the control plane checks uploaded files with them too); what a row trains on
is the training method's business (workers.methods). The driver also checks every image (workers/data/images.py);
workers read rows already checked.
"""

from __future__ import annotations

from moetune.api import storage
from collections.abc import Callable

from moetune.api.data_rows import RowError, parse_rows, row_problem
from moetune.workers.data.images import ImageCheck
from moetune.workers.errors import DatasetError


def load_rows(uri: str, param: str, images: ImageCheck | None = None,
              problem: Callable[[object], str | None] = row_problem) -> list[dict]:
    """Reads and validates every row of a JSONL file with `problem` (the training rows' rules unless told; with
    `images`, every image it names too); raises DatasetError naming file and row."""
    try:
        text = storage.read_text(uri)
    except FileNotFoundError:
        raise DatasetError(param, f"{param} {uri} does not exist") from None
    except UnicodeDecodeError:
        raise DatasetError(param, f"{param} {uri} is not UTF-8 text") from None
    except OSError as e:
        raise DatasetError(param, f"{param} {uri} cannot be read: {e}") from None
    try:
        rows = parse_rows(text, images.row_problem if images else None, problem)
    except RowError as e:
        raise DatasetError(param, f"{param} {uri} row {e.number}: {e.problem}") from None
    if not rows:
        raise DatasetError(param, f"{param} {uri} holds no rows")
    return rows
