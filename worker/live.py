"""The live channel: after each committed batch, PUBLISH a wake-up on Redis `peagle:job:<id>`.

The database is the source of truth; a wake-up only tells listeners (the API's SSE streams) to read new
rows. A failed publish never fails a job: the publisher logs once, backs off, and tries again later
(listeners recover by reading the database after the last id they saw).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from service.channels import live_channel, wake_payload

__all__ = ["Publisher", "channel"]

#: The live channel name (`service.channels.live_channel`), under the name this module always exported.
channel = live_channel

log = logging.getLogger(__name__)


class Publisher:
    """Best-effort Redis publisher with short timeouts and a back-off while Redis is down."""

    def __init__(self, redis_url: str, *, backoff_seconds: float = 2.0) -> None:
        import redis

        self._client: Any = redis.Redis.from_url(
            redis_url, socket_connect_timeout=1.0, socket_timeout=1.0, health_check_interval=10
        )
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._down_until = 0.0
        self._backoff = backoff_seconds
        self._last: dict[str, Any] = {}
        self.failures = 0
        self.published = 0

    def publish(self, job_id: str, seqs: tuple[int, int, int], status: str) -> bool:
        """Publish `{"job_id", "event_seq", "metric_seq", "log_seq", "status"}`; False if Redis is down."""
        self._last = wake_payload(job_id, seqs, status)
        return self._send(job_id)

    def publish_status(self, job_id: str, status: str) -> bool:
        """Publish a status change (sequence numbers as last published).

        A status change is rare and final-looking to listeners, so it is always attempted, even inside
        the back-off window after a failure (a job that ends right after Redis returns still says so).
        """
        self._last = {**self._last, "job_id": job_id, "status": status}
        return self._send(job_id, force=True)

    def _send(self, job_id: str, *, force: bool = False) -> bool:
        now = time.monotonic()
        if now < self._down_until and not force:
            return False
        try:
            self._client.publish(channel(job_id), json.dumps(self._last))
        except self._errors as exc:
            if self.failures == 0 or now - self._down_until > 30:
                log.warning("live channel: publish failed (%s); the database stays the source of truth", exc)
            self.failures += 1
            self._down_until = now + self._backoff
            return False
        self.published += 1
        return True

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()
