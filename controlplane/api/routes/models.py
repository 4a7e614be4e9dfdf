"""Models of a tenant: the registry entry behind an InferenceModel, and its traffic split over versions."""

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
)
from modelfleet.controlplane.models import Model, Tenant
from modelfleet.controlplane.schemas import (
    Hardware,
    ModelCreate,
    ModelPublic,
    ModelUpdate,
    Page,
    PromoteRequest,
    Replicas,
    RollbackRequest,
    RolloutPublic,
    TrafficUpdate,
)

router = APIRouter(prefix="/tenants/{tenant_name}/models", tags=["models"])


def present_model(model: Model, tenant: Tenant, live_status: dict[str, Any] | None) -> ModelPublic:
    return ModelPublic(
        name=model.name,
        tenant=tenant.name,
        description=model.description,
        hardware=Hardware(accelerator=model.accelerator, count=model.gpu_count),
        replicas=Replicas(min=model.min_replicas, max=model.max_replicas),
        sticky_by=model.sticky_by,
        loading=model.loading,
        traffic=model.traffic,
        version=model.version,
        created_at=model.created_at,
        created_by=model.created_by,
        updated_at=model.updated_at,
        status=live_status,
    )


@router.post("", status_code=status.HTTP_201_CREATED)
def create_model(
    model_in: ModelCreate,
    principal: CurrentPrincipal,
    tenant: TenantDep,
    session: SessionDep,
    cluster: ClusterDep,
) -> ModelPublic:
    model = crud.create_model(session, tenant=tenant, model_in=model_in, actor=principal.actor)
    cluster.apply_model(tenant, model)  # a no-op until the model has a traffic split
    session.commit()
    return present_model(model, tenant, None)


@router.get("")
def list_models(
    principal: CurrentPrincipal,
    tenant: TenantDep,
    session: SessionDep,
    cluster: ClusterDep,
    page: PageDep,
    name_contains: str | None = Query(default=None, max_length=63),
    accelerator: str | None = Query(default=None, max_length=32),
) -> Page[ModelPublic]:
    models, count = crud.list_models(
        session,
        tenant=tenant,
        name_contains=name_contains,
        accelerator=accelerator,
        limit=page.limit,
        offset=page.offset,
    )
    live = cluster.model_statuses(tenant) if models else {}
    data = [present_model(m, tenant, live.get(m.name)) for m in models]
    return Page[ModelPublic](data=data, count=count, limit=page.limit, offset=page.offset)


@router.get("/{model_name}")
def get_model(
    principal: CurrentPrincipal, tenant: TenantDep, model: ModelDep, cluster: ClusterDep
) -> ModelPublic:
    return present_model(model, tenant, cluster.model_status(tenant, model.name))


@router.patch("/{model_name}")
def update_model(
    model_in: ModelUpdate,
    principal: CurrentPrincipal,
    tenant: TenantDep,
    model: ModelDep,
    session: SessionDep,
    cluster: ClusterDep,
) -> ModelPublic:
    model = crud.update_model(session, model=model, model_in=model_in, tenant=tenant, actor=principal.actor)
    cluster.apply_model(tenant, model)
    session.commit()
    return present_model(model, tenant, None)


@router.delete("/{model_name}", status_code=status.HTTP_204_NO_CONTENT)
def delete_model(
    principal: CurrentPrincipal, tenant: TenantDep, model: ModelDep, session: SessionDep, cluster: ClusterDep
) -> Response:
    crud.delete_model(session, model=model, tenant=tenant, actor=principal.actor)
    cluster.delete_model(tenant, model)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/{model_name}/traffic")
def set_traffic(
    update: TrafficUpdate,
    principal: CurrentPrincipal,
    tenant: TenantDep,
    model: ModelDep,
    session: SessionDep,
    cluster: ClusterDep,
) -> ModelPublic:
    crud.set_traffic(session, model=model, tenant=tenant, update=update, actor=principal.actor)
    cluster.apply_model(tenant, model)
    session.commit()
    return present_model(model, tenant, None)


@router.post("/{model_name}/promote")
def promote(
    request: PromoteRequest,
    principal: CurrentPrincipal,
    tenant: TenantDep,
    model: ModelDep,
    session: SessionDep,
    cluster: ClusterDep,
) -> ModelPublic:
    crud.promote(session, model=model, tenant=tenant, request=request, actor=principal.actor)
    cluster.apply_model(tenant, model)
    session.commit()
    return present_model(model, tenant, None)


@router.post("/{model_name}/rollback")
def rollback(
    principal: CurrentPrincipal,
    tenant: TenantDep,
    model: ModelDep,
    session: SessionDep,
    cluster: ClusterDep,
    request: RollbackRequest | None = None,
) -> ModelPublic:
    crud.rollback(
        session, model=model, tenant=tenant, request=request or RollbackRequest(), actor=principal.actor
    )
    cluster.apply_model(tenant, model)
    session.commit()
    return present_model(model, tenant, None)


@router.get("/{model_name}/rollouts")
def list_rollouts(
    principal: CurrentPrincipal, tenant: TenantDep, model: ModelDep, session: SessionDep, page: PageDep
) -> Page[RolloutPublic]:
    rollouts, count = crud.list_rollouts(session, model=model, limit=page.limit, offset=page.offset)
    data = [RolloutPublic.model_validate(r) for r in rollouts]
    return Page[RolloutPublic](data=data, count=count, limit=page.limit, offset=page.offset)
