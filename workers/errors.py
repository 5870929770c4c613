"""Failures a user can cause, reported as code/message/param instead of a stack trace."""

from __future__ import annotations

from moetune.api.errors import ErrorCode


class JobError(Exception):
    """A failure with an API error code and the offending job field (`param`)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None):
        super().__init__(code, message, param)  # all three in args, so it survives pickling across Ray
        self.code, self.message, self.param = code, message, param

    def __str__(self) -> str:
        return self.message


class DatasetError(JobError):
    """A data file that cannot be read or holds a malformed row; `param` is the file's field."""

    def __init__(self, param: str, message: str):
        super().__init__(ErrorCode.invalid_file(param), message, param)
        self.args = (param, message)
