"""Bounded connections: header and body timeouts and a connection cap, in uvicorn's own HTTP protocol.

    uvicorn --factory api.main:create_app --http api.timeouts:HttpProtocol

uvicorn (0.54) times out only idle keep-alive connections (`--timeout-keep-alive`): a client that sends its
request head or body one byte a second holds the connection (and a request task) as long as it likes, and
`--limit-concurrency` counts such connections against everyone. `HttpProtocol` is uvicorn's httptools
protocol with three bounds from the settings (`service.settings`):

- `http_header_timeout_s`: the request line and headers must arrive within this time of the connection
  opening (or of the first byte of the next request on a kept-alive one), else `408 Request Timeout` and
  the connection is closed;
- `http_body_timeout_s` + `http_body_min_bytes_per_s`: the body must arrive within `http_body_timeout_s`
  of the head plus one second per `http_body_min_bytes_per_s` received (an upload at that rate or faster is
  never cut, a trickle is), else 408 (or, once an answer has started, a closed connection); the app's
  `receive()` then reads `http.disconnect`. Also a body the app never reads (it answered early) is bounded;
- `http_max_connections`: open connections of this process; one more is answered as uvicorn answers past
  `--limit-concurrency` (`503 Service Unavailable`, connection closed) at its first request head, which the
  header timeout bounds. Connections already open are not affected.

A 408 is the API's error envelope (`request_timeout`). The bounds are read once per server, when its first
connection is made (`get_settings()`, the environment the app's factory reads too) and kept on uvicorn's
`Config`. Timers are armed only while a head or body is incomplete after a read, so a request that arrives
in one read costs one timer at the connection's start and none after.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from api.errors import envelope
from service.settings import Settings, get_settings

__all__ = ["HTTP_PROTOCOL", "HttpLimits", "HttpProtocol"]

#: What `--http` names (worker/run.py, the Dockerfile and docker-compose.yml start the API with it).
HTTP_PROTOCOL = "api.timeouts:HttpProtocol"
_CONFIG_ATTR = "peagle_http_limits"


@dataclass(frozen=True)
class HttpLimits:
    """The bounds of one server's connections (module docstring)."""

    header_timeout_s: float
    body_timeout_s: float
    body_min_bytes_per_s: int
    max_connections: int

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpLimits:
        return cls(header_timeout_s=settings.http_header_timeout_s, body_timeout_s=settings.http_body_timeout_s,
                   body_min_bytes_per_s=settings.http_body_min_bytes_per_s,
                   max_connections=settings.http_max_connections)

    @classmethod
    def of(cls, config: Config) -> HttpLimits:
        """The server's bounds: set on its `Config` (tests), else read from the settings once and kept there."""
        limits = getattr(config, _CONFIG_ATTR, None)
        if not isinstance(limits, HttpLimits):
            limits = cls.from_settings(get_settings())
            setattr(config, _CONFIG_ATTR, limits)
        return limits


def _timeout_response(default_headers: list[tuple[bytes, bytes]], what: str) -> bytes:
    body = json.dumps(envelope("request_timeout", f"the request {what} did not arrive in time"),
                      separators=(",", ":")).encode()
    head = [b"HTTP/1.1 408 Request Timeout\r\n"]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n\r\n"]
    return b"".join(head) + body


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body timeouts and a connection cap (module docstring)."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = HttpLimits.of(config)
        self._in_head = self._in_body = False
        self._head_started = self._body_started = 0.0
        self._body_bytes = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    # connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.limit_concurrency = 0  # uvicorn's own answer past its limit: 503, connection closed
        self._in_head, self._head_started = True, self.loop.time()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            self._stop_timers()
            return
        # arm only what this read left incomplete
        if self._in_head and self._head_timer is None:
            delay = self._head_started + self.limits.header_timeout_s - self.loop.time()
            self._head_timer = self.loop.call_later(max(0.0, delay), self._head_timeout)
        if self._in_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self._body_left(), self._body_timeout)

    # parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:  # the next request on a kept-alive connection: its head starts now
            self._in_head, self._head_started = True, self.loop.time()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head()
        self._in_body, self._body_started, self._body_bytes = True, self.loop.time(), 0
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        self._cancel_body()
        super().on_message_complete()

    # timers
    def _body_left(self) -> float:
        allowed = self.limits.body_timeout_s + self._body_bytes / self.limits.body_min_bytes_per_s
        return max(0.0, self._body_started + allowed - self.loop.time())

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            self._cut("head")
        else:  # a pipelined head behind an answer still running: close once that answer is sent
            self.cycle.keep_alive = False

    def _body_timeout(self) -> None:
        self._body_timer = None
        if not self._in_body or self.transport.is_closing():
            return
        left = self._body_left()
        if left > 0:  # it kept the rate: the deadline moved
            self._body_timer = self.loop.call_later(left, self._body_timeout)
            return
        self._cut("body")

    def _cut(self, what: str) -> None:
        """Answer 408 unless an answer has started, and close; the app's `receive()` reads a disconnect."""
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(_timeout_response(self.server_state.default_headers, what))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's later sends go nowhere, its receive() says http.disconnect
            cycle.message_event.set()
        self.logger.info("closing a connection: its request %s did not arrive within the limit", what)
        self._stop_timers()
        self.transport.close()

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _stop_timers(self) -> None:
        self._in_head = self._in_body = False
        self._cancel_head()
        self._cancel_body()
