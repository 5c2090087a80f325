"""Replay metrics: per-request rows and the run's summary.

Per request (:class:`RequestRow`): where each full prompt block came from (GPU of the chosen
engine, its DRAM, its SSD, a peer node, or recomputed), bytes fetched, and the timeline
``arrival -> (fetch) -> queue -> prefill -> first token -> decode -> finish``.

Summary (:func:`summarize`): block hit rate by tier = blocks served from that tier / all full
prompt blocks; token hit rate = cached prompt tokens / all prompt tokens; TTFT p50/p90/p99 (seconds);
goodput = requests meeting the TTFT SLO per second of replayed time (first arrival to last
finish), and prompt+output tokens of those requests per second; queueing (mean and p99 of the
wait for the engine's prefill); bytes moved per tier (from the data planes' own counters and the
harness's peer/offload counters; quantized bytes when the DRAM/SSD tiers hold a codec's blocks:
``kv_codec``, ``tier_block_bytes`` = bytes of one block there, ``dram/ssd_capacity_bytes`` = the
per-node byte budgets, ``dram/ssd_capacity_blocks`` = the blocks those budgets hold). Invariants: the tier hit counts and recomputed blocks of a row
add up to its full blocks; each request appears exactly once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

__all__ = ["TIERS", "ReplaySummary", "RequestRow", "summarize"]

TIERS = ("gpu", "dram", "ssd", "peer")


@dataclass(slots=True)
class RequestRow:
    """One replayed request (a CSV row)."""

    request_id: int  # its index in the replayed trace (a skipped request keeps its number, gets no row)
    engine: str
    tenant: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    full_blocks: int
    hit_gpu: int
    hit_dram: int
    hit_ssd: int
    hit_peer: int
    recompute_blocks: int
    cached_tokens: int
    fetch_bytes: int
    fetch_s: float
    queue_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    finish_s: float
    predicted_ttft_s: float
    meets_slo: bool

    @property
    def hit_blocks(self) -> int:
        return self.hit_gpu + self.hit_dram + self.hit_ssd + self.hit_peer

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True, kw_only=True)
class ReplaySummary:
    """What one replay measured (a summary CSV row; ``as_dict`` keeps field order)."""

    requests: int
    engines: int
    router: str
    policy: str
    model: str
    gpu: str
    account_bytes: bool
    block_tokens: int
    gpu_capacity_blocks: int
    dram_capacity_blocks: int
    ssd_capacity_blocks: int
    kv_codec: str
    tier_block_bytes: int
    dram_capacity_bytes: int
    ssd_capacity_bytes: int
    full_blocks: int
    block_hit_rate: float
    block_hit_rate_gpu: float
    block_hit_rate_dram: float
    block_hit_rate_ssd: float
    block_hit_rate_peer: float
    token_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    slo_ttft_s: float
    slo_attainment: float
    goodput_rps: float
    goodput_tokens_per_s: float
    queue_mean_s: float
    queue_p99_s: float
    duration_s: float
    bytes_fetched_dram: int
    bytes_fetched_ssd: int
    bytes_fetched_peer: int
    bytes_offloaded_gpu_to_dram: int
    bytes_dram_to_ssd: int
    bytes_ssd_to_dram: int
    bytes_evicted: int
    wall_s: float

    def as_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else 0.0


def summarize(rows: list[RequestRow], *, setup: dict[str, object], bytes_moved: dict[str, int],
              slo_ttft_s: float, wall_s: float) -> ReplaySummary:
    """The summary of a replay's rows (see the module docstring for each definition)."""
    n = len(rows)
    blocks = sum(r.full_blocks for r in rows)
    tokens = sum(r.input_tokens for r in rows)
    tier_hits = {t: sum(getattr(r, f"hit_{t}") for r in rows) for t in TIERS}
    hits = sum(tier_hits.values())
    ttft = np.array([r.ttft_s for r in rows], dtype=np.float64)
    queue = np.array([r.queue_s for r in rows], dtype=np.float64)
    ok = [r for r in rows if r.ttft_s <= slo_ttft_s]
    t0 = min((r.arrival_s for r in rows), default=0.0)
    t1 = max((r.finish_s for r in rows), default=0.0)
    dur = t1 - t0
    per = (lambda x: x / dur) if dur > 0 else (lambda x: 0.0)
    rate = (lambda x: x / blocks) if blocks else (lambda x: 0.0)
    return ReplaySummary(
        requests=n, **setup, full_blocks=blocks,  # type: ignore[arg-type]
        block_hit_rate=rate(hits), block_hit_rate_gpu=rate(tier_hits["gpu"]),
        block_hit_rate_dram=rate(tier_hits["dram"]), block_hit_rate_ssd=rate(tier_hits["ssd"]),
        block_hit_rate_peer=rate(tier_hits["peer"]),
        token_hit_rate=sum(r.cached_tokens for r in rows) / tokens if tokens else 0.0,
        ttft_p50_s=_pct(ttft, 50), ttft_p90_s=_pct(ttft, 90), ttft_p99_s=_pct(ttft, 99), ttft_mean_s=float(ttft.mean()) if n else 0.0,
        slo_ttft_s=slo_ttft_s, slo_attainment=len(ok) / n if n else 0.0,
        goodput_rps=per(len(ok)), goodput_tokens_per_s=per(sum(r.input_tokens + r.output_tokens for r in ok)),
        queue_mean_s=float(queue.mean()) if n else 0.0, queue_p99_s=_pct(queue, 99), duration_s=dur,
        bytes_fetched_dram=bytes_moved["fetched_dram"], bytes_fetched_ssd=bytes_moved["fetched_ssd"],
        bytes_fetched_peer=bytes_moved["fetched_peer"], bytes_offloaded_gpu_to_dram=bytes_moved["offloaded"],
        bytes_dram_to_ssd=bytes_moved["dram_to_ssd"], bytes_ssd_to_dram=bytes_moved["ssd_to_dram"],
        bytes_evicted=bytes_moved["evicted"], wall_s=wall_s,
    )
