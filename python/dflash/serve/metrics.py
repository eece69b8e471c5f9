"""Prometheus metrics of dflash serve (GET /metrics, text format, via prometheus-client).

Counted by the server: requests by endpoint and HTTP status (499: the client disconnected
first), finished requests by finish reason, prompt and generated tokens, time to first token
and inter-token latency (time between a request's successive stream pieces; a speculative step
delivers several tokens in one piece), end-to-end latency. Read from Session.stats() at scrape
time: running and waiting requests, KV-cache blocks and usage, and the drafter's acceptance
length and acceptance rate by draft position."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class _SessionCollector:
    """Gauges and counters read from Session.stats() on every scrape."""

    def __init__(self, stats: Callable[[], Dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        st = self._stats()
        yield GaugeMetricFamily("dflash_num_requests_running",
                                "Unfinished requests that have produced a token", value=st["num_running_requests"])
        yield GaugeMetricFamily("dflash_num_requests_waiting",
                                "Unfinished requests without a token yet (queued or in prefill)",
                                value=st["num_waiting_requests"])
        yield GaugeMetricFamily("dflash_kv_cache_blocks", "KV-cache blocks in all", value=st["num_blocks"])
        yield GaugeMetricFamily("dflash_kv_cache_free_blocks", "KV-cache blocks free", value=st["num_free_blocks"])
        used = 1.0 - st["num_free_blocks"] / st["num_blocks"] if st["num_blocks"] else 0.0
        yield GaugeMetricFamily("dflash_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", value=used)
        if not st["num_speculative_tokens"]:
            return
        yield CounterMetricFamily("dflash_spec_decode_steps", "Draft-verify steps", value=st["num_spec_steps"])
        yield CounterMetricFamily("dflash_spec_decode_draft_tokens", "Draft tokens proposed", value=st["num_drafted"])
        yield CounterMetricFamily("dflash_spec_decode_accepted_tokens", "Draft tokens accepted",
                                  value=st["num_accepted"])
        yield GaugeMetricFamily("dflash_spec_decode_acceptance_length",
                                "Mean tokens emitted per draft-verify step (bonus token included), since start",
                                value=st["acceptance_length"])
        by_position = GaugeMetricFamily("dflash_spec_decode_acceptance_rate_by_position",
                                        "Fraction of draft-verify steps whose draft at this position was accepted",
                                        labels=["position"])
        steps = st["num_spec_steps"]
        for position, count in enumerate(st["accepted_per_position"]):
            by_position.add_metric([str(position)], count / steps if steps else 0.0)
        yield by_position


class ServerMetrics:
    """The server's registry (one per app, so several apps can live in one process)."""

    def __init__(self, stats: Callable[[], Dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dflash_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("dflash_requests_finished", "Finished generation requests by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated for finished requests",
                                         registry=r)
        self.time_to_first_token = Histogram("dflash_time_to_first_token_seconds",
                                             "Time from the request's arrival to its first token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("dflash_inter_token_latency_seconds",
                                             "Time between successive pieces of a request's output",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("dflash_e2e_request_latency_seconds",
                                     "Time from the request's arrival to its last token", buckets=_E2E_BUCKETS,
                                     registry=r)
        r.register(_SessionCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountStatuses:
    """ASGI middleware counting every HTTP response by endpoint (known routes only, else
    "other") and status into ServerMetrics.requests; outermost, so refusals by the gates count."""

    def __init__(self, app: Any, *, metrics: ServerMetrics, endpoints: Any) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = set(endpoints)

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": None}

        async def send_counted(message: Dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in self.endpoints else "other"
            self.metrics.requests.labels(endpoint, str(status["code"] or 500)).inc()
