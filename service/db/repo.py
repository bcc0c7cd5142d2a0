"""Database operations of the API (sync SQLAlchemy 2; FastAPI runs them in its threadpool).

Keys: `peagle_<prefix>_<secret>`; the prefix (16 hex chars) is the unique lookup column and only
sha256(whole key) is stored, compared in constant time.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import orjson
import sqlalchemy as sa
from sqlalchemy.orm import Session

from service.db import states
from service.db.events import add_event
from service.db.models import ApiKey, Checkpoint, Dataset, Job, JobEvent, JobLog, JobMetric, Owner, utcnow

__all__ = [
    "SCOPES",
    "JobPageQuery",
    "Principal",
    "add_job_event",
    "authenticate",
    "create_key",
    "get_or_create_owner",
    "hash_key",
    "job_page",
    "job_page_select",
    "jobs_using_dataset",
    "list_jobs",
    "owner_counts",
    "queue_ahead",
    "read_rows",
]

SCOPES = ("read", "write", "admin")
_IMPLIED = {"admin": {"read", "write", "admin"}, "write": {"read", "write"}, "read": {"read"}}
ROW_MODELS: dict[str, Any] = {"events": JobEvent, "metrics": JobMetric, "logs": JobLog}
_UNFINISHED = tuple(sorted(set(states.ALL_STATES) - set(states.TERMINAL)))
SEQ_COLUMNS = {"events": "event_seq", "metrics": "metric_seq", "logs": "log_seq"}
DATASET_READY, DATASET_INVALID = "ready", "invalid"  # `Dataset.status` after validation


@dataclass(frozen=True)
class Principal:
    """Who is calling: owner id/name, key id and the effective scopes."""

    owner_id: int
    owner_name: str
    key_id: int
    scopes: frozenset[str]

    def has(self, scope: str) -> bool:
        return scope in self.scopes


def hash_key(key: str) -> str:
    """sha256 hex of a whole API key (keys carry 256 random bits, so a fast hash is enough)."""
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_owner(session: Session, name: str) -> Owner:
    """The owner called `name`, created if missing."""
    owner = session.scalar(sa.select(Owner).where(Owner.name == name))
    if owner is None:
        owner = Owner(name=name)
        session.add(owner)
        session.flush()
    return owner


def create_key(session: Session, owner_name: str, scopes: list[str], name: str = "") -> tuple[ApiKey, str]:
    """Create a key for `owner_name` (owner created if missing). Returns (row, secret shown once)."""
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        raise ValueError(f"scopes must be a non-empty subset of {list(SCOPES)}, got {scopes}")
    owner = get_or_create_owner(session, owner_name)
    prefix = secrets.token_hex(8)
    secret = f"peagle_{prefix}_{secrets.token_urlsafe(32)}"
    row = ApiKey(owner_id=owner.id, name=name, prefix=prefix, secret_hash=hash_key(secret), scopes=sorted(scopes))
    session.add(row)
    session.flush()
    return row, secret


def parse_key(key: str) -> str | None:
    """The prefix of a well-formed key, else None."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != "peagle" or len(parts[1]) != 16:
        return None
    return parts[1]


def authenticate(session: Session, key: str, *, touch_after_s: float = 60.0) -> Principal | None:
    """Principal for a presented key, or None (unknown, malformed, wrong secret or revoked)."""
    prefix = parse_key(key)
    if prefix is None:
        return None
    row = session.scalar(sa.select(ApiKey).where(ApiKey.prefix == prefix))
    if row is None or row.revoked_at is not None:
        return None
    if not hmac.compare_digest(row.secret_hash, hash_key(key)):
        return None
    now = utcnow()
    if row.last_used_at is None or (now - row.last_used_at).total_seconds() > touch_after_s:
        session.execute(sa.update(ApiKey).where(ApiKey.id == row.id).values(last_used_at=now))
        session.commit()
    scopes: set[str] = set()
    for s in row.scopes or []:
        scopes |= _IMPLIED.get(s, set())
    return Principal(row.owner_id, row.owner.name, row.id, frozenset(scopes))


