"""A multipart/form-data request body read as it arrives (python-multipart's push parser over Starlette's
request.stream()), for routes that must not hold an uploaded file: FastAPI's File() spools the whole file first.
Yields each form field's value, and each file part as its start, its data in the pieces that arrived, and its end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from moetune.api.errors import ErrorCode
from moetune.service.errors import APIException

MAX_FIELD_BYTES = 64 * 1024  # a text field (purpose, ...): anything longer is not one


@dataclass
class Field:
    name: str
    value: str


@dataclass
class FileStart:
    name: str
    filename: str | None


@dataclass
class FileData:
    data: bytes


class FileEnd:
    pass


Item = Field | FileStart | FileData | FileEnd


def malformed(detail: str) -> APIException:
    return APIException(400, ErrorCode.invalid_request, f"The multipart body could not be parsed: {detail}.")


class _Parts:
    """python-multipart's callbacks, turned into Items queued for the caller."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self._header_name, self._header_value = bytearray(), bytearray()
        self._disposition = b""
        self._field: tuple[str, bytearray] | None = None  # the text field being read

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._header_name_piece,
                "on_header_value": self._header_value_piece, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._data,
                "on_part_end": self._end}

    def _begin(self) -> None:
        self._disposition, self._field = b"", None

    def _header_name_piece(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _header_value_piece(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name, self._header_value = bytearray(), bytearray()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise malformed("a part has no Content-Disposition name")
        name = options[b"name"].decode("utf-8", "replace")
        if b"filename" in options:
            self.items.append(FileStart(name, options[b"filename"].decode("utf-8", "replace") or None))
        else:
            self._field = (name, bytearray())

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._field is None:
            self.items.append(FileData(bytes(data[start:end])))
            return
        self._field[1].extend(data[start:end])
        if len(self._field[1]) > MAX_FIELD_BYTES:
            raise malformed(f"field {self._field[0]!r} is longer than {MAX_FIELD_BYTES} bytes")

    def _end(self) -> None:
        if self._field is None:
            self.items.append(FileEnd())
        else:
            self.items.append(Field(self._field[0], self._field[1].decode("utf-8", "replace")))


async def multipart_items(request: Request) -> AsyncIterator[Item]:
    """The body's fields and file parts in order, each yielded as soon as its bytes have arrived."""
    content_type, options = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data" or not options.get(b"boundary"):
        raise malformed("expected Content-Type multipart/form-data with a boundary")
    parts = _Parts()
    parser = MultipartParser(options[b"boundary"], parts.callbacks())
    async for chunk in request.stream():
        try:
            parser.write(chunk)
        except MultipartParseError as e:
            raise malformed(str(e)) from None
        items, parts.items = parts.items, []
        for item in items:
            yield item
    parser.finalize()
