"""checkpoint evaluation: what the run's evaluation measured on a checkpoint (issue 18)

`checkpoint.evaluation` (JSON, nullable): the engine that measured AL, AL per prompt set with the
per-request spread, the measured serving speedup in vLLM (verifier alone vs with the draft, per K and batch
size, the hardware it ran on, the recommended K per batch size). Existing rows stay NULL (not evaluated).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25 21:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoint", schema=None) as batch_op:
        batch_op.add_column(sa.Column("evaluation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoint", schema=None) as batch_op:
        batch_op.drop_column("evaluation")
