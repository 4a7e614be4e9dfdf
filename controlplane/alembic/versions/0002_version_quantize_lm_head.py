"""Versions record quantize_lm_head (the ModelVersion's quantizeLmHead): an artifact with a quantized lm_head
is another artifact, so the registry keeps which one a version asked for. Existing versions: false.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:  # SQLite alters a table by copying it
        column = sa.Column("quantize_lm_head", sa.Boolean(), nullable=False, server_default=sa.false())
        batch.add_column(column)


def downgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("quantize_lm_head")