def revoke_key(session: Session, prefix: str) -> bool:
    """Revoke the key with `prefix`; False if there is none."""
    res = session.execute(
        sa.update(ApiKey).where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None)).values(revoked_at=utcnow())
    )
    return bool(cast("sa.CursorResult[Any]", res).rowcount)  # an UPDATE answers with a CursorResult


def get_job(session: Session, owner_id: int, job_id: str, *, lock: bool = False) -> Job | None:
    """The owner's job (None for another owner's job: the API answers 404 for both)."""
    q = sa.select(Job).where(Job.id == job_id, Job.owner_id == owner_id)
    if lock:
        q = q.with_for_update()
    return session.scalar(q)


def owner_counts(session: Session, owner_id: int, *, cap: int | None = None) -> dict[str, int]:
    """Number of the owner's jobs per status (non-terminal ones only).

    With `cap`, at most `cap` jobs are counted in all (a quota check only needs to know whether a limit
    is reached, and counting stays bounded however many jobs an owner has queued).
    """
    where = sa.and_(Job.owner_id == owner_id, Job.status.in_(_UNFINISHED))  # IN: range scan of ix_job_owner_id_status
    if cap is None:
        stmt = sa.select(Job.status, sa.func.count()).where(where).group_by(Job.status)
    else:
        sub = sa.select(Job.status).where(where).limit(cap).subquery()
        stmt = sa.select(sub.c.status, sa.func.count()).group_by(sub.c.status)
    return {status: n for status, n in session.execute(stmt).all()}


def queue_ahead(session: Session, queue: str, job_id: str | None = None) -> tuple[int, int]:
    """(running, queued) on `queue` ahead of `job_id`: the jobs its workers run now (`states.ACTIVE`: they
    end before a worker is free) and those queued before it (every queued job when `job_id` is None)."""
    queued = sa.select(sa.func.count()).select_from(Job).where(Job.status == states.QUEUED, Job.queue == queue)
    if job_id is not None:
        queued = queued.where(Job.id < job_id)
    running = sa.select(sa.func.count()).select_from(Job).where(Job.status.in_(states.ACTIVE), Job.queue == queue)
    return int(session.scalar(running) or 0), int(session.scalar(queued) or 0)


def queue_position(session: Session, queue: str, job_id: str | None = None) -> int:
    """Jobs ahead of `job_id` on `queue`, running ones included (`queue_ahead`): 0 = the next free worker
    of the queue takes it. Counting only queued jobs showed 0 while the only worker was busy."""
    return sum(queue_ahead(session, queue, job_id))


def add_job_event(
    session: Session, job: Job, kind: str, message: str, *, data: dict[str, Any] | None = None
) -> int:
    """Append one API-side event to `job` (at its attempt and phase); returns its seq (`job.event_seq`)."""
    seq = add_event(session, job.id, kind=kind, message=message, attempt=job.attempt, phase=job.phase, data=data)
    job.event_seq = seq
    return seq


#: The columns a job in a list shows (`api.schemas.job_public(row, full=False)` reads exactly these).
SUMMARY_COLUMNS = ("id", "name", "tags", "status", "phase", "desired_state", "progress", "attempt", "queue",
                   "error_code", "error_message", "error_retryable", "best_checkpoint_step",
                   "latest_checkpoint_step", "created_at", "queued_at", "started_at", "finished_at", "updated_at")
_JSON_SUMMARY_COLUMNS = ("tags", "progress")


@dataclass(frozen=True)
class JobPageQuery:
    """One page of `GET /v1/jobs`: the owner, the cursor (`after` = last id of the previous page), filters.

    `shape()` says which filters are present; `job_page_select(dialect, shape)` is the statement for that
    shape with named bind parameters, and `params()` their values. So the SQL is built (and, for the
    async PostgreSQL reader in `service.db.aio`, compiled) once per shape, never per request.
    """

    owner_id: int
    after: str | None = None
    limit: int = 20
    statuses: tuple[str, ...] = ()
    tag: str | None = None
    created_after: datetime | None = None
    q: str | None = None

    def shape(self) -> tuple[bool, int, bool, bool, bool]:
        return (bool(self.after), len(self.statuses), bool(self.tag), self.created_after is not None,
                bool(self.q))

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"owner_id": self.owner_id, "limit": self.limit + 1}  # +1: is there more?
        if self.after:
            out["after"] = self.after
        for i, status in enumerate(self.statuses):
            out[f"status_{i}"] = status
        if self.tag:
            out["tag"] = self.tag
        if self.created_after is not None:
            at = self.created_after
            out["created_after"] = at.replace(tzinfo=UTC) if at.tzinfo is None else at
        if self.q:
            escaped = self.q.replace("/", "//").replace("%", "/%").replace("_", "/_")
            out["q"] = f"%{escaped}%"  # a substring, wildcards in q matched literally
        return out


