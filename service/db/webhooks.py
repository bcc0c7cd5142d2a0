"""Webhooks in the database: endpoints, fan-out of job events to deliveries, retry state, signing.

Deliveries are derived from the job event log. Each job row carries `webhook_seq`, the last of its
events already fanned out; `fan_out` turns the events after it into `webhook_delivery` rows for the
owner's subscribed endpoints and advances the cursor with a conditional UPDATE, in one transaction.
Within one job, events are committed in `seq` order (their seq is reserved by an UPDATE of the job row,
which serialises writers), so a per-job cursor never skips an event. Endpoints only get events newer
than themselves (`start_event_id`). Several dispatchers may run at once: the cursor UPDATE and the
unique `(endpoint_id, event_id, event_type)` make the fan-out happen once, and a delivery is claimed
by moving its `next_attempt_at` forward conditionally before it is sent.

Signing follows Standard Webhooks (https://www.standardwebhooks.com): headers `webhook-id`,
`webhook-timestamp` (unix seconds) and `webhook-signature: v1,<base64 HMAC-SHA256 of
"{id}.{timestamp}.{body}">`, keyed by the base64-decoded part of the `whsec_...` secret.

Secrets are stored encrypted (`secret_box`: AES-GCM under a key HKDF-derived from `secret_key`, bound to
the endpoint id); plaintext rows from before migration 0003, and rows under `secret_key_previous`, are
re-encrypted under the current key when `claim_due` reads them.

No FastAPI and no HTTP client here (the worker's dispatcher does the sending).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.crypto import SecretBox, SecretError
from service.db import states
from service.db.models import Job, JobEvent, WebhookDelivery, WebhookEndpoint, new_id, utcnow
from service.settings import Settings

__all__ = [
    "EVENT_TYPES",
    "Claimed",
    "claim_due",
    "delivery_out",
    "endpoint_out",
    "event_types_for",
    "fan_out",
    "new_secret",
    "record_attempt",
    "retry_delay",
    "rewrap_secrets",
    "seal",
    "secret_box",
    "sign",
    "test_send_wait",
]

#: Event types an endpoint can subscribe to.
EVENT_TYPES = {
    "job.status_changed": "Every status change (queued, running, pausing, paused, cancelling, ...).",
    "job.succeeded": "The job finished successfully.",
    "job.failed": "The job failed (error code and message included).",
    "job.cancelled": "The job was cancelled.",
    "job.checkpoint_saved": "A complete checkpoint was saved (step, best flag, metrics, URL).",
    "draft.promoted": "A job became the current draft of its target (measured, or forced by the owner).",
    "draft.promotion_declined": "A retrained draft was not promoted (it did not beat the current one, or was "
    "not measured); both sets of numbers are on the decision.",
    "draft.promotion_undone": "The owner undid a promotion: the draft before it is current again.",
}
#: The webhook event of a `promotion` job event's decision (`service.db.promotion`).
_PROMOTION_TYPE = {"promoted": "draft.promoted", "forced": "draft.promoted", "declined": "draft.promotion_declined",
                   "not_measured": "draft.promotion_declined", "undone": "draft.promotion_undone"}
TEST_EVENT = "webhook.test"
PENDING, SUCCEEDED, FAILED = "pending", "succeeded", "failed"
_TERMINAL_TYPE = {states.SUCCEEDED: "job.succeeded", states.FAILED: "job.failed",
                  states.CANCELLED: "job.cancelled"}


def new_secret() -> str:
    """A fresh signing secret: `whsec_` + base64 of 24 random bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def secret_box(settings: Settings) -> SecretBox:
    """The box that encrypts webhook secrets (current key; `secret_key_previous` accepted for reading)."""
    return SecretBox(settings.secret_key, [settings.secret_key_previous], info=b"peagle webhook secret v1")


def seal(box: SecretBox, endpoint_id: str, secret: str) -> str:
    """The stored form of `secret` for endpoint `endpoint_id`."""
    return box.encrypt(secret, aad=endpoint_id.encode())


def rewrap_secrets(session: Session, box: SecretBox) -> int:
    """Re-encrypt every plaintext or old-key secret under the current key (commits); returns how many."""
    rows = session.execute(sa.select(WebhookEndpoint.id, WebhookEndpoint.secret)).all()
    done = 0
    for wid, stored in rows:
        done += _rewrap(session, box, str(wid), str(stored))
    session.commit()
    return done


def _rewrap(session: Session, box: SecretBox, wid: str, stored: str) -> int:
    if not box.needs_rewrap(stored):
        return 0
    fresh = seal(box, wid, box.decrypt(stored, aad=wid.encode()))
    res = session.execute(sa.update(WebhookEndpoint).where(WebhookEndpoint.id == wid, WebhookEndpoint.secret == stored)
                          .values(secret=fresh).execution_options(synchronize_session=False))
    return int(getattr(res, "rowcount", 0) or 0)


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value (`v1,<base64 HMAC-SHA256>`) of one message."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def retry_delay(attempts: int, base: float, cap: float = 3600.0) -> float:
    """Seconds before attempt `attempts + 1`: base, 4*base, 16*base, ... capped at `cap`."""
    return float(min(cap, base * 4 ** max(0, attempts - 1)))


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat().replace("+00:00", "Z")


