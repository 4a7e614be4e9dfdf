"""Versions of a model: immutable sets of weights, with lineage, metadata and converted artifacts."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Response, status
from modelfleet.controlplane import crud
from modelfleet.controlplane.api.deps import (
    ClusterDep,
    CurrentPrincipal,
    ModelDep,
    PageDep,
    SessionDep,
    TenantDep,
    VersionDep,
)
from modelfleet.controlplane.models import Model, ModelVersion
from modelfleet.controlplane.schemas import (
    ArtifactPublic,
    Page,
    Source,
    Target,
    VersionCreate,
    VersionPublic,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

router = APIRouter(prefix="/tenants/{tenant_name}/models/{model_name}/versions", tags=["versions"])


def present_version(model: Model, version: ModelVersion, live_status: dict[str, Any] | None) -> VersionPublic:
    return VersionPublic(
        model=model.name,
        version=version.name,
        source=Source(uri=version.source_uri, format=version.source_format, sha256=version.digest),
        quantization=version.quantization,
        quantize_lm_head=version.quantize_lm_head,
        parent=version.parent.name if version.parent else None,
        targets=[Target(**t) for t in version.targets],
        metadata=version.meta,
        created_at=version.created_at,
        created_by=version.created_by,
        weight=crud.weight_of(model.traffic, version.name),
        phase=(live_status or {}).get("phase"),
        artifacts=[ArtifactPublic.model_validate(a) for a in version.artifacts],
    )


def merge_live(session: Session, version: ModelVersion, live_status: dict[str, Any] | None) -> None:
    """Keep the artifacts the operator reported; the registry remembers them after the CR is gone."""
    reported = (live_status or {}).get("artifacts")
    try:
        if reported and crud.upsert_artifacts(session, version=version, reported=reported):
            session.commit()
    except IntegrityError:
        session.rollback()  # a concurrent read stored the same artifact first; theirs will do


@router.post("", status_code=status.HTTP_201_CREATED)
def create_version(
    version_in: VersionCreate,
    principal: CurrentPrincipal,
    tenant: TenantDep,
    model: ModelDep,
    session: SessionDep,
    cluster: ClusterDep,
) -> VersionPublic:
    version = crud.create_version(
        session, model=model, version_in=version_in, tenant=tenant, actor=principal.actor
    )
    cluster.apply_version(tenant, model, version)
    session.commit()
    return present_version(model, version, None)


@router.get("")
def list_versions(
    principal: CurrentPrincipal,
    tenant: TenantDep,
    model: ModelDep,
    session: SessionDep,
    cluster: ClusterDep,
    page: PageDep,
    quantization: str | None = Query(default=None, max_length=16),
    parent: str | None = Query(
        default=None, max_length=63, description="only versions derived from this one"
    ),
) -> Page[VersionPublic]:
    versions, count = crud.list_versions(
        session, model=model, quantization=quantization, parent=parent, limit=page.limit, offset=page.offset
    )
    live = cluster.version_statuses(tenant, model.name) if versions else {}
    for version in versions:
        merge_live(session, version, live.get(version.name))
    data = [present_version(model, v, live.get(v.name)) for v in versions]
    return Page[VersionPublic](data=data, count=count, limit=page.limit, offset=page.offset)


@router.get("/{version_name}")
def get_version(
    principal: CurrentPrincipal,
    tenant: TenantDep,
    model: ModelDep,
    version: VersionDep,
    session: SessionDep,
    cluster: ClusterDep,
) -> VersionPublic:
    live = cluster.version_status(tenant, model.name, version.name)
    merge_live(session, version, live)
    return present_version(model, version, live)


@router.delete("/{version_name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_version(
    principal: CurrentPrincipal,
    tenant: TenantDep,
    model: ModelDep,
    version: VersionDep,
    session: SessionDep,
    cluster: ClusterDep,
) -> Response:
    crud.delete_version(session, model=model, version=version, tenant=tenant, actor=principal.actor)
    cluster.delete_version(tenant, model, version)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
