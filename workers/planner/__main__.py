"""`python -m moetune.workers.planner`: the control plane's planner child. Reads {"job" (a run config), "cluster",
"config", "choose_checkpointing"} as JSON on stdin, writes {"plan": ...} or {"error": {"code", "message", "param"}}
as JSON on stdout."""

from __future__ import annotations

import contextlib
import json
import sys

from pydantic import ValidationError

from moetune.api.errors import ErrorCode
from moetune.api.models.base import SpecError
from moetune.api.models.run_config import RunConfig
from moetune.api.plans import ClusterSpec
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
        job, cluster = RunConfig.model_validate(body["job"]), ClusterSpec.model_validate(body["cluster"])
        from moetune.workers.planner.plan import plan

        result = {"plan": plan(body["config"], job, cluster, body["choose_checkpointing"]).model_dump(mode="json")}
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
