"""FastAPI dependencies shared by the routers."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated

from fastapi import Depends, Request

from moetune.service.auth import current_tenant
from moetune.api.models.responses import Job
from moetune.service.store import JobRow, Store
from moetune.service.views import job_view


async def get_store(request: Request) -> Store:  # async: no worker-thread hop for a lookup
    return request.app.state.store


StoreDep = Annotated[Store, Depends(get_store)]
Tenant = Annotated[str, Depends(current_tenant)]


async def get_job_view(request: Request) -> Callable[[JobRow], Job]:
    """job_view with this app's base-model registry (model names)."""
    return partial(job_view, base_models=request.app.state.base_models)


JobView = Annotated[Callable[[JobRow], Job], Depends(get_job_view)]
