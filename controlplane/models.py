"""Database tables (SQLAlchemy 2.0 declarative). Schema changes go through alembic/versions."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

JSONType = JSON().with_variant(JSONB(), "postgresql")


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC on every backend (SQLite keeps no zone, so it is put back on load)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given; use timezone-aware UTC")
        return value.astimezone(UTC) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSONType, list[Any]: JSONType}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    namespace: Mapped[str] = mapped_column(String(63), unique=True)
    gpu_quota: Mapped[int] = mapped_column(Integer, default=0)
    token_rate_limit: Mapped[int] = mapped_column(Integer, default=0)  # tokens per minute, 0 = unlimited
    allowed_models: Mapped[list[Any]] = mapped_column(default=list)  # name patterns, empty = any
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    __mapper_args__ = {"version_id_col": version}


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str] = mapped_column(String(100))
    expires_at: Mapped[datetime | None] = mapped_column(default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)

    tenant: Mapped[Tenant] = relationship(lazy="joined")

    def __repr__(self) -> str:  # never the hash, let alone a token
        return f"ApiKey(id={self.id!r}, prefix={self.prefix!r})"


class Model(Base):
    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_models_tenant_name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    description: Mapped[str] = mapped_column(Text, default="")
    accelerator: Mapped[str] = mapped_column(String(32))
    gpu_count: Mapped[int] = mapped_column(Integer, default=1)
    min_replicas: Mapped[int] = mapped_column(Integer, default=1)
    max_replicas: Mapped[int] = mapped_column(Integer, default=1)
    sticky_by: Mapped[str] = mapped_column(String(100), default="none")
    loading: Mapped[str] = mapped_column(String(16), default="lazy")
    traffic: Mapped[list[Any]] = mapped_column(default=list)  # [{"version": str, "weight": int}]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str] = mapped_column(String(100))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    # Optimistic lock: every UPDATE says WHERE version = <the one read>; a stale writer matches no row.
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    tenant: Mapped[Tenant] = relationship()

    __mapper_args__ = {"version_id_col": version}


class ModelVersion(Base):
    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_id", "name", name="uq_model_versions_model_name"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(63))
    source_uri: Mapped[str] = mapped_column(Text)
    source_format: Mapped[str] = mapped_column(String(32))
    digest: Mapped[str | None] = mapped_column(String(64), default=None)  # sha256 of the source
    quantization: Mapped[str] = mapped_column(String(16), default="none")
    quantize_lm_head: Mapped[bool] = mapped_column(default=False, server_default=false())
    targets: Mapped[list[Any]] = mapped_column(default=list)
    parent_id: Mapped[int | None] = mapped_column(
        ForeignKey("model_versions.id", ondelete="SET NULL"), default=None, index=True
    )
    # `metadata` is taken by the declarative base, hence the attribute name.
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    created_by: Mapped[str] = mapped_column(String(100))

    model: Mapped[Model] = relationship()
    parent: Mapped[ModelVersion | None] = relationship(remote_side=[id])
    artifacts: Mapped[list[Artifact]] = relationship(
        back_populates="version", cascade="all, delete-orphan", order_by="Artifact.id"
    )


class Artifact(Base):
    """One converted artifact of a version for one target, as reported in the ModelVersion's status."""

    __tablename__ = "artifacts"
    __table_args__ = (
        UniqueConstraint("version_id", "accelerator", "format", "dtype", name="uq_artifacts_target"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="CASCADE"), index=True)
    accelerator: Mapped[str] = mapped_column(String(32))
    format: Mapped[str] = mapped_column(String(32))
    dtype: Mapped[str] = mapped_column(String(16))
    uri: Mapped[str] = mapped_column(Text, default="")
    sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    size_bytes: Mapped[int | None] = mapped_column(BigInteger, default=None)
    validation: Mapped[dict[str, Any]] = mapped_column(default=dict)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    version: Mapped[ModelVersion] = relationship(back_populates="artifacts")


class Rollout(Base):
    """One change of a model's traffic split: who, when, from which weights to which, and why."""

    __tablename__ = "rollouts"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    action: Mapped[str] = mapped_column(String(16))  # create | traffic | promote | rollback
    from_weights: Mapped[list[Any]] = mapped_column(default=list)
    to_weights: Mapped[list[Any]] = mapped_column(default=list)
    reason: Mapped[str] = mapped_column(Text, default="")
    actor: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    state: Mapped[str] = mapped_column(String(16), default="applied")  # applied | rolled_back
    version: Mapped[int] = mapped_column(Integer, nullable=False)

    __mapper_args__ = {"version_id_col": version}


class AuditEvent(Base):
    """A mutating call. Tenant and target are kept by name so the trail outlives what it describes."""

    __tablename__ = "audit_events"
    __table_args__ = (Index("ix_audit_events_tenant_at", "tenant", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    actor: Mapped[str] = mapped_column(String(100))
    tenant: Mapped[str | None] = mapped_column(String(63), default=None)
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(300))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
