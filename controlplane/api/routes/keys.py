"""API keys of a tenant: the admin or the tenant itself creates, lists and revokes them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response, status
from modelfleet.controlplane import crud
from modelfleet.controlplane.api.deps import (
    ClusterDep,
    CurrentPrincipal,
    PageDep,
    SessionDep,
    SettingsDep,
    TenantDep,
)
from modelfleet.controlplane.core import security
from modelfleet.controlplane.errors import NotFound
from modelfleet.controlplane.schemas import INT32_MAX, ApiKeyCreate, ApiKeyCreated, ApiKeyPublic, Page

router = APIRouter(prefix="/tenants/{tenant_name}/keys", tags=["keys"])
KeyId = Annotated[int, Path(ge=1, le=INT32_MAX, description="the key's id")]


@router.post("", status_code=status.HTTP_201_CREATED)
def create_key(
    key_in: ApiKeyCreate,
    principal: CurrentPrincipal,
    tenant: TenantDep,
    session: SessionDep,
    cluster: ClusterDep,
    settings: SettingsDep,
) -> ApiKeyCreated:
    key, token = crud.create_api_key(
        session,
        tenant=tenant,
        key_in=key_in,
        actor=principal.actor,
        server_pepper=settings.key_pepper.get_secret_value(),
        minted_by=None if principal.is_admin else principal.key_prefix,
    )
    # The data plane's digest is made here, while the token is at hand; it is kept only in the Secret.
    new_key = (key.prefix, security.serving_digest(token))
    cluster.apply_keys(tenant, crud.usable_key_prefixes(session, tenant=tenant), new_key=new_key)
    session.commit()
    return ApiKeyCreated(**ApiKeyPublic.model_validate(key).model_dump(), key=token)


@router.get("")
def list_keys(
    principal: CurrentPrincipal,
    tenant: TenantDep,
    session: SessionDep,
    page: PageDep,
    include_revoked: bool = Query(default=False),
) -> Page[ApiKeyPublic]:
    keys, count = crud.list_api_keys(
        session, tenant=tenant, include_revoked=include_revoked, limit=page.limit, offset=page.offset
    )
    data = [ApiKeyPublic.model_validate(k) for k in keys]
    return Page[ApiKeyPublic](data=data, count=count, limit=page.limit, offset=page.offset)


@router.get("/{key_id}")
def get_key(
    key_id: KeyId, principal: CurrentPrincipal, tenant: TenantDep, session: SessionDep
) -> ApiKeyPublic:
    key = crud.get_api_key(session, tenant=tenant, key_id=key_id)
    if key is None:
        raise NotFound(f"API key {key_id} not found in tenant {tenant.name!r}", param="key_id")
    return ApiKeyPublic.model_validate(key)


@router.delete("/{key_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_key(
    key_id: KeyId, principal: CurrentPrincipal, tenant: TenantDep, session: SessionDep, cluster: ClusterDep
) -> Response:
    key = crud.get_api_key(session, tenant=tenant, key_id=key_id)
    if key is None:
        raise NotFound(f"API key {key_id} not found in tenant {tenant.name!r}", param="key_id")
    crud.revoke_api_key(session, key=key, tenant=tenant, actor=principal.actor)
    cluster.apply_keys(tenant, crud.usable_key_prefixes(session, tenant=tenant))
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
