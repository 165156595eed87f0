"""What `ortforge serve` exposes at /metrics (Prometheus text format, prometheus-client) and the
access log: one JSON line per request, with no prompt or reply text.

Each app has its own registry, so several servers in one process (the tests) do not collide.
"""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

access_log = logging.getLogger("ortforge.access")

# Seconds: a first token from tens of milliseconds (a short prompt on a free slot) to minutes (a
# long prompt behind a full queue); a decode step from milliseconds to a second.
FIRST_TOKEN_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
INTER_TOKEN_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class ServerMetrics:
    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        labels = ["path", "status"]
        self.requests = Counter("ortforge_requests", "HTTP answers by route and status", labels, registry=self.registry)
        self.tokens = Counter("ortforge_generated_tokens", "tokens generated for clients", registry=self.registry)
        self.first_token = Histogram(
            "ortforge_time_to_first_token_seconds",
            "from a request's admission to its first token",
            buckets=FIRST_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "ortforge_inter_token_seconds",
            "between a request's consecutive tokens",
            buckets=INTER_TOKEN_BUCKETS,
            registry=self.registry,
        )
        gauges = {
            "ortforge_queue_depth": ("requests waiting for a slot", lambda: scheduler.queued),
            "ortforge_active_slots": ("slots decoding a request", lambda: len(scheduler.active)),
            "ortforge_slots": ("slots the server decodes together", lambda: scheduler.slots),
            "ortforge_kv_cache_used_bytes": ("KV cache bytes holding tokens", lambda: scheduler.kv_used_bytes),
            "ortforge_kv_cache_reserved_bytes": (
                "KV cache bytes the running requests reserved (prompt + max_tokens)",
                lambda: scheduler.kv.reserved * scheduler.kv.bytes_per_token,
            ),
            "ortforge_kv_cache_budget_bytes": (
                "the KV cache's budget (--kv-cache-mb)",
                lambda: scheduler.kv.tokens * scheduler.kv.bytes_per_token,
            ),
        }
        for name, (text, read) in gauges.items():
            Gauge(name, text, registry=self.registry).set_function(read)


class Observed:
    """ASGI middleware: counts every answer by route and status and writes its access-log line."""

    def __init__(self, app, metrics: ServerMetrics, routes: frozenset[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            path = scope["path"] if scope["path"] in self.routes else "other"  # no label per unknown URL
            self.metrics.requests.labels(path, str(status[0])).inc()
            line = {
                "method": scope["method"],
                "path": path,
                "status": status[0],
                "ms": round((time.perf_counter() - started) * 1e3, 1),
                "client": (scope.get("client") or ("", 0))[0],
            }
            access_log.info(json.dumps(line))
