"""One base model's Serve deployment: the Engine (the base loaded once, its adapters on first use) behind OpenAI
requests (workers/serve/completions.py). The model stack is imported in the replica only."""

from __future__ import annotations

from ray import serve


@serve.deployment
class BaseModelServer:
    def __init__(self, base_uri: str, s3_endpoint_url: str | None = None, max_adapters: int = 8,
                 max_batch: int = 16):
        from moetune.workers.generate import Engine
        from moetune.workers.serve.completions import Completions

        self.completions = Completions(Engine.from_uri(base_uri, s3_endpoint_url=s3_endpoint_url,
                                                       max_adapters=max_adapters, max_batch=max_batch))

    async def generate(self, body: dict):
        async for event in self.completions.run(body):
            yield event

    def stats(self) -> dict:
        return self.completions.engine.stats()
