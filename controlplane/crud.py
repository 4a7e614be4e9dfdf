"""Every database query of the control plane. Functions take keyword-only arguments; mutating ones
record an AuditEvent in the same transaction, so the trail and the change commit together."""

from __future__ import annotations

import fnmatch
from datetime import datetime, timedelta
from typing import Any

from modelfleet.controlplane import schemas
from modelfleet.controlplane.core import security
from modelfleet.controlplane.errors import Conflict, Forbidden, Invalid
from modelfleet.controlplane.models import (
    ApiKey,
    Artifact,
    AuditEvent,
    Model,
    ModelVersion,
    Rollout,
    Tenant,
    utcnow,
)
from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session


def _page(session: Session, query: Select, *, limit: int, offset: int) -> tuple[list[Any], int]:
    count = session.scalar(select(func.count()).select_from(query.order_by(None).subquery())) or 0
    items = list(session.scalars(query.limit(limit).offset(offset)))
    return items, count


def record_audit(
    session: Session, *, actor: str, tenant: str | None, action: str, target: str, detail: dict | None = None
) -> None:
    session.add(AuditEvent(actor=actor, tenant=tenant, action=action, target=target, detail=detail or {}))


def list_audit(
    session: Session, *, tenant: str | None, action: str | None, limit: int, offset: int
) -> tuple[list[AuditEvent], int]:
    query = select(AuditEvent).order_by(AuditEvent.id.desc())
    if tenant is not None:
        query = query.where(AuditEvent.tenant == tenant)
    if action is not None:
        query = query.where(AuditEvent.action == action)
    return _page(session, query, limit=limit, offset=offset)


# Tenants


def get_tenant(session: Session, *, name: str) -> Tenant | None:
    return session.scalar(select(Tenant).where(Tenant.name == name))


def list_tenants(session: Session, *, limit: int, offset: int) -> tuple[list[Tenant], int]:
    return _page(session, select(Tenant).order_by(Tenant.name), limit=limit, offset=offset)


def create_tenant(session: Session, *, tenant_in: schemas.TenantCreate, actor: str) -> Tenant:
    namespace = tenant_in.namespace or tenant_in.name
    if get_tenant(session, name=tenant_in.name) is not None:
        raise Conflict(f"tenant {tenant_in.name!r} already exists", param="name")
    if session.scalar(select(Tenant.id).where(Tenant.namespace == namespace)) is not None:
        raise Conflict(f"namespace {namespace!r} already belongs to another tenant", param="namespace")
    tenant = Tenant(**tenant_in.model_dump(exclude={"namespace"}), namespace=namespace)
    session.add(tenant)
    record_audit(
        session,
        actor=actor,
        tenant=tenant.name,
        action="tenant.create",
        target=tenant.name,
        detail=tenant_in.model_dump(),
    )
    session.flush()
    return tenant


def update_tenant(session: Session, *, tenant: Tenant, tenant_in: schemas.TenantUpdate, actor: str) -> Tenant:
    changes = tenant_in.model_dump(exclude_unset=True, exclude_none=True)
    for field, value in changes.items():
        setattr(tenant, field, value)
    record_audit(
        session, actor=actor, tenant=tenant.name, action="tenant.update", target=tenant.name, detail=changes
    )
    session.flush()
    return tenant


def delete_tenant(session: Session, *, tenant: Tenant, actor: str) -> None:
    record_audit(session, actor=actor, tenant=tenant.name, action="tenant.delete", target=tenant.name)
    session.delete(tenant)
    session.flush()


def model_allowed(tenant: Tenant, model_name: str) -> bool:
    patterns = tenant.allowed_models or []
    return not patterns or any(fnmatch.fnmatchcase(model_name, pattern) for pattern in patterns)


# API keys


def create_api_key(
    session: Session,
    *,
    tenant: Tenant,
    key_in: schemas.ApiKeyCreate,
    actor: str,
    server_pepper: str,
    minted_by: str | None = None,
) -> tuple[ApiKey, str]:
    """The new key row and its token; the token exists only in the return value.

    `minted_by`: the prefix of the tenant key making it (None for the admin). A key made by a tenant key
    expires no later than that key, so revoking a leaked key, or letting it expire, ends what it made."""
    expires_at = utcnow() + timedelta(days=key_in.expires_in_days) if key_in.expires_in_days else None
    if minted_by is not None:
        minter = session.scalar(select(ApiKey).where(ApiKey.prefix == minted_by))
        limit = minter.expires_at if minter is not None else None
        if limit is not None:
            expires_at = limit if expires_at is None else min(expires_at, limit)
        elif expires_at is None:
            raise Forbidden(
                "expires_in_days: a tenant key cannot make a key that never expires; ask the admin",
                param="expires_in_days",
            )
    new = security.new_key(server_pepper)
    while session.scalar(select(ApiKey.id).where(ApiKey.prefix == new.prefix)) is not None:
        new = security.new_key(server_pepper)  # a prefix collision: 36**8 makes this all but never loop
    key = ApiKey(
        tenant_id=tenant.id,
        name=key_in.name,
        prefix=new.prefix,
        key_hash=new.key_hash,
        created_by=actor,
        expires_at=expires_at,
    )
    session.add(key)
    record_audit(
        session,
        actor=actor,
        tenant=tenant.name,
        action="key.create",
        target=f"{tenant.name}/key:{new.prefix}",
        detail={"name": key_in.name, "expires_at": expires_at.isoformat() if expires_at else None},
    )
    session.flush()
    return key, new.token