def _tag_filter(dialect: str) -> sa.ColumnElement[bool]:
    tag = sa.bindparam("tag", type_=sa.String)
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import JSONB

        return sa.cast(Job.tags, JSONB).contains(sa.func.jsonb_build_array(tag))
    each = sa.func.json_each(Job.tags).table_valued("value")
    return sa.exists(sa.select(1).select_from(each).where(each.c.value == tag))


@functools.cache
def job_page_select(dialect: str, shape: tuple[bool, int, bool, bool, bool]) -> sa.Select[Any]:
    """The page query for `dialect` and a `JobPageQuery.shape()`; bind parameters named as in `params()`.

    JSON columns come back as text for `job_page` to parse: the drivers' stdlib `json.loads` per cell
    was a third of the query's CPU.
    """
    after, n_statuses, tag, created_after, q = shape
    cols = Job.__table__.c
    stmt = sa.select(*(sa.cast(cols[n], sa.Text).label(n) if n in _JSON_SUMMARY_COLUMNS else cols[n]
                       for n in SUMMARY_COLUMNS)).where(Job.owner_id == sa.bindparam("owner_id"))
    if after:
        stmt = stmt.where(Job.id < sa.bindparam("after"))
    if n_statuses:
        stmt = stmt.where(Job.status.in_([sa.bindparam(f"status_{i}") for i in range(n_statuses)]))
    if tag:
        stmt = stmt.where(_tag_filter(dialect))
    if created_after:
        stmt = stmt.where(Job.created_at > sa.bindparam("created_after"))
    if q:
        stmt = stmt.where(Job.name.ilike(sa.bindparam("q", type_=sa.String), escape="/"))
    return stmt.order_by(Job.id.desc()).limit(sa.bindparam("limit", type_=sa.Integer))


def _loads(text: str | None) -> Any:
    """orjson's parse, or the stdlib's for what orjson refuses (NaN, lone surrogates); NULL stays None.

    (orjson reads integers beyond 64 bits as floats: fine for tags and progress, not for specs.)
    """
    if text is None:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def job_page(rows: Sequence[Sequence[Any]], limit: int) -> tuple[list[dict[str, Any]], bool]:
    """Rows of `job_page_select` (at most limit + 1) -> (the page as dicts, has_more)."""
    out = []
    for r in rows[:limit]:
        row = dict(zip(SUMMARY_COLUMNS, r, strict=True))
        row["tags"], row["progress"] = _loads(row["tags"]), _loads(row["progress"])
        out.append(row)
    return out, len(rows) > limit


def list_jobs(conn: sa.Connection, query: JobPageQuery) -> tuple[list[dict[str, Any]], bool]:
    """A page of the owner's jobs (the `SUMMARY_COLUMNS` only, as dicts), newest first, and has_more.

    A Core connection, not a Session: the list needs none of the ORM's unit of work, which cost more
    CPU than the query. (On PostgreSQL the API reads pages with `service.db.aio.list_jobs` instead.)
    """
    rows = conn.execute(job_page_select(conn.dialect.name, query.shape()), query.params()).all()
    return job_page(rows, query.limit)


