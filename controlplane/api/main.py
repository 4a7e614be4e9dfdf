"""The /api/v1 router."""

from __future__ import annotations

from fastapi import APIRouter
from modelfleet.controlplane.api.routes import audit, keys, models, tenants, versions

api_router = APIRouter(prefix="/api/v1")
for module in (tenants, keys, models, versions, audit):
    api_router.include_router(module.router)
