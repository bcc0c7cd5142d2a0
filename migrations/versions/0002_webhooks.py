"""webhooks: endpoints, deliveries, and the per-job fan-out cursor (job.webhook_seq)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 12:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.add_column(sa.Column("webhook_seq", sa.Integer(), server_default="0", nullable=False))
    op.create_table(
        "webhook_endpoint",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("description", sa.String(length=500), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("secret", sa.String(length=100), nullable=False),
        sa.Column("start_event_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["owner_id"], ["owner.id"], name=op.f("fk_webhook_endpoint_owner_id_owner"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_endpoint")),
    )
    with op.batch_alter_table("webhook_endpoint", schema=None) as batch_op:
        batch_op.create_index("ix_webhook_endpoint_owner_id_id", ["owner_id", "id"], unique=False)
    op.create_table(
        "webhook_delivery",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("endpoint_id", sa.String(length=40), nullable=False),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.Integer(), nullable=True),
        sa.Column("job_id", sa.String(length=40), nullable=True),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["endpoint_id"], ["webhook_endpoint.id"], name=op.f("fk_webhook_delivery_endpoint_id_webhook_endpoint"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_delivery")),
        sa.UniqueConstraint("endpoint_id", "event_id", "event_type", name="uq_webhook_delivery_endpoint_event"),
    )
    with op.batch_alter_table("webhook_delivery", schema=None) as batch_op:
        batch_op.create_index("ix_webhook_delivery_status_next_attempt_at", ["status", "next_attempt_at"],
                              unique=False)
        batch_op.create_index("ix_webhook_delivery_endpoint_id_id", ["endpoint_id", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("webhook_delivery", schema=None) as batch_op:
        batch_op.drop_index("ix_webhook_delivery_endpoint_id_id")
        batch_op.drop_index("ix_webhook_delivery_status_next_attempt_at")
    op.drop_table("webhook_delivery")
    with op.batch_alter_table("webhook_endpoint", schema=None) as batch_op:
        batch_op.drop_index("ix_webhook_endpoint_owner_id_id")
    op.drop_table("webhook_endpoint")
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_column("webhook_seq")
