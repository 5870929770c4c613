"""`python -m moetune.workers.planner`: the control plane's planner child. Reads {"job", "cluster", "config"} as
JSON on stdin, writes {"plan": ...} or {"error": {"code", "message", "param"}} as JSON on stdout."""

from __future__ import annotations

import contextlib
import json
import sys

from pydantic import ValidationError

from moetune.api.errors import ErrorCode
from moetune.api.models.base import SpecError
from moetune.api.plans import PlanRequest
from moetune.workers.errors import JobError


def main() -> int:
    body = json.load(sys.stdin)
    # stdout carries the answer alone: what the libraries print (DeepSpeed logs to stdout) goes to stderr
    with contextlib.redirect_stdout(sys.stderr):
        result = _answer(body)
    json.dump(result, sys.stdout)
    return 0


def _answer(body: dict) -> dict:
    try:
        request = PlanRequest.model_validate({"job": body["job"], "cluster": body["cluster"]})
        from moetune.workers.planner.plan import plan

        result = {"plan": plan(body["config"], request.job, request.cluster)}
    except ValidationError as e:
        error = e.errors()[0]
        result = {"error": {"code": ErrorCode.invalid_request, "param": ".".join(map(str, error["loc"])),
                            "message": error["msg"]}}
    except SpecError as e:
        result = {"error": {"code": ErrorCode.invalid_request, "param": e.param, "message": e.message}}
    except JobError as e:
        result = {"error": {"code": e.code, "param": e.param, "message": str(e)}}
    return result


if __name__ == "__main__":
    sys.exit(main())
