"""promotion: retrain children, the current draft per owner and target, and the decisions log (issue 38)

`retrain` (one row per retrain child: its parent, the owner, the target, the batch sizes named for its
promotion), `current_draft` (per owner and target: the job and checkpoint that is current, the decision that
set it) and `promotion_decision` (measured, forced and undone decisions with both sides' numbers).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28 17:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "retrain",
        sa.Column("child_job_id", sa.String(length=40), nullable=False),
        sa.Column("parent_job_id", sa.String(length=40), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("batch_sizes", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["child_job_id"], ["job.id"], name=op.f("fk_retrain_child_job_id_job"),
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["owner_id"], ["owner.id"], name=op.f("fk_retrain_owner_id_owner"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("child_job_id", name=op.f("pk_retrain")),
    )
    with op.batch_alter_table("retrain", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_retrain_owner_id"), ["owner_id"], unique=False)
    op.create_table(
        "current_draft",
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("checkpoint_step", sa.Integer(), nullable=True),
        sa.Column("decision_id", sa.String(length=40), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["owner_id"], ["owner.id"], name=op.f("fk_current_draft_owner_id_owner"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("owner_id", "target", name=op.f("pk_current_draft")),
    )
    op.create_table(
        "promotion_decision",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("target", sa.String(length=512), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("compared_with", sa.String(length=40), nullable=True),
        sa.Column("current_before", sa.String(length=40), nullable=True),
        sa.Column("current_after", sa.String(length=40), nullable=True),
        sa.Column("decision", sa.String(length=16), nullable=False),
        sa.Column("forced", sa.Boolean(), nullable=False),
        sa.Column("decided_by", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("batch_sizes", sa.JSON(), nullable=False),
        sa.Column("numbers", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["owner_id"], ["owner.id"], name=op.f("fk_promotion_decision_owner_id_owner"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_promotion_decision")),
    )
    with op.batch_alter_table("promotion_decision", schema=None) as batch_op:
        batch_op.create_index("ix_promotion_decision_owner_id_target_id", ["owner_id", "target", "id"], unique=False)
        batch_op.create_index(batch_op.f("ix_promotion_decision_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("promotion_decision", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_promotion_decision_job_id"))
        batch_op.drop_index("ix_promotion_decision_owner_id_target_id")
    op.drop_table("promotion_decision")
    op.drop_table("current_draft")
    with op.batch_alter_table("retrain", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_retrain_owner_id"))
    op.drop_table("retrain")
