"""The serving app's model resolution when the control plane cannot be reached: a 503 the caller can read."""

import asyncio

from moetune.service.local.embedded import free_port
from moetune.workers.serve.resolver import ModelResolver, Refusal


def test_an_unreachable_control_plane_is_a_503_not_a_stack_trace():
    resolver = ModelResolver(f"http://127.0.0.1:{free_port()}")  # nothing listens there

    async def both():
        return await resolver.resolve("Bearer t", "ft:b:o:ftjob-1"), await resolver.list("Bearer t")

    found, (status, body) = asyncio.run(both())
    assert isinstance(found, Refusal) and found.status == status == 503
    assert found.body["error"]["code"] == body["error"]["code"] == "not_ready"
    assert "control plane did not answer" in body["error"]["message"]
