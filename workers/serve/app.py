"""The Serve application's builder (`import_path: moetune.workers.serve.app:build_app`, see
service/cluster/serve_deploy.py): one engine deployment per base, behind the OpenAI ingress."""

from __future__ import annotations

import re

from pydantic import BaseModel

from moetune.workers.serve.engine_server import BaseModelServer
from moetune.workers.serve.ingress import OpenAIServer


class ServeArgs(BaseModel):
    control_plane_url: str
    bases: dict[str, str]  # name -> checkpoint URI
    s3_endpoint_url: str | None = None
    max_adapters: int = 8
    max_batch: int = 16
    engine_num_cpus: float = 1.0  # what one base's replica reserves on the cluster (the ingress reserves none)


def _deployment_name(base: str) -> str:
    return "base-" + re.sub(r"[^A-Za-z0-9_-]", "-", base)


def build_app(args: dict):
    spec = ServeArgs.model_validate(args)
    engines = {uri: BaseModelServer.options(
        name=_deployment_name(name), ray_actor_options={"num_cpus": spec.engine_num_cpus}).bind(
        uri, spec.s3_endpoint_url, spec.max_adapters, spec.max_batch) for name, uri in spec.bases.items()}
    return OpenAIServer.options(ray_actor_options={"num_cpus": 0}).bind(engines, spec.control_plane_url)
