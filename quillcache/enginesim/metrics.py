"""Prometheus metrics of the stand-in engine, in vLLM's names (REFERENCE section 11) plus the stand-in's own.

One :class:`CollectorRegistry` per engine (several stand-ins can live in one process). vLLM names and meaning:
``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (gauges), ``vllm:kv_cache_usage_perc`` (pinned
blocks / capacity, 0..1 like vLLM), ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``
(prompt tokens looked up / found cached, counted in tokens as vLLM does), ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:request_success_total``, ``vllm:time_to_first_token_seconds`` and
``vllm:e2e_request_latency_seconds`` (histograms). The stand-in's own: ``quillcache_sim_cancelled_total``
(requests whose client went away before the end), ``quillcache_sim_injected_faults_total{kind}``,
``quillcache_sim_cached_blocks``, ``quillcache_sim_kv_event_batches_total``. Every vLLM metric carries ``model_name`` like vLLM's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["SimMetrics", "TTFT_BUCKETS_S"]

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)


class SimMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lbl = self.registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", lbl, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a batch slot", lbl, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0..1", lbl, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lbl, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", lbl, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", lbl, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lbl, registry=r)
        self.success = Counter("vllm:request_success", "Requests finished", lbl + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", lbl,
                             buckets=TTFT_BUCKETS_S, registry=r)
        self.cancelled = Counter("quillcache_sim_cancelled", "Requests cancelled by a client disconnect", registry=r)
        self.faults = Counter("quillcache_sim_injected_faults", "Faults injected by the fault knobs", ["kind"],
                              registry=r)
        self.kv_event_batches = Counter("quillcache_sim_kv_event_batches", "KV-event batches handed to the publisher "
                                        "(numbered from 0; the last one's seq is this count minus one)", registry=r)
        self.cached_blocks = Gauge("quillcache_sim_cached_blocks", "Blocks in the stand-in's prefix cache", registry=r)
        self.model_name = model_name
        for g in (self.running, self.waiting, self.kv_usage):
            g.labels(model_name).set(0)
        for c in (self.prefix_queries, self.prefix_hits, self.prompt_tokens, self.generation_tokens):
            c.labels(model_name)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
