"""The webhook dispatcher: job events -> signed HTTP POSTs, retried with back-off (at least once).

Runs as a thread of the reaper process (`python -m worker.reaper`, started by `python -m worker`), so it
never delays an API request or a training supervisor. Each pass (every `webhook_poll_seconds`):
1. `fan_out`: new job events of owners with endpoints become `webhook_delivery` rows;
2. `claim_due`: pending deliveries whose time has come are claimed (several dispatchers may run);
3. each is POSTed (a small thread pool, `webhook_timeout_seconds` each) with the Standard Webhooks
   headers; a 2xx marks it succeeded, anything else schedules a retry (base, 4x, 16x, ... seconds)
   until `webhook_max_attempts`, then it is marked failed. Receivers must be idempotent on `webhook-id`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from service.db import webhooks as wh
from service.settings import Settings

__all__ = ["deliver", "dispatch_once", "run_dispatcher", "start_dispatcher"]

log = logging.getLogger(__name__)

USER_AGENT = "peagle-webhooks/1"


def deliver(client: httpx.Client, msg: wh.Claimed) -> tuple[bool, int | None, str | None]:
    """POST one signed message; returns (ok, status code, error)."""
    body = json.dumps(msg.payload, separators=(",", ":"), sort_keys=True).encode()
    ts = int(time.time())
    headers = {"content-type": "application/json", "user-agent": USER_AGENT, "webhook-id": msg.id,
               "webhook-timestamp": str(ts), "webhook-signature": wh.sign(msg.secret, msg.id, ts, body)}
    try:
        resp = client.post(msg.url, content=body, headers=headers)
    except httpx.HTTPError as exc:
        return False, None, f"{type(exc).__name__}: {exc}"
    if 200 <= resp.status_code < 300:
        return True, resp.status_code, None
    return False, resp.status_code, f"HTTP {resp.status_code}: {resp.text[:200]}"


def dispatch_once(factory: sessionmaker[Session], settings: Settings, client: httpx.Client,
                  pool: ThreadPoolExecutor) -> int:
    """One pass (fan out, claim, send, record); returns the number of attempts made."""
    with factory() as s:
        wh.fan_out(s)
    with factory() as s:
        due = wh.claim_due(s, hold_seconds=settings.webhook_timeout_seconds + 30)
    if not due:
        return 0
    results = list(pool.map(lambda m: deliver(client, m), due))
    with factory() as s:
        for msg, (ok, code, err) in zip(due, results, strict=True):
            status = wh.record_attempt(s, msg.id, ok=ok, status_code=code, error=err,
                                       max_attempts=settings.webhook_max_attempts,
                                       retry_base=settings.webhook_retry_base_seconds)
            if not ok:
                log.info("webhook %s to %s: attempt %d failed (%s) -> %s", msg.id, msg.url, msg.attempts + 1,
                         err, status)
    return len(due)


def run_dispatcher(settings: Settings, factory: sessionmaker[Session], stop: threading.Event) -> None:
    """Dispatch until `stop` is set (database and network errors are logged and retried)."""
    timeout = httpx.Timeout(settings.webhook_timeout_seconds)
    with httpx.Client(timeout=timeout, follow_redirects=False) as client, ThreadPoolExecutor(8) as pool:
        while not stop.is_set():
            try:
                busy = dispatch_once(factory, settings, client, pool)
            except sa.exc.SQLAlchemyError as exc:
                log.warning("webhooks: database error (%s); retrying", exc)
                busy = 0
            if not busy:
                stop.wait(settings.webhook_poll_seconds)


def start_dispatcher(settings: Settings, factory: sessionmaker[Session], stop: threading.Event) -> Any:
    """`run_dispatcher` in a daemon thread (the reaper's)."""
    t = threading.Thread(target=run_dispatcher, args=(settings, factory, stop), name="webhooks", daemon=True)
    t.start()
    return t
