"""Initial schema: tenants, API keys, models, versions, artifacts, rollouts, audit events.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _when(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(63), nullable=False, unique=True),
        sa.Column("namespace", sa.String(63), nullable=False, unique=True),
        sa.Column("gpu_quota", sa.Integer(), nullable=False),
        sa.Column("token_rate_limit", sa.Integer(), nullable=False),
        sa.Column("allowed_models", JSON, nullable=False),
        _when("created_at"),
        _when("updated_at"),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False, unique=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        _when("created_at"),
        sa.Column("created_by", sa.String(100), nullable=False),
        _when("expires_at", nullable=True),
        _when("revoked_at", nullable=True),
    )
    op.create_index("ix_api_keys_tenant_id", "api_keys", ["tenant_id"])
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("tenant_id", sa.Integer(), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("accelerator", sa.String(32), nullable=False),
        sa.Column("gpu_count", sa.Integer(), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=False),
        sa.Column("max_replicas", sa.Integer(), nullable=False),
        sa.Column("sticky_by", sa.String(100), nullable=False),
        sa.Column("loading", sa.String(16), nullable=False),
        sa.Column("traffic", JSON, nullable=False),
        _when("created_at"),
        sa.Column("created_by", sa.String(100), nullable=False),
        _when("updated_at"),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.UniqueConstraint("tenant_id", "name", name="uq_models_tenant_name"),
    )
    op.create_index("ix_models_tenant_id", "models", ["tenant_id"])
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("model_id", sa.Integer(), sa.ForeignKey("models.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(63), nullable=False),
        sa.Column("source_uri", sa.Text(), nullable=False),
        sa.Column("source_format", sa.String(32), nullable=False),
        sa.Column("digest", sa.String(64), nullable=True),
        sa.Column("quantization", sa.String(16), nullable=False),
        sa.Column("targets", JSON, nullable=False),
        sa.Column(
            "parent_id", sa.Integer(), sa.ForeignKey("model_versions.id", ondelete="SET NULL"), nullable=True
        ),
        sa.Column("metadata", JSON, nullable=False),
        _when("created_at"),
        sa.Column("created_by", sa.String(100), nullable=False),
        sa.UniqueConstraint("model_id", "name", name="uq_model_versions_model_name"),
    )
    op.create_index("ix_model_versions_model_id", "model_versions", ["model_id"])
    op.create_index("ix_model_versions_parent_id", "model_versions", ["parent_id"])
    op.create_table(
        "artifacts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column(
            "version_id", sa.Integer(), sa.ForeignKey("model_versions.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("accelerator", sa.String(32), nullable=False),
        sa.Column("format", sa.String(32), nullable=False),
        sa.Column("dtype", sa.String(16), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("validation", JSON, nullable=False),
        _when("updated_at"),
        sa.UniqueConstraint("version_id", "accelerator", "format", "dtype", name="uq_artifacts_target"),
    )
    op.create_index("ix_artifacts_version_id", "artifacts", ["version_id"])
    op.create_table(
        "rollouts",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("model_id", sa.Integer(), sa.ForeignKey("models.id", ondelete="CASCADE"), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("from_weights", JSON, nullable=False),
        sa.Column("to_weights", JSON, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(100), nullable=False),
        _when("created_at"),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
    )
    op.create_index("ix_rollouts_model_id", "rollouts", ["model_id"])
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), primary_key=True),
        _when("at"),
        sa.Column("actor", sa.String(100), nullable=False),
        sa.Column("tenant", sa.String(63), nullable=True),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(300), nullable=False),
        sa.Column("detail", JSON, nullable=False),
    )
    op.create_index("ix_audit_events_tenant_at", "audit_events", ["tenant", "at"])


def downgrade() -> None:
    for table in ("audit_events", "rollouts", "artifacts", "model_versions", "models", "api_keys", "tenants"):
        op.drop_table(table)
