"""The webhook dispatcher: job events -> signed HTTP POSTs, retried with back-off (at least once).

Runs as a thread of the reaper process (`python -m worker.reaper`, started by `python -m worker`), so it
never delays an API request or a training supervisor. Each pass (every `webhook_poll_seconds`):
1. `fan_out`: new job events of owners with endpoints become `webhook_delivery` rows;
2. `claim_due`: pending deliveries whose time has come are claimed (several dispatchers may run);
3. each is POSTed (a small thread pool, `webhook_timeout_seconds` each) with the Standard Webhooks
   headers; a 2xx marks it succeeded, anything else schedules a retry (base, 4x, 16x, ... seconds)
   until `webhook_max_attempts`, then it is marked failed. Receivers must be idempotent on `webhook-id`.

SSRF guard (`service.ssrf`): the client's network backend resolves each host once, refuses it unless every
address is public (or allowed by `webhook_allow_hosts`), and connects to a checked address; the Host header
and TLS SNI / certificate check still use the URL's name. Redirects are not followed, environment proxies
are ignored, and a delivery records only the status code and an error class (`http_status`,
`connect_error`, `timeout`, `refused_address`, `secret_unavailable`), never the receiver's answer, so the
dispatcher cannot be used to read internal services or scan ports.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpcore
import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from service import ssrf
from service.db import webhooks as wh
from service.settings import Settings

__all__ = ["GuardedBackend", "deliver", "dispatch_once", "make_client", "run_dispatcher", "start_dispatcher"]

log = logging.getLogger(__name__)

USER_AGENT = "peagle-webhooks/1"


class GuardedBackend(httpcore.NetworkBackend):
    """httpcore's sync backend, connecting only to checked addresses of the host (see `service.ssrf`)."""

    def __init__(self, allow: ssrf.AllowList) -> None:
        self.allow = allow
        self.inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        try:
            ips = ssrf.resolve_checked(host, port, self.allow)
        except (OSError, UnicodeError) as exc:
            raise httpcore.ConnectError(f"cannot resolve {host!r}: {exc}") from None
        last: Exception | None = None
        for ip in ips:  # only checked addresses: a second lookup could answer differently
            try:
                return self.inner.connect_tcp(str(ip), port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None
                            ) -> httpcore.NetworkStream:
        raise ssrf.RefusedAddress("unix sockets are not webhook targets")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


def make_client(settings: Settings) -> httpx.Client:
    """The dispatcher's HTTP client: guarded connections, no redirects, no environment proxies."""
    transport = httpx.HTTPTransport(trust_env=False)
    # httpx takes no network backend; its pool is rebuilt with one (httpx is pinned <0.29 in pyproject).
    transport._pool = httpcore.ConnectionPool(
        ssl_context=httpx.create_ssl_context(), max_connections=100, max_keepalive_connections=20,
        keepalive_expiry=5.0, network_backend=GuardedBackend(ssrf.AllowList.parse(settings.webhook_allow_hosts)))
    return httpx.Client(transport=transport, timeout=httpx.Timeout(settings.webhook_timeout_seconds),
                        follow_redirects=False, trust_env=False)


def deliver(client: httpx.Client, msg: wh.Claimed, allow: ssrf.AllowList | None = None
            ) -> tuple[bool, int | None, str | None]:
    """POST one signed message; returns (ok, status code, error class). The answer's body is never read."""
    if msg.secret is None:
        return False, None, "secret_unavailable"
    body = json.dumps(msg.payload, separators=(",", ":"), sort_keys=True).encode()
    ts = int(time.time())
    headers = {"content-type": "application/json", "user-agent": USER_AGENT, "webhook-id": msg.id,
               "webhook-timestamp": str(ts), "webhook-signature": wh.sign(msg.secret, msg.id, ts, body)}
    try:
        ssrf.check_url(msg.url, allow or ssrf.AllowList(), resolve=False)  # userinfo, literals, names
        with client.stream("POST", msg.url, content=body, headers=headers) as resp:
            code = resp.status_code
    except (ssrf.RefusedAddress, httpx.InvalidURL, httpx.UnsupportedProtocol):
        return False, None, "refused_address"
    except httpx.TimeoutException:
        return False, None, "timeout"
    except httpx.HTTPError:
        return False, None, "connect_error"
    except Exception:  # a malformed row must not stop the dispatcher
        log.exception("webhook %s: unexpected error sending to the endpoint", msg.id)
        return False, None, "connect_error"
    if 200 <= code < 300:
        return True, code, None
    return False, code, "http_status"


def dispatch_once(factory: sessionmaker[Session], settings: Settings, client: httpx.Client,
                  pool: ThreadPoolExecutor) -> int:
    """One pass (fan out, claim, send, record); returns the number of attempts made."""
    allow = ssrf.AllowList.parse(settings.webhook_allow_hosts)
    with factory() as s:
        wh.fan_out(s)
    with factory() as s:
        due = wh.claim_due(s, hold_seconds=settings.webhook_timeout_seconds + 30, box=wh.secret_box(settings))
    if not due:
        return 0
    results = list(pool.map(lambda m: deliver(client, m, allow), due))
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
    with make_client(settings) as client, ThreadPoolExecutor(8) as pool:
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
