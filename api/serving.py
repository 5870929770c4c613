"""The wire objects of the inference surface: OpenAI's model objects (control plane and serving app alike) and the
answer of a job's deploy call."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ServedModel(BaseModel):
    """What a replica needs to serve a model: the base checkpoint and, for a tuned model, its adapter."""

    base_model: str  # the base's name (api/model_names.py)
    base_model_uri: str
    adapter_uri: str | None = None  # None: the base itself
    fine_tuning_job_id: str | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str  # the tenant for a tuned model, "moetune" for a shared base
    # moetune extension; only GET /v1/models/{model} on the control plane fills it (the serving app resolves
    # names with it)
    moetune: ServedModel | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class Deployment(BaseModel):
    """POST /v1/fine_tuning/jobs/{id}/deploy (or a training session's .../weights/{name}/deploy): the name to call
    and the base URL of the OpenAI-compatible server (`openai.OpenAI(base_url=...)`)."""

    model: str
    base_model: str
    base_url: str
    status: str  # the Serve application's status when the call returned (e.g. DEPLOYING, RUNNING)
