"""Engine and session factories (no module-level engine: callers build and own them).

    engine = make_engine(settings.resolved_database_url())
    factory = make_session_factory(engine)
    with session_scope(factory) as s:   # commits on success, rolls back on error
        ...
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["make_engine", "make_read_engine", "make_session_factory", "session_scope"]


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def make_engine(url: str, **kwargs: Any) -> sa.Engine:
    """A SQLAlchemy engine for `url` (SQLite: WAL, foreign keys, busy timeout; folder created).

    Args:
        url: SQLAlchemy URL, e.g. `sqlite:////abs/peagle.db` or `postgresql+psycopg://u@h/db`.
        **kwargs: passed to `sqlalchemy.create_engine` (e.g. `pool_size`).
    """
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        if not parsed.database or parsed.database == ":memory:":  # one connection per thread: no queue to size
            for name in ("pool_size", "max_overflow", "pool_timeout"):
                kwargs.pop(name, None)
        kwargs.setdefault("connect_args", {"check_same_thread": False, "timeout": 30})
        engine = sa.create_engine(url, **kwargs)
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    # Keep as many idle connections as the API has request threads (api.main.THREADS = 24): connections
    # beyond pool_size are closed when returned, and reopening one per request under load (a new
    # PostgreSQL backend each time) cost more than the request itself.
    kwargs.setdefault("pool_size", 28)
    kwargs.setdefault("max_overflow", 8)
    return sa.create_engine(url, **kwargs)


def make_read_engine(engine: sa.Engine) -> sa.Engine:
    """`engine` (same pool) in autocommit mode, for read-only requests.

    A plain session sends BEGIN before its first query and ROLLBACK when it is closed: two extra round
    trips around a one-query read. In autocommit mode (client-side in psycopg 3 and pysqlite) a
    read is one round trip. Only for handlers that write nothing.
    """
    return engine.execution_options(isolation_level="AUTOCOMMIT")


def make_session_factory(engine: sa.Engine) -> sessionmaker[Session]:
    """Session factory bound to `engine` (objects stay usable after commit)."""
    return sessionmaker(bind=engine, expire_on_commit=False, autoflush=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session that commits on success and rolls back on any exception."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
