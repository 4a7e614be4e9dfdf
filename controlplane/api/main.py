"""The /api/v1 router."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from modelfleet.controlplane.api.deps import refuse_nul_characters
from modelfleet.controlplane.api.routes import audit, keys, models, tenants, versions
from modelfleet.controlplane.schemas import ErrorBody

ERRORS = {
    401: "missing, unknown, revoked or expired API key",
    403: "the key may not do this (admin-only route, or a model name the tenant may not use)",
    404: "no such object, or it belongs to another tenant",
    409: "conflicts with the current state (exists already, stale expected_version, concurrent change)",
    422: "invalid request; `param` names the field",
    503: "the database is unavailable; retry",
}

api_router = APIRouter(
    prefix="/api/v1",
    responses={code: {"model": ErrorBody, "description": text} for code, text in ERRORS.items()},
    dependencies=[Depends(refuse_nul_characters)],
)
for module in (tenants, keys, models, versions, audit):
    api_router.include_router(module.router)
