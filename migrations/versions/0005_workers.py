"""workers: each running worker announces its queues and GPUs with a heartbeat (issue 39)

`worker` (one row per running worker, keyed by its Celery node name): `queues` (JSON list), `gpus`,
`started_at`, `heartbeat_at`. The API refuses a job that no live worker consumes the queue of, or none
with that many GPUs (`service.db.workers`).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-28 15:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "worker",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_worker")),
    )


def downgrade() -> None:
    op.drop_table("worker")