def get_api_key(session: Session, *, tenant: Tenant, key_id: int) -> ApiKey | None:
    return session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant.id))


def find_api_key(session: Session, *, prefix: str) -> ApiKey | None:
    return session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))


def list_api_keys(
    session: Session, *, tenant: Tenant, include_revoked: bool, limit: int, offset: int
) -> tuple[list[ApiKey], int]:
    query = select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(ApiKey.id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return _page(session, query, limit=limit, offset=offset)


def usable_key_prefixes(session: Session, *, tenant: Tenant) -> list[str]:
    """Prefixes of the keys that authenticate now: not revoked, not expired."""
    query = select(ApiKey.prefix).where(
        ApiKey.tenant_id == tenant.id,
        ApiKey.revoked_at.is_(None),
        (ApiKey.expires_at.is_(None)) | (ApiKey.expires_at > utcnow()),
    )
    return list(session.scalars(query.order_by(ApiKey.prefix)))


def tenants_with_keys_expired_between(session: Session, *, since: datetime, until: datetime) -> list[Tenant]:
    """Tenants whose key Secret still lists a key that expired in (since, until]."""
    expired = select(ApiKey.tenant_id).where(ApiKey.expires_at > since, ApiKey.expires_at <= until)
    return list(session.scalars(select(Tenant).where(Tenant.id.in_(expired)).order_by(Tenant.id)))


def revoke_api_key(session: Session, *, key: ApiKey, tenant: Tenant, actor: str) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        record_audit(
            session,
            actor=actor,
            tenant=tenant.name,
            action="key.revoke",
            target=f"{tenant.name}/key:{key.prefix}",
        )
        session.flush()
    return key


# Models


def get_model(session: Session, *, tenant: Tenant, name: str) -> Model | None:
    return session.scalar(select(Model).where(Model.tenant_id == tenant.id, Model.name == name))


def list_models(
    session: Session,
    *,
    tenant: Tenant,
    name_contains: str | None,
    accelerator: str | None,
    limit: int,
    offset: int,
) -> tuple[list[Model], int]:
    query = select(Model).where(Model.tenant_id == tenant.id).order_by(Model.name)
    if name_contains:
        query = query.where(Model.name.contains(name_contains, autoescape=True))
    if accelerator:
        query = query.where(Model.accelerator == accelerator)
    return _page(session, query, limit=limit, offset=offset)


def create_model(session: Session, *, tenant: Tenant, model_in: schemas.ModelCreate, actor: str) -> Model:
    if not model_allowed(tenant, model_in.name):
        raise Forbidden(f"tenant {tenant.name!r} may not serve a model named {model_in.name!r}", param="name")
    if get_model(session, tenant=tenant, name=model_in.name) is not None:
        raise Conflict(f"model {model_in.name!r} already exists", param="name")
    model = Model(
        tenant_id=tenant.id,
        name=model_in.name,
        description=model_in.description,
        accelerator=model_in.hardware.accelerator,
        gpu_count=model_in.hardware.count,
        min_replicas=model_in.replicas.min,
        max_replicas=model_in.replicas.max,
        sticky_by=model_in.sticky_by,
        loading=model_in.loading,
        traffic=[],
        created_by=actor,
    )
    session.add(model)
    record_audit(
        session,
        actor=actor,
        tenant=tenant.name,
        action="model.create",
        target=f"{tenant.name}/{model.name}",
        detail=model_in.model_dump(mode="json"),
    )
    session.flush()
    return model


def _check_expected(model: Model, expected_version: int | None) -> None:
    if expected_version is not None and model.version != expected_version:
        raise Conflict(
            f"model {model.name!r} is at version {model.version}, not {expected_version}; "
            "read it again and retry",
            param="expected_version",
        )


def update_model(
    session: Session, *, model: Model, model_in: schemas.ModelUpdate, tenant: Tenant, actor: str
) -> Model:
    _check_expected(model, model_in.expected_version)
    changes = model_in.model_dump(
        exclude_unset=True, exclude_none=True, exclude={"expected_version"}, mode="json"
    )
    if model_in.description is not None:
        model.description = model_in.description
    if model_in.hardware is not None:
        model.accelerator, model.gpu_count = model_in.hardware.accelerator, model_in.hardware.count
    if model_in.replicas is not None:
        model.min_replicas, model.max_replicas = model_in.replicas.min, model_in.replicas.max
    if model_in.sticky_by is not None:
        model.sticky_by = model_in.sticky_by
    if model_in.loading is not None:
        model.loading = model_in.loading
    record_audit(
        session,
        actor=actor,
        tenant=tenant.name,
        action="model.update",
        target=f"{tenant.name}/{model.name}",
        detail=changes,
    )
    session.flush()
    return model


def delete_model(session: Session, *, model: Model, tenant: Tenant, actor: str) -> None:
    record_audit(
        session, actor=actor, tenant=tenant.name, action="model.delete", target=f"{tenant.name}/{model.name}"
    )
    session.delete(model)
    session.flush()


# Versions and artifacts


def get_version(session: Session, *, model: Model, name: str) -> ModelVersion | None:
    return session.scalar(
        select(ModelVersion).where(ModelVersion.model_id == model.id, ModelVersion.name == name)
    )


def list_versions(
    session: Session, *, model: Model, quantization: str | None, parent: str | None, limit: int, offset: int
) -> tuple[list[ModelVersion], int]:
    query = select(ModelVersion).where(ModelVersion.model_id == model.id).order_by(ModelVersion.id)
    if quantization:
        query = query.where(ModelVersion.quantization == quantization)
    if parent:
        parent_row = get_version(session, model=model, name=parent)
        query = query.where(ModelVersion.parent_id == (parent_row.id if parent_row else -1))
    return _page(session, query, limit=limit, offset=offset)


def create_version(
    session: Session, *, model: Model, version_in: schemas.VersionCreate, tenant: Tenant, actor: str
) -> ModelVersion:
    if get_version(session, model=model, name=version_in.version) is not None:
        raise Conflict(
            f"version {version_in.version!r} of model {model.name!r} already exists", param="version"
        )
    # The ModelVersion CR is `<model>-<version>`: model "a" version "b-c" and model "a-b" version "c" clash.
    object_name = f"{model.name}-{version_in.version}"
    clash = session.scalar(
        select(Model.name)
        .join(ModelVersion, ModelVersion.model_id == Model.id)
        .where(Model.tenant_id == tenant.id, Model.name + "-" + ModelVersion.name == object_name)
    )
    if clash is not None:
        raise Conflict(
            f"version {version_in.version!r} would share the object name {object_name!r} with a version of "
            f"model {clash!r}; choose another version name",
            param="version",
        )
    parent = None
    if version_in.parent is not None:
        parent = get_version(session, model=model, name=version_in.parent)
        if parent is None:
            raise Invalid(
                f"parent version {version_in.parent!r} does not exist in model {model.name!r}", param="parent"
            )
    version = ModelVersion(
        model_id=model.id,
        name=version_in.version,
        source_uri=version_in.source.uri,
        source_format=version_in.source.format,
        digest=version_in.source.sha256,
        quantization=version_in.quantization,
        quantize_lm_head=version_in.quantize_lm_head,
        targets=[t.model_dump() for t in version_in.targets],
        parent_id=parent.id if parent else None,
        meta=version_in.metadata,
        created_by=actor,
    )
    session.add(version)
    record_audit(
        session,
        actor=actor,
        tenant=tenant.name,
        action="version.create",
        target=f"{tenant.name}/{model.name}@{version.name}",
        detail=version_in.model_dump(mode="json"),
    )
    session.flush()
    return version


def delete_version(
    session: Session, *, model: Model, version: ModelVersion, tenant: Tenant, actor: str
) -> None:
    weight = weight_of(model.traffic, version.name)
    if weight:
        raise Conflict(
            f"version {version.name!r} serves {weight}% of the traffic; move its traffic away first",
            param="version",
        )
    # The model's optimistic-lock version moves too: of two deletes (or a delete and a traffic change
    # onto this version) racing on one model, one commits and the other gets a 409.
    model.updated_at = utcnow()
    record_audit(
        session,
        actor=actor,
        tenant=tenant.name,
        action="version.delete",
        target=f"{tenant.name}/{model.name}@{version.name}",
    )
    session.delete(version)
    session.flush()


def upsert_artifacts(session: Session, *, version: ModelVersion, reported: list[dict[str, Any]]) -> bool:
    """Store the artifacts that the operator reported in the version's status; True if anything changed."""
    existing = {(a.accelerator, a.format, a.dtype): a for a in version.artifacts}
    changed = False
    for entry in reported:
        key = (entry.get("accelerator", ""), entry.get("format", ""), entry.get("dtype", ""))
        if not all(key):
            continue
        values = {
            "uri": entry.get("uri", ""),
            "sha256": entry.get("sha256"),
            "size_bytes": entry.get("sizeBytes"),
            "validation": entry.get("validation") or {},
        }
        artifact = existing.get(key)
        if artifact is None:
            version.artifacts.append(Artifact(accelerator=key[0], format=key[1], dtype=key[2], **values))
            changed = True
        elif any(getattr(artifact, field) != value for field, value in values.items()):
            for field, value in values.items():
                setattr(artifact, field, value)
            changed = True
    if changed:
        session.flush()
    return changed


def weight_of(traffic: list[dict[str, Any]], version: str) -> int:
    return sum(int(entry["weight"]) for entry in traffic if entry["version"] == version)


# Traffic and rollouts


def _apply_split(
    session: Session,
    *,
    model: Model,
    tenant: Tenant,
    to_weights: list[dict[str, Any]],
    action: str,
    reason: str,
    actor: str,
    expected_version: int | None,
) -> Rollout:
    _check_expected(model, expected_version)
    for index, entry in enumerate(to_weights):
        if get_version(session, model=model, name=entry["version"]) is None:
            raise Invalid(
                f"version {entry['version']!r} does not exist in model {model.name!r}; create it first",
                param=f"traffic.{index}.version",
            )
    rollout = Rollout(
        model_id=model.id,
        action=action,
        from_weights=list(model.traffic),
        to_weights=to_weights,
        reason=reason,
        actor=actor,
    )
    model.traffic = to_weights
    model.updated_at = utcnow()  # also makes the UPDATE (and its version check) happen even for a no-op split
    session.add(rollout)
    record_audit(
        session,
        actor=actor,
        tenant=tenant.name,
        action=f"model.{action}",
        target=f"{tenant.name}/{model.name}",
        detail={"from": rollout.from_weights, "to": to_weights, "reason": reason},
    )
    session.flush()  # raises StaleDataError here if another writer got in first
    return rollout


def set_traffic(
    session: Session, *, model: Model, tenant: Tenant, update: schemas.TrafficUpdate, actor: str
) -> Rollout:
    weights = [entry.model_dump() for entry in update.traffic]
    return _apply_split(
        session,
        model=model,
        tenant=tenant,
        to_weights=weights,
        action="traffic",
        reason=update.reason,
        actor=actor,
        expected_version=update.expected_version,
    )


def promote(
    session: Session, *, model: Model, tenant: Tenant, request: schemas.PromoteRequest, actor: str
) -> Rollout:
    if get_version(session, model=model, name=request.version) is None:
        raise Invalid(f"version {request.version!r} does not exist in model {model.name!r}", param="version")
    return _apply_split(
        session,
        model=model,
        tenant=tenant,
        to_weights=[{"version": request.version, "weight": 100}],
        action="promote",
        reason=request.reason,
        actor=actor,
        expected_version=request.expected_version,
    )


def rollback(
    session: Session, *, model: Model, tenant: Tenant, request: schemas.RollbackRequest, actor: str
) -> Rollout:
    """Back to the split before the latest change still in effect; repeated, it walks further back."""
    last = session.scalar(
        select(Rollout)
        .where(
            Rollout.model_id == model.id,
            Rollout.state == "applied",
            Rollout.action.in_(("traffic", "promote")),
        )
        .order_by(Rollout.id.desc())
        .limit(1)
    )
    if last is None:
        raise Conflict(f"model {model.name!r} has no traffic change to roll back")
    if not last.from_weights:
        raise Conflict(f"change {last.id} gave model {model.name!r} its first split; there is no earlier one")
    previous = [
        entry for entry in last.from_weights if get_version(session, model=model, name=entry["version"])
    ]
    if len(previous) != len(last.from_weights):
        raise Conflict("the previous split names a version that was deleted; set the traffic explicitly")
    last.state = "rolled_back"  # version-checked as well: two rollbacks cannot undo the same change
    return _apply_split(
        session,
        model=model,
        tenant=tenant,
        to_weights=previous,
        action="rollback",
        reason=request.reason or f"rollback of change {last.id}",
        actor=actor,
        expected_version=request.expected_version,
    )


def list_rollouts(session: Session, *, model: Model, limit: int, offset: int) -> tuple[list[Rollout], int]:
    query = select(Rollout).where(Rollout.model_id == model.id).order_by(Rollout.id.desc())
    return _page(session, query, limit=limit, offset=offset)
