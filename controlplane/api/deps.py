"""Dependencies of the routes: the session, the cluster, the caller, and the objects named in the path.

Access rule: a tenant key reaches only its own tenant's objects, and anything else looks absent (404),
so a tenant cannot even learn that another tenant's model exists. Admin-only routes answer 403.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from modelfleet.controlplane import crud
from modelfleet.controlplane.cluster import Cluster
from modelfleet.controlplane.core import security
from modelfleet.controlplane.core.config import Settings
from modelfleet.controlplane.errors import Forbidden, Invalid, NotAuthenticated, NotFound
from modelfleet.controlplane.models import Model, ModelVersion, Tenant, utcnow
from modelfleet.controlplane.schemas import INT32_MAX, Principal
from sqlalchemy.orm import Session

bearer = HTTPBearer(auto_error=False, description="An admin key or a tenant's API key (mf_...)")


def get_db(request: Request) -> Iterator[Session]:
    state = request.app.state
    if not state.migrated:
        raise DatabaseNotReady(state.migration_error)
    session: Session = state.sessionmaker()
    try:
        yield session
    finally:
        session.close()  # rolls back whatever a failed request left uncommitted


class DatabaseNotReady(Exception):
    """The schema could not be brought to head yet (the database is unreachable at start-up)."""


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_cluster(request: Request) -> Cluster:
    return request.app.state.cluster


SessionDep = Annotated[Session, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ClusterDep = Annotated[Cluster, Depends(get_cluster)]


def get_principal(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Principal:
    principal = _authenticate(session, settings, credentials)
    request.state.principal = principal  # for the audit of refused calls (api/handlers.py)
    return principal


def _authenticate(
    session: Session, settings: Settings, credentials: HTTPAuthorizationCredentials | None
) -> Principal:
    if credentials is None:
        raise NotAuthenticated("missing API key; send the header 'Authorization: Bearer <key>'")
    token = credentials.credentials
    if security.secret_matches(token, settings.admin_key.get_secret_value()):
        return Principal(role="admin")
    prefix = security.parse_prefix(token)
    key = crud.find_api_key(session, prefix=prefix) if prefix else None
    if key is None or not security.key_matches(token, key.key_hash, settings.key_pepper.get_secret_value()):
        raise NotAuthenticated("invalid API key; check the key or ask for a new one")
    if key.revoked_at is not None:
        raise NotAuthenticated(f"API key {key.prefix} was revoked; use another key")
    if key.expires_at is not None and key.expires_at <= utcnow():
        raise NotAuthenticated(
            f"API key {key.prefix} expired at {key.expires_at.isoformat()}; create a new one"
        )
    return Principal(role="tenant", tenant=key.tenant.name, key_prefix=key.prefix)


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


def require_admin(principal: CurrentPrincipal) -> Principal:
    if not principal.is_admin:
        raise Forbidden("this route needs the admin key")
    return principal


AdminPrincipal = Annotated[Principal, Depends(require_admin)]


def get_path_tenant(tenant_name: str, principal: CurrentPrincipal, session: SessionDep) -> Tenant:
    # Another tenant's name gets the same answer as a name that does not exist.
    tenant = (
        crud.get_tenant(session, name=tenant_name)
        if principal.is_admin or principal.tenant == tenant_name
        else None
    )
    if tenant is None:
        raise NotFound(f"tenant {tenant_name!r} not found", param="tenant_name")
    return tenant


TenantDep = Annotated[Tenant, Depends(get_path_tenant)]


def get_path_model(tenant: TenantDep, model_name: str, session: SessionDep) -> Model:
    model = crud.get_model(session, tenant=tenant, name=model_name)
    if model is None:
        raise NotFound(f"model {model_name!r} not found in tenant {tenant.name!r}", param="model_name")
    return model


ModelDep = Annotated[Model, Depends(get_path_model)]


def get_path_version(model: ModelDep, version_name: str, session: SessionDep) -> ModelVersion:
    version = crud.get_version(session, model=model, name=version_name)
    if version is None:
        raise NotFound(f"version {version_name!r} not found in model {model.name!r}", param="version_name")
    return version


VersionDep = Annotated[ModelVersion, Depends(get_path_version)]


@dataclass(frozen=True)
class PageParams:
    limit: int
    offset: int


def refuse_nul_characters(request: Request) -> None:
    """PostgreSQL text cannot hold a NUL character: refuse one in the path or query before any lookup
    (bodies are checked by their schemas)."""
    if "\x00" in request.url.path:
        raise Invalid("path: contains a NUL character; remove it", param="path")
    for name, value in request.query_params.multi_items():
        if "\x00" in name or "\x00" in value:
            raise Invalid(f"{name}: contains a NUL character; remove it", param=name)


def get_page(
    limit: Annotated[int, Query(ge=1, le=500, description="items per page")] = 50,
    offset: Annotated[int, Query(ge=0, le=INT32_MAX, description="items to skip")] = 0,
) -> PageParams:
    return PageParams(limit=limit, offset=offset)


PageDep = Annotated[PageParams, Depends(get_page)]
