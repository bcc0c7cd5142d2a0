"""security: server-side browser sessions (auth_session); webhook secrets encrypted at rest

Webhook secrets: the column widens to hold `enc1:<kid>:<ciphertext>` (service/crypto.py). Existing
plaintext secrets are encrypted here when `PEAGLE_SECRET_KEY` (the environment the service runs with, as
for the database URL) is set and strong enough; otherwise they stay as they are, still work, and are
re-encrypted when the dispatcher next reads them or by `python -m api.admin reencrypt-webhook-secrets`
(docs/service.md, "Secrets"). Downgrade decrypts them again (it needs the same key).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 04:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _box(strict: bool):  # type: ignore[no-untyped-def]
    import os

    from service.db.webhooks import secret_box
    from service.settings import DEFAULT_SECRET_KEY, MIN_SECRET_KEY_CHARS, get_settings

    key = os.environ.get("PEAGLE_SECRET_KEY", "")
    if not strict and (not key or key == DEFAULT_SECRET_KEY or len(key) < MIN_SECRET_KEY_CHARS):
        return None
    return secret_box(get_settings())


def upgrade() -> None:
    op.create_table(
        "auth_session",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["key_id"], ["api_key.id"], name=op.f("fk_auth_session_key_id_api_key"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_auth_session")),
    )
    with op.batch_alter_table("auth_session", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_auth_session_key_id"), ["key_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_auth_session_expires_at"), ["expires_at"], unique=False)
    with op.batch_alter_table("webhook_endpoint", schema=None) as batch_op:
        batch_op.alter_column("secret", existing_type=sa.String(length=100), type_=sa.String(length=255),
                              existing_nullable=False)
    box = _box(strict=False)
    if box is None:
        return
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, secret FROM webhook_endpoint")).all()
    for wid, secret in rows:
        if box.needs_rewrap(secret):
            plain = box.decrypt(secret, aad=str(wid).encode())
            conn.execute(sa.text("UPDATE webhook_endpoint SET secret = :s WHERE id = :i"),
                         {"s": box.encrypt(plain, aad=str(wid).encode()), "i": wid})


def downgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id, secret FROM webhook_endpoint")).all()
    if rows:
        box = _box(strict=True)
        for wid, secret in rows:
            conn.execute(sa.text("UPDATE webhook_endpoint SET secret = :s WHERE id = :i"),
                         {"s": box.decrypt(secret, aad=str(wid).encode()), "i": wid})
    with op.batch_alter_table("webhook_endpoint", schema=None) as batch_op:
        batch_op.alter_column("secret", existing_type=sa.String(length=255), type_=sa.String(length=100),
                              existing_nullable=False)
    with op.batch_alter_table("auth_session", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_auth_session_expires_at"))
        batch_op.drop_index(batch_op.f("ix_auth_session_key_id"))
    op.drop_table("auth_session")
