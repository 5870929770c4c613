"""FastAPI dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from moetune.service.auth import current_tenant
from moetune.service.store import Store


async def get_store(request: Request) -> Store:  # async: no worker-thread hop for a lookup
    return request.app.state.store


StoreDep = Annotated[Store, Depends(get_store)]
Tenant = Annotated[str, Depends(current_tenant)]
