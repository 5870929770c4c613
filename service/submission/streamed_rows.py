"""A JSONL file checked piece by piece as it arrives (an upload streamed to storage), by the same rules and with
the same row numbers as api/data_rows.parse_rows over the whole text: only the unfinished last line is held, so
memory does not grow with the file, and the first bytes that are not UTF-8 are refused as soon as they arrive."""

from __future__ import annotations

import codecs
from collections.abc import Callable

from moetune.api.data_rows import RowError, parse_rows, row_problem

MAX_ROW_CHARS = 64 * 2**20  # one row's text (inline images included); a longer one is refused rather than held


class NotUtf8(ValueError):
    def __init__(self, line: int):
        super().__init__(f"row {line} is not UTF-8 text")
        self.line = line


class StreamedRows:
    """feed() the file's bytes in order, then finish(); RowError (or NotUtf8) at the first bad row."""

    def __init__(self, problem: Callable[[object], str | None] = row_problem,
                 extra_check: Callable[[dict], str | None] | None = None):
        self._problem, self._extra_check = problem, extra_check
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._lines_done = 0  # complete lines checked, counted as str.splitlines counts them
        self._tail = ""  # the last line, until its line break arrives
        self.rows = 0

    def feed(self, data: bytes) -> None:
        self._check(self._decode(data, final=False), final=False)

    def finish(self) -> int:
        """The number of rows."""
        self._check(self._decode(b"", final=True), final=True)
        return self.rows

    def _decode(self, data: bytes, final: bool) -> str:
        try:
            return self._decoder.decode(data, final)
        except UnicodeDecodeError as e:  # e.object: the decoder's held bytes, then `data`
            raise NotUtf8(self._lines_done + e.object[:e.start].count(b"\n") + 1) from None

    def _check(self, text: str, final: bool) -> None:
        text = self._tail + text
        cut = len(text) if final else text.rfind("\n") + 1
        complete, self._tail = text[:cut], text[cut:]
        if len(self._tail) > MAX_ROW_CHARS:
            raise RowError(self._lines_done + 1, f"longer than {MAX_ROW_CHARS // 2**20} Mi characters")
        try:
            self.rows += len(parse_rows(complete, self._extra_check, self._problem))
        except RowError as e:
            raise RowError(self._lines_done + e.number, e.problem) from None
        self._lines_done += len(complete.splitlines())