def event_types_for(ev: JobEvent) -> list[tuple[str, dict[str, Any]]]:
    """The webhook (type, data) pairs one job event gives (none for most progress events)."""
    data = ev.data or {}
    status = data.get("status") if isinstance(data.get("status"), str) else None
    if status is None and ev.kind == "started":
        status = states.RUNNING
    out: list[tuple[str, dict[str, Any]]] = []
    if status is not None:
        body: dict[str, Any] = {"status": status, "message": ev.message}
        if isinstance(data.get("previous"), str):
            body["previous"] = data["previous"]
        out.append(("job.status_changed", body))
        if status in _TERMINAL_TYPE:
            out.append((_TERMINAL_TYPE[status], dict(body)))
    if ev.kind == "checkpoint" and isinstance(data.get("step"), int):
        step = int(data["step"])
        out.append(("job.checkpoint_saved", {
            "step": step, "is_best": bool(data.get("is_best")),
            "metrics": data.get("metrics") if isinstance(data.get("metrics"), dict) else {},
            "url": f"/v1/jobs/{ev.job_id}/checkpoints/{step}", "message": ev.message}))
    if ev.kind == "promotion" and data.get("decision") in _PROMOTION_TYPE:
        out.append((_PROMOTION_TYPE[str(data["decision"])], {
            "message": ev.message, "url": f"/v1/promotion/decisions?job_id={ev.job_id}",
            **{k: data.get(k) for k in ("decision", "decision_id", "target", "compared_with", "current_before",
                                        "current_after", "forced", "reason", "batch_sizes")}}))
    return out


def fan_out(session: Session, *, limit: int = 200) -> int:
    """Turn new job events into deliveries (one transaction per job); returns deliveries created.

    Commits itself (one job at a time) so a conflict with another dispatcher only rolls back that job.
    """
    owners = sa.select(WebhookEndpoint.owner_id).distinct()
    jobs = session.execute(
        sa.select(Job.id, Job.owner_id, Job.webhook_seq, Job.event_seq)
        .where(Job.event_seq > Job.webhook_seq, Job.owner_id.in_(owners)).limit(limit)
    ).all()
    session.rollback()
    created = 0
    for job_id, owner_id, done, last in jobs:
        try:
            created += _fan_out_job(session, str(job_id), int(owner_id), int(done), int(last))
            session.commit()
        except IntegrityError:
            session.rollback()  # another dispatcher fanned these events out first
    return created


def _fan_out_job(session: Session, job_id: str, owner_id: int, done: int, last: int) -> int:
    endpoints = session.execute(sa.select(WebhookEndpoint).where(WebhookEndpoint.owner_id == owner_id)).scalars().all()
    oldest = min((ep.start_event_id for ep in endpoints), default=None)
    events = [] if oldest is None else session.execute(
        sa.select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > done, JobEvent.seq <= last,
                                  JobEvent.id > oldest)  # a new endpoint's catch-up skips old events cheaply
        .order_by(JobEvent.seq)
    ).scalars().all()
    now = utcnow()
    rows = []
    for ev in events:
        for etype, data in event_types_for(ev):
            for ep in endpoints:
                if etype not in (ep.events or []) or ev.id <= ep.start_event_id:
                    continue
                payload = {"type": etype, "timestamp": _iso(ev.time or now),
                           "data": {"job_id": job_id, "event_seq": ev.seq, "attempt": ev.attempt, **data}}
                rows.append({"id": new_id("msg"), "endpoint_id": ep.id, "event_type": etype, "event_id": ev.id,
                             "job_id": job_id, "payload": payload, "status": PENDING, "attempts": 0,
                             "next_attempt_at": now, "created_at": now})
    moved = session.execute(
        sa.update(Job).where(Job.id == job_id, Job.webhook_seq == done)
        .values(webhook_seq=last, updated_at=Job.updated_at)  # not a change of the job: keep updated_at
        .execution_options(synchronize_session=False)
    )
    if not getattr(moved, "rowcount", 0):
        session.rollback()
        return 0
    if rows:
        session.execute(sa.insert(WebhookDelivery), rows)
    return len(rows)


