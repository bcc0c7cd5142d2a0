"""draft uploads: `draft_upload`, the owner's uploaded draft checkpoints for warm starts (issue 38)

A row per archive of a speculators-format export folder (`POST /v1/drafts`): where it was unpacked, its size
and sha256, `ready` or `invalid`, and the export validator's report. A job names one as
`draft.init_from: draft:<id>`.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 18:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "draft_upload",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("owner_id", sa.Integer(), nullable=False),
        sa.Column("filename", sa.String(length=512), nullable=False),
        sa.Column("path", sa.String(length=1024), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["owner_id"], ["owner.id"], name=op.f("fk_draft_upload_owner_id_owner"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_draft_upload")),
    )
    with op.batch_alter_table("draft_upload", schema=None) as batch_op:
        batch_op.create_index("ix_draft_upload_owner_id_id", ["owner_id", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("draft_upload", schema=None) as batch_op:
        batch_op.drop_index("ix_draft_upload_owner_id_id")
    op.drop_table("draft_upload")
