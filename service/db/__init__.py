"""Database layer: models (`models`), engine/sessions (`session`), state machine (`states`), queries (`repo`).

The schema is created only by Alembic migrations (`migrations/`, `alembic.ini` at the repo root):
`upgrade(url)` runs them programmatically (tests, embedded startup); `alembic upgrade head` does the same
from the shell with the URL from `service.settings.get_settings()`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["alembic_config", "downgrade", "upgrade"]

_ROOT = Path(__file__).resolve().parents[2]


def alembic_config(url: str):
    """Alembic `Config` for the repo's `alembic.ini` with the database `url`."""
    from alembic.config import Config

    cfg = Config(str(_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(_ROOT / "migrations"))
    cfg.attributes["url"] = url
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision`."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision`."""
    from alembic import command

    command.downgrade(alembic_config(url), revision)
