"""Tenants: admin only. A tenant is a namespace with a GPU quota, a token-rate limit and allowed models."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from modelfleet.controlplane import crud
from modelfleet.controlplane.api.deps import AdminPrincipal, ClusterDep, PageDep, SessionDep, TenantDep
from modelfleet.controlplane.schemas import Page, TenantCreate, TenantPublic, TenantUpdate

router = APIRouter(prefix="/tenants", tags=["tenants"])


@router.post("", status_code=status.HTTP_201_CREATED)
def create_tenant(
    tenant_in: TenantCreate, principal: AdminPrincipal, session: SessionDep, cluster: ClusterDep
) -> TenantPublic:
    tenant = crud.create_tenant(session, tenant_in=tenant_in, actor=principal.actor)
    cluster.apply_tenant(tenant, usable_keys=[])
    session.commit()
    return TenantPublic.model_validate(tenant)


@router.get("")
def list_tenants(principal: AdminPrincipal, session: SessionDep, page: PageDep) -> Page[TenantPublic]:
    tenants, count = crud.list_tenants(session, limit=page.limit, offset=page.offset)
    data = [TenantPublic.model_validate(t) for t in tenants]
    return Page[TenantPublic](data=data, count=count, limit=page.limit, offset=page.offset)


@router.get("/{tenant_name}")
def get_tenant(principal: AdminPrincipal, tenant: TenantDep) -> TenantPublic:
    return TenantPublic.model_validate(tenant)


@router.patch("/{tenant_name}")
def update_tenant(
    tenant_in: TenantUpdate,
    principal: AdminPrincipal,
    tenant: TenantDep,
    session: SessionDep,
    cluster: ClusterDep,
) -> TenantPublic:
    tenant = crud.update_tenant(session, tenant=tenant, tenant_in=tenant_in, actor=principal.actor)
    cluster.apply_tenant(tenant, usable_keys=crud.usable_key_prefixes(session, tenant=tenant))
    session.commit()
    return TenantPublic.model_validate(tenant)


@router.delete("/{tenant_name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_tenant(
    principal: AdminPrincipal, tenant: TenantDep, session: SessionDep, cluster: ClusterDep
) -> Response:
    crud.delete_tenant(session, tenant=tenant, actor=principal.actor)
    cluster.delete_tenant(tenant)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