def test_send_wait(session: Session, *, owner_id: int, per_minute: int, now: datetime | None = None) -> int:
    """Seconds until the owner may queue another `webhook.test` message (0: now): at most `per_minute` of
    them in any 60 s, counted over all the owner's endpoints (a test is an outbound request on demand)."""
    now = now or utcnow()
    since = now - timedelta(seconds=60)
    recent = session.scalars(
        sa.select(WebhookDelivery.created_at).join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookEndpoint.owner_id == owner_id, WebhookDelivery.event_type == TEST_EVENT,
               WebhookDelivery.created_at >= since)
        .order_by(WebhookDelivery.created_at.desc()).limit(per_minute)).all()
    if len(recent) < per_minute:
        return 0
    oldest = recent[-1] if recent[-1].tzinfo is not None else recent[-1].replace(tzinfo=now.tzinfo)  # SQLite: naive
    return max(1, int((oldest - since).total_seconds()) + 1)


def add_test_delivery(session: Session, endpoint: WebhookEndpoint) -> WebhookDelivery:
    """A `webhook.test` message to `endpoint`, due now."""
    now = utcnow()
    row = WebhookDelivery(endpoint_id=endpoint.id, event_type=TEST_EVENT, event_id=None, job_id=None,
                          payload={"type": TEST_EVENT, "timestamp": _iso(now),
                                   "data": {"webhook_id": endpoint.id, "message": "test message"}},
                          status=PENDING, attempts=0, next_attempt_at=now, created_at=now)
    session.add(row)
    session.flush()
    return row


@dataclass(frozen=True)
class Claimed:
    """A delivery this dispatcher may send now."""

    id: str
    url: str
    secret: str | None  # None: it could not be decrypted (the delivery fails with `secret_unavailable`)
    payload: dict[str, Any]
    attempts: int


def claim_due(session: Session, *, hold_seconds: float, box: SecretBox, limit: int = 32,
              now: datetime | None = None) -> list[Claimed]:
    """Claim pending deliveries that are due (their `next_attempt_at` moves `hold_seconds` ahead, so a
    dispatcher that dies mid-send leaves them to be retried), with their secrets decrypted. Commits."""
    now = now or utcnow()
    rows = session.execute(
        sa.select(WebhookDelivery.id, WebhookDelivery.next_attempt_at, WebhookDelivery.attempts,
                  WebhookDelivery.payload, WebhookEndpoint.url, WebhookEndpoint.secret, WebhookEndpoint.id)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.id).limit(limit)
    ).all()
    out = []
    for msg_id, due, attempts, payload, url, stored, wid in rows:
        res = session.execute(
            sa.update(WebhookDelivery)
            .where(WebhookDelivery.id == msg_id, WebhookDelivery.status == PENDING,
                   WebhookDelivery.next_attempt_at == due)
            .values(next_attempt_at=now + timedelta(seconds=hold_seconds))
            .execution_options(synchronize_session=False)
        )
        if getattr(res, "rowcount", 0):
            try:
                secret: str | None = box.decrypt(str(stored), aad=str(wid).encode())
                _rewrap(session, box, str(wid), str(stored))
            except SecretError:
                secret = None
            out.append(Claimed(str(msg_id), str(url), secret, dict(payload), int(attempts)))
    session.commit()
    return out


def record_attempt(session: Session, msg_id: str, *, ok: bool, status_code: int | None, error: str | None,
                   max_attempts: int, retry_base: float, now: datetime | None = None) -> str:
    """Store one attempt's outcome; schedules the next (exponential back-off) or gives up. Returns the status."""
    now = now or utcnow()
    attempts = int(session.scalar(sa.select(WebhookDelivery.attempts).where(WebhookDelivery.id == msg_id)) or 0) + 1
    if ok:
        status, nxt = SUCCEEDED, None
    elif attempts >= max_attempts:
        status, nxt = FAILED, None
    else:
        status, nxt = PENDING, now + timedelta(seconds=retry_delay(attempts, retry_base))
    session.execute(
        sa.update(WebhookDelivery).where(WebhookDelivery.id == msg_id)
        .values(status=status, attempts=attempts, next_attempt_at=nxt, last_attempt_at=now,
                last_status_code=status_code, last_error=None if ok else (error or "")[:1000])
        .execution_options(synchronize_session=False)
    )
    session.commit()
    return status


def endpoint_out(ep: WebhookEndpoint, *, secret: str | None = None) -> dict[str, Any]:
    """Public form of an endpoint (the plaintext `secret` only when just created)."""
    out: dict[str, Any] = {"id": ep.id, "object": "webhook_endpoint", "url": ep.url, "events": list(ep.events or []),
                           "description": ep.description, "created_at": ep.created_at}
    if secret:
        out["secret"] = secret
    return out


def delivery_out(d: WebhookDelivery) -> dict[str, Any]:
    """Public form of a delivery."""
    return {"id": d.id, "object": "webhook_delivery", "endpoint_id": d.endpoint_id, "event_type": d.event_type,
            "job_id": d.job_id, "payload": d.payload, "status": d.status, "attempts": d.attempts,
            "next_attempt_at": d.next_attempt_at if d.status == PENDING else None,
            "last_attempt_at": d.last_attempt_at, "last_status_code": d.last_status_code,
            "last_error": d.last_error, "created_at": d.created_at}
