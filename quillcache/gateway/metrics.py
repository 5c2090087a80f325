"""Gateway metrics (prometheus_client), named in the Dynamo frontend's style (``dynamo_frontend_*``).

Every metric lives in the gateway's own ``CollectorRegistry`` (two gateways in one process never
collide). Names, all prefixed ``quillcache_gateway_``:

==========================================  =========  =====================================================
name                                        type       labels / meaning
==========================================  =========  =====================================================
requests_total                              counter    endpoint, status (HTTP status sent)
time_to_first_token_seconds                 histogram  request received -> first body chunk sent
inter_token_latency_seconds                 histogram  between consecutive upstream chunks of a stream
decision_seconds                            histogram  request received -> first routing decision (engine not yet
                                                       contacted; one per routed request)
prompt_tokens_total / cached_tokens_total   counter    prompt tokens, and those the plan found cached (own scope)
routing_decisions_total                     counter    worker, reason (prefix_hit, no_hit, retry, unhealthy)
upstream_errors_total                       counter    worker, kind (connect, protocol, status, timeout, mid_stream,
                                                       error_event: the engine's own error event in its stream)
upstream_retries_total                      counter    worker (the worker retried away from)
client_disconnects_total                    counter    admitted requests the client closed before the end
inflight_requests                           gauge      worker (read from the live load counters at scrape)
tenant_inflight_requests                    gauge      admitted requests of all tenants not yet finished
engine_healthy                              gauge      worker (1 healthy, 0 not)
kv_events_total                             counter    worker, kind (stored, removed, cleared, resync)
residency_entries                           gauge      worker, state (pending, confirmed, approximate)
residency_outcomes_total                    counter    outcome: the residency tracker's counters (blocks):
                                                       speculated, expired, and per stored block confirmed
                                                       (inherited among them) or unattributed (ambiguous
                                                       among them: root stores refused because several
                                                       scopes could have caused them, the hit rate the
                                                       safety rule gives up; ``resolved``: those credited
                                                       later through a descendant); removed, cleared,
                                                       approx_evicted, unknown_removals
==========================================  =========  =====================================================

Invariant: label children for known workers are created once at start, so the per-request path
only increments pre-bound children.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["GatewayMetrics"]

_P = "quillcache_gateway_"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROUTING_REASONS = ("prefix_hit", "no_hit", "retry", "unhealthy")
UPSTREAM_ERROR_KINDS = ("connect", "protocol", "status", "timeout", "mid_stream", "error_event")


class _LiveCollector:
    """Gauges read at scrape time from callables (no per-request cost)."""

    def __init__(self, inflight: Callable[[], dict[str, int]], healthy: Callable[[], dict[str, bool]],
                 residency: Callable[[], dict[tuple[str, str], int]], tenant_inflight: Callable[[], int],
                 outcomes: Callable[[], dict[str, int]] | None = None) -> None:
        self._inflight, self._healthy, self._residency = inflight, healthy, residency
        self._tenant_inflight = tenant_inflight
        self._outcomes = outcomes

    def collect(self):
        g = GaugeMetricFamily(_P + "inflight_requests", "Requests in flight per worker (live load counter)",
                              labels=["worker"])
        for w, n in self._inflight().items():
            g.add_metric([w], n)
        yield g
        h = GaugeMetricFamily(_P + "engine_healthy", "1 if the engine's last health probe succeeded", labels=["worker"])
        for w, ok in self._healthy().items():
            h.add_metric([w], 1.0 if ok else 0.0)
        yield h
        r = GaugeMetricFamily(_P + "residency_entries", "Index entries the gateway holds per worker and state",
                              labels=["worker", "state"])
        for (w, s), n in self._residency().items():
            r.add_metric([w, s], n)
        yield r
        yield GaugeMetricFamily(_P + "tenant_inflight_requests", "Admitted requests not yet finished (all tenants)",
                                value=self._tenant_inflight())
        if self._outcomes is not None:
            c = CounterMetricFamily(_P + "residency_outcomes", "What the residency tracker did with speculations "
                                    "and KV events (ambiguous: root stores refused, several scopes could own them)",
                                    labels=["outcome"])
            for outcome, n in self._outcomes().items():
                c.add_metric([outcome], n)
            yield c


class GatewayMetrics:
    def __init__(self, workers: Sequence[str]) -> None:
        disable_created_metrics()  # no *_created series (process-wide; the gateway owns its process)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(_P + "requests_total", "Requests answered", ["endpoint", "status"], registry=r)
        self.ttft = Histogram(_P + "time_to_first_token_seconds", "Request received to first body chunk sent",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(_P + "inter_token_latency_seconds", "Gap between consecutive streamed chunks",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.decision = Histogram(_P + "decision_seconds",
                                  "Request received to its first routing decision (before the engine)",
                                  buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05), registry=r)
        self.prompt_tokens = Counter(_P + "prompt_tokens", "Prompt tokens of routed requests", registry=r)
        self.cached_tokens = Counter(_P + "cached_tokens", "Prompt tokens the plan found cached (own scope)",
                                     registry=r)
        self.routing = Counter(_P + "routing_decisions_total", "Routing decisions", ["worker", "reason"], registry=r)
        self.upstream_errors = Counter(_P + "upstream_errors_total", "Upstream failures", ["worker", "kind"],
                                       registry=r)
        self.retries = Counter(_P + "upstream_retries_total", "Retries away from a worker", ["worker"], registry=r)
        self.disconnects = Counter(_P + "client_disconnects_total", "Admitted requests the client closed early", registry=r)
        self.kv_events = Counter(_P + "kv_events_total", "KV events applied", ["worker", "kind"], registry=r)
        self._routing = {(w, why): self.routing.labels(w, why) for w in workers for why in ROUTING_REASONS}
        self._errors = {(w, k): self.upstream_errors.labels(w, k) for w in workers for k in UPSTREAM_ERROR_KINDS}
        self._retries = {w: self.retries.labels(w) for w in workers}
        self._requests: dict[tuple[str, int], object] = {}

    def attach_live(self, inflight, healthy, residency, tenant_inflight, outcomes=None) -> None:
        self.registry.register(_LiveCollector(inflight, healthy, residency, tenant_inflight, outcomes))

    def request_done(self, endpoint: str, status: int) -> None:
        c = self._requests.get((endpoint, status))
        if c is None:
            c = self._requests[(endpoint, status)] = self.requests.labels(endpoint, str(status))
        c.inc()

    def routed(self, worker: str, reason: str) -> None:
        self._routing[(worker, reason)].inc()

    def upstream_error(self, worker: str, kind: str) -> None:
        self._errors[(worker, kind)].inc()

    def retried(self, worker: str) -> None:
        self._retries[worker].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
