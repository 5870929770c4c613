"""service/submission/streamed_rows.py: a JSONL file checked piece by piece gets the row count and the row numbers
that api/data_rows.parse_rows gives the whole text, wherever the pieces are cut (inside a character, a CRLF)."""

from __future__ import annotations

import pytest

from moetune.api.data_rows import RowError, parse_rows
from moetune.service.submission.streamed_rows import NotUtf8, StreamedRows

GOOD = '{"text": "naïve 漢字 🙂"}\r\n\n{"text": "two"}\n{"messages": [{"role": "user", "content": "hi"}, ' \
       '{"role": "assistant", "content": "ok"}]}'.encode()
BAD_JSON = GOOD + b'\n{"text": "four"}\n{oops\n{"text": "six"}\n'


def _fed(data: bytes, piece: int) -> StreamedRows:
    rows = StreamedRows()
    for start in range(0, len(data), piece):
        rows.feed(data[start:start + piece])
    rows.finish()
    return rows


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_pieces_give_the_rows_and_row_numbers_of_the_whole_text(piece):
    assert _fed(GOOD, piece).rows == len(parse_rows(GOOD.decode()))
    with pytest.raises(RowError) as whole:
        parse_rows(BAD_JSON.decode())
    with pytest.raises(RowError) as streamed:
        _fed(BAD_JSON, piece)
    assert (streamed.value.number, streamed.value.problem) == (whole.value.number, whole.value.problem)
    assert whole.value.number == 6


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_bytes_that_are_not_utf8_are_refused_on_arrival_with_their_row(piece):
    rows = StreamedRows()
    data = GOOD + b"\n" + "é".encode()[:1] + b"\xff" + b" the rest never needs to arrive"
    with pytest.raises(NotUtf8) as err:
        for start in range(0, len(data), piece):
            rows.feed(data[start:start + piece])
    assert err.value.line == 5  # GOOD holds 4 lines (one blank)
