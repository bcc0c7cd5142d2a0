"""promotion decision lease: a retrain child's decision state, so a decision a dead worker left is re-run

`retrain.decision_state` (pending, running, decided), the holder of a running comparison and its lease
(`decision_owner`, `decision_lease_expires_at`), and `decision_attempts`. The reaper re-runs a running
comparison whose lease lapsed, and a pending one whose child succeeded two leases ago; the decision is
stored once (a conditional update to `decided` in the decision's transaction). Existing children that
already have a measured decision are `decided`.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28 18:35:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("retrain", schema=None) as batch_op:
        batch_op.add_column(sa.Column("decision_state", sa.String(length=16), server_default="pending",
                                      nullable=False))
        batch_op.add_column(sa.Column("decision_owner", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("decision_lease_expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("decision_attempts", sa.Integer(), server_default="0", nullable=False))
    op.execute("UPDATE retrain SET decision_state = 'decided' WHERE child_job_id IN "
               "(SELECT job_id FROM promotion_decision WHERE decided_by = 'measurement')")


def downgrade() -> None:
    with op.batch_alter_table("retrain", schema=None) as batch_op:
        batch_op.drop_column("decision_attempts")
        batch_op.drop_column("decision_lease_expires_at")
        batch_op.drop_column("decision_owner")
        batch_op.drop_column("decision_state")