def read_rows(
    session: Session,
    kind: str,
    job_id: str,
    *,
    after: int = 0,
    limit: int = 500,
    step_from: int | None = None,
    step_to: int | None = None,
) -> list[Any]:
    """Rows of `kind` (`events|metrics|logs`) with seq > `after`, ascending, at most `limit`."""
    model = ROW_MODELS[kind]
    stmt = sa.select(model).where(model.job_id == job_id, model.seq > after)
    if kind == "metrics":
        if step_from is not None:
            stmt = stmt.where(model.step >= step_from)
        if step_to is not None:
            stmt = stmt.where(model.step <= step_to)
    return list(session.scalars(stmt.order_by(model.seq).limit(limit)))


def metric_outline(
    session: Session,
    job_id: str,
    key: str,
    *,
    after: int = 0,
    limit: int = 10_000,
    step_from: int | None = None,
    step_to: int | None = None,
) -> list[tuple[int, float | None]]:
    """(seq, values[key]) of metric rows, ascending: a cheap first pass for downsampling.

    Reads two columns (the JSON value is extracted by the database), not whole rows, so thinning
    50,000 points does not deserialize 50,000 JSON documents.
    """
    stmt = sa.select(JobMetric.seq, JobMetric.values[key].as_float()).where(
        JobMetric.job_id == job_id, JobMetric.seq > after
    )
    if step_from is not None:
        stmt = stmt.where(JobMetric.step >= step_from)
    if step_to is not None:
        stmt = stmt.where(JobMetric.step <= step_to)
    return [(int(s), v) for s, v in session.execute(stmt.order_by(JobMetric.seq).limit(limit))]


def metrics_by_seq(session: Session, job_id: str, seqs: list[int]) -> list[JobMetric]:
    """Metric rows with the given sequence numbers, ascending."""
    out: list[JobMetric] = []
    for i in range(0, len(seqs), 5000):
        chunk = seqs[i : i + 5000]
        out.extend(
            session.scalars(sa.select(JobMetric).where(JobMetric.job_id == job_id, JobMetric.seq.in_(chunk)))
        )
    return sorted(out, key=lambda r: r.seq)


def tail_logs(session: Session, job_id: str, n: int) -> list[JobLog]:
    """The last `n` log lines, ascending."""
    rows = session.scalars(
        sa.select(JobLog).where(JobLog.job_id == job_id).order_by(JobLog.seq.desc()).limit(n)
    ).all()
    return list(reversed(rows))


def list_checkpoints(session: Session, job_id: str) -> list[Checkpoint]:
    """Complete checkpoints of a job, ascending by step."""
    return list(
        session.scalars(
            sa.select(Checkpoint).where(Checkpoint.job_id == job_id, Checkpoint.complete.is_(True))
            .order_by(Checkpoint.step)
        )
    )


def get_checkpoint(session: Session, job_id: str, step: int) -> Checkpoint | None:
    """A complete checkpoint of a job by step."""
    return session.scalar(
        sa.select(Checkpoint).where(
            Checkpoint.job_id == job_id, Checkpoint.step == step, Checkpoint.complete.is_(True)
        )
    )


def owner_upload_bytes(session: Session, owner_id: int) -> int:
    """Total bytes of the owner's uploaded datasets, those that failed validation aside (their file is not kept)."""
    return int(session.scalar(sa.select(sa.func.coalesce(sa.func.sum(Dataset.size), 0))
                              .where(Dataset.owner_id == owner_id, Dataset.status != DATASET_INVALID)) or 0)


def jobs_using_dataset(session: Session, *, owner_id: int, ref: str) -> list[str]:
    """Ids of the owner's unfinished jobs whose spec names `ref` (`dataset:<id>`) anywhere.

    Scans only jobs not yet terminal (bounded by the owner's queue quota); the spec is JSON on both
    databases, so the match is on its text.
    """
    specs = session.execute(sa.select(Job.id, Job.spec).where(Job.owner_id == owner_id,
                                                              Job.status.in_(_UNFINISHED))).all()
    return [jid for jid, spec in specs if ref in json.dumps(spec)]


def list_datasets(session: Session, owner_id: int, after: str | None, limit: int) -> tuple[list[Dataset], bool]:
    """A page of the owner's datasets, newest first."""
    stmt = sa.select(Dataset).where(Dataset.owner_id == owner_id)
    if after:
        stmt = stmt.where(Dataset.id < after)
    rows = list(session.scalars(stmt.order_by(Dataset.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
