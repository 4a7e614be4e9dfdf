"""The audit trail, and who the caller is. The admin reads every tenant's events; a tenant its own."""

from __future__ import annotations

from fastapi import APIRouter, Query
from modelfleet.controlplane import crud
from modelfleet.controlplane.api.deps import CurrentPrincipal, PageDep, SessionDep
from modelfleet.controlplane.schemas import AuditEventPublic, Page, Principal

router = APIRouter(tags=["audit"])


@router.get("/audit")
def list_audit(
    principal: CurrentPrincipal,
    session: SessionDep,
    page: PageDep,
    tenant: str | None = Query(default=None, max_length=63, description="admin only: one tenant's events"),
    action: str | None = Query(default=None, max_length=64, description="e.g. model.traffic"),
) -> Page[AuditEventPublic]:
    scope = tenant if principal.is_admin else principal.tenant
    events, count = crud.list_audit(
        session, tenant=scope, action=action, limit=page.limit, offset=page.offset
    )
    data = [AuditEventPublic.model_validate(e) for e in events]
    return Page[AuditEventPublic](data=data, count=count, limit=page.limit, offset=page.offset)


@router.get("/me")
def whoami(principal: CurrentPrincipal) -> Principal:
    return principal
