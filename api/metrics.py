"""The service's Prometheus metrics (`GET /metrics`): one registry per app, and the middleware that counts
requests and observes their latency per route template (open SSE streams as a gauge)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["MetricsMiddleware", "ServiceMetrics"]


class ServiceMetrics:
    """Prometheus metrics of one app (its own registry)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("peagle_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("peagle_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10))
        self.streams = Gauge("peagle_open_streams", "Open SSE streams", registry=self.registry)


class MetricsMiddleware:
    """Pure ASGI middleware: counts requests and observes latency per route template."""

    def __init__(self, app: Any, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}
        is_stream = scope.get("path", "").endswith("/stream")
        if is_stream:
            self.metrics.streams.inc()

        async def _send(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, _send)
        finally:
            if is_stream:
                self.metrics.streams.dec()
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(scope["method"], route, str(status["code"])).inc()
            if not is_stream:
                self.metrics.latency.labels(scope["method"], route).observe(time.perf_counter() - start)
