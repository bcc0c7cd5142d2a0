"""engine tasks: `engine_task`, the chunk tasks of a job split over engine workers (issue 37)

A row per chunk of a job whose `resources.engine` runs the target's work on engine workers: the chunk
(kind, index, the trainer's stream generation), its Celery task, the worker that runs it and its GPUs,
its lease (heartbeat, expiry: a lost chunk is sent again), attempts, tokens and seconds.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28 18:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "engine_task",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("celery_task_id", sa.String(length=64), nullable=True),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["job.id"], name=op.f("fk_engine_task_job_id_job"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_engine_task")),
        sa.UniqueConstraint("job_id", "kind", "index", name="uq_engine_task_job_id_kind_index"),
    )
    with op.batch_alter_table("engine_task", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_engine_task_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("engine_task", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_engine_task_job_id"))
    op.drop_table("engine_task")
