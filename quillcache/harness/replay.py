"""Discrete-event replay of a request trace through the real control plane and store tiers.

Longer than 600 lines because the event loop's handlers (arrival, fetch, prefill, decode, completion,
offload) mutate one shared simulation state; splitting them across modules would pass that state around.

Per request, in simulated time (seconds; a trace's milliseconds divided by ``time_scale``):

1. **arrival**: the request's identity scope (``IdentityRegistry.scope``; a trace line without a
   tenant or model gets the config's), its full blocks' hashes (the trace's ``hash_ids``, which must be
   prefix-chained ids: a trace whose ids are not is refused, ``UnchainedTraceError``), ``Planner.plan``
   (real index lookups of only its blocks, the real identity guard, the real router over live
   ``LoadTracker`` counters, fetch-vs-recompute actions);
2. **fetches** at routing time (the transfers overlap the wait for the engine, as a Mooncake
   conductor schedules them): each reused block is read through the real ``StoreDataPlane`` of
   the node that holds it - a local or peer DRAM read, an SSD read (promoted to DRAM by the data
   plane); a peer GPU block has no host bytes and is counted as a GPU-to-GPU network transfer.
   If a block left its tier since the lookup, the reuse stops there and the rest is recomputed.
   GPU hits are pinned on the engine (the engine's ``ref_cnt``) until the request finishes;
3. ``Planner.admit`` counts the load (the router of the NEXT request sees it), then the engine's
   prefill queue: one prefill at a time per engine, first come first served; the prefill starts
   at ``max(arrival + fetch_s, engine free)`` and lasts ``EngineModel.prefill_s(new, cached)``;
4. **prefill done** (the first token; TTFT = done - arrival): the lease's prefill tokens are
   released and every full prompt block (``Planner.resident_entries``: under the identity digest
   the scope writes) is held on the engine's GPU tier through its data plane (which reports to
   the index), touched in the GPU policy if already held. A GPU hold beyond capacity evicts the
   GPU policy's victim (never a pinned block); the victim's KV is offloaded to the node's DRAM
   unless the node already has its bytes, and DRAM pressure demotes to SSD and then drops, all
   through the data plane and its ``policy``. If every GPU block is pinned, the block goes
   straight to DRAM;
5. **decode**: ``EngineModel.decode_s(output, context, batch KV)``, with the batch = the decode
   blocks the engine holds at that instant (``LoadTracker``); at its end the pins and the lease
   are released (**finish**).

Events at the same instant run completions (in time, then creation order) before arrivals, so
a release is visible to the next routing decision. The replay is deterministic for a seed.

Bytes: real bytes (each block's payload is its 24-byte ``StoreKey`` repeated, checked on every
fetch: a wrong byte counts in ``verify_failures``) or accounting only (``account_bytes``: the same
allocator code path without payloads; see ``quillcache.store.dram``/``ssd``).

Quantized tiers (``cfg.kv_codec`` other than fp16; ``quillcache.store.tier_codec``): the DRAM and SSD
tiers hold the codec's blocks (``TierCodec.block_bytes`` each) within the same per-node byte budget
(``ReplayConfig``), so they hold more blocks; every byte count of a host tier (offloads, DRAM/SSD and
peer fetches, demotions, promotions) is quantized bytes, a peer GPU's block stays 16-bit, and the
engine model charges the host-tier fetch at the quantized size plus a dequantize per block
(``EngineModel.dequantize_block_s``). With real bytes, a block leaving a GPU is quantized from real
16-bit K/V (deterministic Gaussian values drawn from its key: the GPU tier is accounting only, so
the engine's KV is synthesized) with the codec's Numba kernels and stored as ``encode_block`` bytes;
every fetch decodes it (crc32c-checked) and dequantizes it, and a block whose values are not within
the codec's error of its key's K/V (``TierCodec.within_error``) counts in ``verify_failures``.

Bytes in a pool (``quillcache.harness.bytepool``): at each offload to a host tier, each drop of a
block's host bytes from a node and each peer DRAM/SSD fetch, the replay also tells its ``BytePool``,
one batch per event, in order. The default ``AccountingPool`` moves nothing (the counters above are
the accounting); ``ClusterPool`` moves each block's bytes through ``PooledStore`` between node
processes. A pool never changes a decision: the rows and summary are the same whatever the pool;
what it did is ``ReplayResult.pool``.

Invariants (tested): every request completes exactly once; TTFT >= its prefill time; at the end
the index holds exactly what the data planes report as resident (``StoreDataPlane.residency``).
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from quillcache.harness.bytepool import (
    PEER_DRAM_KIND,
    PEER_SSD_KIND,
    AccountingPool,
    BytePool,
    PoolBlock,
    PoolReport,
)
from quillcache.harness.config import ReplayConfig
from quillcache.harness.engine_model import EngineModel
from quillcache.harness.metrics import ReplaySummary, RequestRow, summarize
from quillcache.identity.scope import IdentityRegistry, make_identity
from quillcache.index import IndexBackend, open_index
from quillcache.planner import Planner, PlannerConfig, PlanRequest
from quillcache.planner.cost_model import CostModel
from quillcache.planner.profiles import DTYPE_BYTES, GPUS, MODELS
from quillcache.routing import Lease
from quillcache.store import (
    BlockNotFoundError,
    LocalKvStore,
    SsdTier,
    StoreDataPlane,
    StoreFullError,
    StoreKey,
)
from quillcache.store.ssd_format import PAGE_BYTES
from quillcache.store.tier_codec import FP16, TierCodec
from quillcache.traces.loader import MOONCAKE_BLOCK_TOKENS, TraceRequest
from quillcache.types import CacheTier, Identity, KvLayout

if TYPE_CHECKING:
    from quillcache.hitrate.arrays import ChainBreak

__all__ = ["ReplayResult", "check_replayable", "replay"]

GPU, DRAM, SSD = CacheTier.GPU, CacheTier.DRAM, CacheTier.SSD
_PREFILL_DONE, _DECODE_DONE = 0, 1
Progress = Callable[[int, int], None]
log = logging.getLogger(__name__)


@dataclass(eq=False)
class ReplayResult:
    """Rows (one per request, in arrival order), the summary, and - with ``keep_open=True`` - the
    live index and data planes (call ``close()`` when done)."""

    config: ReplayConfig
    summary: ReplaySummary
    rows: list[RequestRow]
    engine_model: EngineModel
    account_bytes: bool
    verify_failures: int
    skipped_empty: int
    skipped_oversize: int = 0  # requests larger than an engine's GPU KV (cfg.on_oversize="skip")
    dequantized_blocks: int = 0  # real bytes with a codec: blocks decoded + dequantized on fetch
    pool: PoolReport | None = None  # what the BytePool did (quillcache.harness.bytepool)
    index: IndexBackend | None = None
    planes: dict[str, StoreDataPlane] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory | None = None

    def close(self) -> None:
        tmp, self._tmp = self._tmp, None
        _close_all(self.planes.values(), self.index, tmp)

    def __enter__(self) -> "ReplayResult":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def to_frame(self):
        """One row per replayed request (``RequestRow`` fields as columns), as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame([r.as_dict() for r in self.rows], columns=RequestRow.columns())


@dataclass(slots=True, eq=False)
class _Flight:
    """A request between arrival and finish (hot record)."""

    row: RequestRow
    plan: object
    lease: Lease
    engine: int
    pins: list[StoreKey]
    pinned: set[StoreKey]


def _block_tokens(requests: Sequence[TraceRequest]) -> int:
    sizes = {getattr(r, "block_tokens", MOONCAKE_BLOCK_TOKENS) for r in requests}
    if len(sizes) != 1:
        raise ValueError(f"the trace mixes block sizes {sorted(sizes)}; one replay needs one block size")
    return sizes.pop()


# Simulated time is float seconds from the first arrival: past 2**32 s one step of a float exceeds
# a microsecond, and a prefill of milliseconds could vanish from a TTFT.
MAX_SIMULATED_S = float(2**32)


class RequestTooLargeError(ValueError):
    """A request that no schedule could serve (its KV cannot fit an engine's GPU, or its decode alone
    outlasts simulated time): ``request`` is its 0-based index in the trace and ``reason`` what is
    wrong with it (both None / the whole message when no request fits)."""

    def __init__(self, request: int | None, arrival_ms: int | None, reason: str) -> None:
        self.request, self.reason = request, reason
        super().__init__(reason if request is None else f"request {request} (arrival {arrival_ms} ms) {reason}")


class UnchainedTraceError(ValueError):
    """The trace's hash ids are not prefix-chained (``quillcache.hitrate.arrays.find_chain_break``):
    the replay uses each id as one block's identity, so a block cached after one prefix would be
    reused after another, a hit no engine could have. ``chain_break`` is the first break."""

    def __init__(self, chain_break: ChainBreak) -> None:
        self.chain_break = chain_break
        super().__init__(f"hash ids are not prefix-chained: {chain_break}; {UNCHAINED_WHY}")


# why replay refuses such a trace (the second half of its one-line refusal, after the break's place)
UNCHAINED_WHY = ("the replay uses each id as one block's identity, so a block cached after one prefix would be "
                 "reused after another, a hit no engine could have")


def check_replayable(requests: Sequence[TraceRequest], config: ReplayConfig | None = None) -> None:
    """Refuse, as ``replay`` would and before it builds anything, a trace it cannot replay: unsorted or
    empty (``TypeError``/``ValueError``), a span past ``MAX_SIMULATED_S`` (``ValueError``), ids that are
    not prefix-chained (``UnchainedTraceError``), mixed block sizes, and with ``on_oversize="stop"`` a
    request no engine could serve (``RequestTooLargeError``). Costs O(N) in the block references."""
    cfg = config if config is not None else ReplayConfig()
    if not isinstance(cfg, ReplayConfig):
        raise TypeError(f"config must be a ReplayConfig, got {type(cfg).__name__}")
    reqs = _checked(requests, cfg)
    bs = _block_tokens(reqs)
    em = _engine(cfg, bs)[3]
    _fitting(reqs, cfg, bs, em, cfg.gpu_capacity_blocks or em.gpu_capacity_blocks)


def _checked(requests: Sequence[TraceRequest], cfg: ReplayConfig) -> list[TraceRequest]:
    """The first ``cfg.limit`` requests, sorted, within simulated time and prefix-chained."""
    reqs = _check_requests(requests)
    if cfg.limit is not None:
        reqs = reqs[: cfg.limit]
    span_ms = reqs[-1].timestamp_ms - reqs[0].timestamp_ms
    span_s = span_ms / (1000.0 * cfg.time_scale)
    if span_s > MAX_SIMULATED_S:
        raise ValueError(f"time_scale={cfg.time_scale:g} stretches the trace's {span_ms} ms "
                         f"to {span_s:.3g} s of simulated time, past {MAX_SIMULATED_S:.3g} s where a float no longer "
                         f"resolves a microsecond (a TTFT would lose its prefill); raise time_scale")
    from quillcache.hitrate.arrays import find_chain_break  # the rule hitrate refuses by (imported on use)

    brk = find_chain_break([r.hash_ids for r in reqs])
    if brk is not None:
        raise UnchainedTraceError(brk)
    return reqs


class ReplayResourceError(ValueError):
    """A replay that would need more of this machine (RAM) than it has; nothing was allocated."""


def available_ram_bytes() -> int:
    """MemAvailable from /proc/meminfo, else the physical memory size (0 if neither is known)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _check_ram(need_bytes: int, engines: int, blocks: int, block_bytes: int) -> None:
    """Real-bytes DRAM tiers are allocated and touched up front: refuse before allocating what
    this machine does not have (leaving a quarter of what is available to everything else)."""
    have = available_ram_bytes()
    if have and need_bytes > 0.75 * have:
        gib = 1 << 30
        raise ReplayResourceError(
            f"real bytes need {need_bytes / gib:,.1f} GiB of DRAM ({engines} engines x {blocks:,} blocks x "
            f"{block_bytes / (1 << 20):,.0f} MiB) but this machine has {have / gib:,.1f} GiB available; lower "
            f"the DRAM capacity (--capacity-blocks) or account bytes without payloads (--account-bytes)")


def _check_requests(requests: object) -> list[TraceRequest]:
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of TraceRequest (quillcache.traces.loader.load_trace), "
                        f"got {type(requests).__name__}")
    if not requests:
        raise ValueError("the trace holds no requests")
    last = -math.inf
    for i, r in enumerate(requests):
        if not isinstance(r, TraceRequest):
            raise TypeError(f"request {i} is a {type(r).__name__}, not a TraceRequest")
        if r.timestamp_ms < last:
            raise ValueError(f"request {i}: timestamp {r.timestamp_ms} ms < previous {last} ms; "
                             f"a trace must be sorted by arrival")
        last = r.timestamp_ms
    return list(requests)


def _tier_blocks(tier: str, budget_bytes: int | None, fp16_blocks: int, fp16_bytes: int,
                 stored_bytes: int) -> tuple[int, int]:
    """(byte budget, blocks it holds) of one host tier per node: ``budget_bytes``, else
    ``fp16_blocks`` 16-bit blocks; footprints rounded to whole pages (so an fp16 tier holds exactly
    ``fp16_blocks``, in real-bytes and accounting modes alike)."""
    page = lambda n: -(-n // PAGE_BYTES) * PAGE_BYTES  # noqa: E731
    budget = fp16_blocks * page(fp16_bytes) if budget_bytes is None else budget_bytes
    blocks = budget // page(stored_bytes)
    if budget and not blocks:
        raise ValueError(f"a {tier} capacity of {budget:,} bytes holds no block of {stored_bytes:,} bytes")
    return budget, blocks


def _block_kv(key: StoreKey, shape: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Stand-in 16-bit K and V of a block: standard Gaussian float16 values drawn from its key, so
    the same key always has the same KV (the GPU tier holds no bytes to quantize)."""
    rng = np.random.default_rng(np.frombuffer(key.to_bytes(), dtype=np.uint32))
    return (rng.standard_normal(shape, dtype=np.float32).astype(np.float16),
            rng.standard_normal(shape, dtype=np.float32).astype(np.float16))


def _dram_store(cap_blocks: int, block_bytes: int, account: bool) -> LocalKvStore:
    align = PAGE_BYTES if account else 64
    foot = -(-block_bytes // align) * align
    cap = cap_blocks * foot
    if account:
        seg = min(cap, 0xFFFFFFFF * align // foot * foot)  # the allocator counts units in uint32
        per_seg = min(seg // foot + 1, 1 << 26)
    else:
        seg = min(cap, max(foot, (1 << 30) // foot * foot))
        per_seg = min(seg // foot + 1, 65536)
    return LocalKvStore(cap, segment_bytes=seg, alignment_bytes=align, max_blocks_per_segment=per_seg,
                        pretouch=not account, account_only=account)


def _engine(cfg: ReplayConfig, bs: int) -> tuple[CostModel, TierCodec | None, KvLayout, EngineModel]:
    """The cost model, the host tiers' codec (None for fp16), the KV layout and the engine model of a run
    with ``bs``-token blocks."""
    layout = KvLayout(dtype=cfg.kv_dtype, block_size_tokens=bs, tp_size=cfg.tp_size)
    cm = CostModel(model=MODELS[cfg.model], gpu=GPUS[cfg.gpu], prefill_mfu=cfg.prefill_mfu)
    mp = MODELS[cfg.model]
    tc = None if cfg.kv_codec == FP16 else TierCodec(
        cfg.kv_codec, tokens=bs, layers=mp.num_layers, kv_heads=max(1, -(-mp.num_kv_heads // cfg.tp_size)),
        head_dim=mp.head_dim)
    em = EngineModel(cost_model=cm, layout=layout, gpu_memory_utilization=cfg.gpu_memory_utilization,
                     decode_mbu=cfg.decode_mbu, tier_block_bytes=tc.block_bytes if tc else 0,
                     dequant_hbm_share=cfg.dequant_hbm_share)
    return cm, tc, layout, em


def _too_large(r: TraceRequest, cfg: ReplayConfig, bs: int, em: EngineModel, cap: int, t0_ms: int) -> str | None:
    """Why an engine cannot serve ``r`` at all, or None. The bounds are the replay's own limits:

    - the prompt's KV is held on the engine's GPU for its prefill: ``ceil(input / bs) <= cap`` blocks;
    - the output's KV: the replay's GPU tier holds prompt blocks only (a decode's own KV is not placed
      in it, and ``EngineModel.decode_s`` charges it as bandwidth), so the capacity bounds the output's
      KV on its own, ``ceil(output / bs) <= cap``, not prompt and output together (a capacity exactly
      the prompt's blocks stays a valid setup);
    - it must finish within microsecond-exact simulated time: its arrival plus its decode alone (with
      an empty batch, the least ``EngineModel.decode_s`` gives; the prefill and any queueing only add)
      must not pass ``MAX_SIMULATED_S``."""
    need = -(-r.input_tokens // bs)
    if need > cap:
        return (f"needs {need:,} KV blocks of {bs} tokens for its {r.input_tokens:,}-token prompt, but an engine's "
                f"GPU holds {cap:,} ({cfg.model} on {cfg.gpu})")
    out = -(-r.output_tokens // bs)
    if out > cap:
        return (f"needs {out:,} KV blocks of {bs} tokens for its {r.output_tokens:,}-token output, but an engine's "
                f"GPU holds {cap:,} ({cfg.model} on {cfg.gpu})")
    finish_s = (r.timestamp_ms - t0_ms) / (1000.0 * cfg.time_scale) + em.decode_s(r.output_tokens, r.input_tokens)
    if finish_s > MAX_SIMULATED_S:
        return (f"decodes its {r.output_tokens:,}-token output until at least {finish_s:.3g} s of simulated time, "
                f"past {MAX_SIMULATED_S:.3g} s where times lose microsecond precision")
    return None


def _fitting(requests: list[TraceRequest], cfg: ReplayConfig, bs: int, em: EngineModel,
             cap: int) -> tuple[list[int], list[TraceRequest], int]:
    """The requests an engine can serve at all (``_too_large``), with their indices in ``requests`` (a
    row's ``request_id`` names its trace request even after skips), and how many were skipped
    (``cfg.on_oversize``: stop naming the first that cannot be served, or skip and count them)."""
    ids: list[int] = []
    out: list[TraceRequest] = []
    skipped = 0
    t0_ms = requests[0].timestamp_ms
    for i, r in enumerate(requests):
        why = _too_large(r, cfg, bs, em, cap, t0_ms)
        if why is None:
            ids.append(i)
            out.append(r)
            continue
        if cfg.on_oversize == "stop":
            raise RequestTooLargeError(i, r.timestamp_ms, f"{why}; skip such requests with on_oversize='skip' "
                                                         f"(--on-error skip)")
        skipped += 1
    if not out:
        raise RequestTooLargeError(None, None, f"none of the {len(requests)} requests fits an engine's GPU KV "
                                               f"capacity ({cap:,} blocks of {bs} tokens) and simulated time")
    return ids, out, skipped


class _Replay:
    """One run's state (see the module docstring for the event model)."""

    def __init__(self, requests: list[TraceRequest], cfg: ReplayConfig, pool: BytePool | None = None) -> None:
        self.cfg = cfg
        self.requests = requests
        if cfg.kv_codec != FP16:  # the config's own dtype was checked by ReplayConfig; a trace line may name another
            wide = next((i for i, r in enumerate(requests) if DTYPE_BYTES[self._identity_key(r)[4]] != 2), None)
            if wide is not None:
                d = self._identity_key(requests[wide])[4]
                raise ValueError(f"request {wide} of the trace has kv_dtype={d!r} ({DTYPE_BYTES[d]} byte(s) per "
                                 f"element): kv_codec={cfg.kv_codec!r} quantizes 16-bit KV only")
        self.bs = bs = _block_tokens(requests)
        cm, self.tc, self.layout, self.em = _engine(cfg, bs)
        self.gpu_cap = cfg.gpu_capacity_blocks or self.em.gpu_capacity_blocks
        # the trace's clock: time 0 is its first arrival, whether or not that request is skipped
        self.t0_ms = requests[0].timestamp_ms
        # rids[k]: requests[k]'s index in the trace
        self.rids, requests, self.skipped_oversize = _fitting(requests, cfg, bs, self.em, self.gpu_cap)
        self.requests = requests
        bb = self.em.block_bytes
        self.tb = tb = self.tc.block_bytes if self.tc else bb  # bytes of a block in DRAM / SSD
        self.dram_budget, self.dram_cap_blocks = _tier_blocks("DRAM", cfg.dram_capacity_bytes,
                                                              cfg.dram_capacity_blocks, bb, tb)
        self.ssd_budget, self.ssd_cap_blocks = _tier_blocks("SSD", cfg.ssd_capacity_bytes, cfg.ssd_capacity_blocks,
                                                            bb, tb)
        # distinct blocks by their store key (the whole identity scope, tokenizer and KV dtype included, and the id),
        # each counted in tier blocks of ``tb`` bytes: a wider KV dtype's block takes more than one (no codec)
        keys = {(self._identity_key(r), h) for r in requests for h in r.hash_ids[: r.input_tokens // bs]}
        slots = {d: 1 if self.tc else -(-cm.block_bytes(KvLayout(dtype=d, block_size_tokens=bs, tp_size=cfg.tp_size))
                                         // tb) for d in {k[4] for k, _ in keys}}
        distinct = sum(slots[k[4]] for k, _ in keys)
        # what real bytes would allocate: a DRAM tier of at least one block, even for a trace with no full block
        real_bytes = cfg.engines * tb * (min(self.dram_cap_blocks, max(1, distinct))
                                         + min(self.ssd_cap_blocks, distinct))
        self.account = cfg.account_bytes if cfg.account_bytes is not None else real_bytes > cfg.real_bytes_budget_bytes
        # in real-bytes mode a tier never holds more than the distinct blocks: allocate no more
        dram_blocks = self.dram_cap_blocks if self.account else min(self.dram_cap_blocks, max(1, distinct))
        ssd_blocks = self.ssd_cap_blocks if self.account else min(self.ssd_cap_blocks, distinct)
        if not self.account:
            _check_ram(cfg.engines * dram_blocks * tb, cfg.engines, dram_blocks, tb)
        self.index = open_index(cfg.index)
        self.names = [f"engine-{i}" for i in range(cfg.engines)]
        self.registry = IdentityRegistry()
        self.planner = Planner(self.index, self.names, router=cfg.router, registry=self.registry,
                               config=PlannerConfig(block_size_tokens=bs, ttft_slo_s=cfg.ttft_slo_s,
                                                    enable_guard=cfg.enable_guard, cost_model=cm, seed=cfg.seed))
        self.now = 0.0
        self._victims: list[StoreKey] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="quillcache-replay-") if (ssd_blocks and not self.account) else None
        self.planes: dict[str, StoreDataPlane] = {}
        for name in self.names:
            ssd = None
            if ssd_blocks:
                foot = -(-tb // PAGE_BYTES) * PAGE_BYTES
                if self.account:
                    ssd = SsdTier(None, capacity_bytes=ssd_blocks * foot, account_only=True)
                else:
                    assert self._tmp is not None
                    ssd = SsdTier(f"{self._tmp.name}/{name}", capacity_bytes=ssd_blocks * foot,
                                  slab_bytes=foot * max(1, min((256 << 20) // foot, ssd_blocks)))
            self.planes[name] = StoreDataPlane(
                name, dram=_dram_store(dram_blocks, tb, self.account), ssd=ssd, gpu_capacity_blocks=self.gpu_cap,
                index=self.index, policy=cfg.policy, clock=self._clock,
                on_evict=functools.partial(self._evicted, name))
        self.dps = [self.planes[n] for n in self.names]
        self.free_at = [0.0] * cfg.engines
        self._identities: dict[tuple[str, str, str, str, str], Identity] = {}
        self._zeros: dict[int, memoryview] = {}
        self.moved = dict.fromkeys(("fetched_dram", "fetched_ssd", "fetched_peer", "offloaded"), 0)
        self.verify_failures = 0
        self.skipped_empty = 0
        self.dequantized = 0  # blocks decoded and dequantized on fetch (real bytes with a codec)
        self.pool: BytePool = AccountingPool() if pool is None else pool
        bind = getattr(self.pool, "bind", None)
        if bind is not None:
            bind(cm, self.tb)
        self._pool_ops: list[tuple[str, PoolBlock]] = []  # this event's seam points, in order

    # ---- plumbing ----------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def _evicted(self, node: str, key: StoreKey, tier: CacheTier) -> None:
        if tier == GPU:
            self._victims.append(key)
        else:  # a DRAM or SSD drop: bytes are exclusive between the two, so they left the node
            self._pool_ops.append(("drop", PoolBlock(key, node, self.tb)))

    def _flush_pool(self) -> None:
        """Hand this event's seam points to the pool: runs of the same operation as one batch each,
        in the order they happened (a block fetched, then dropped, is fetched first)."""
        ops = self._pool_ops
        if not ops:
            return
        self._pool_ops = []
        pool = self.pool
        start = 0
        for i in range(1, len(ops) + 1):
            if i == len(ops) or ops[i][0] != ops[start][0]:
                batch = [b for _, b in ops[start:i]]
                getattr(pool, ops[start][0])(batch)
                start = i

    def _identity_key(self, r: TraceRequest) -> tuple[str, str, str, str, str]:
        """(tenant, model, tokenizer, adapter, KV dtype) of a request, the config's where the trace names none."""
        cfg = self.cfg
        return (getattr(r, "tenant", "") or cfg.tenant, getattr(r, "model", "") or cfg.model,
                getattr(r, "tokenizer", ""), getattr(r, "adapter", ""), getattr(r, "kv_dtype", "") or cfg.kv_dtype)

    def _identity(self, r: TraceRequest) -> Identity:
        k = self._identity_key(r)
        ident = self._identities.get(k)
        if ident is None:
            layout = KvLayout(dtype=k[4], block_size_tokens=self.bs, tp_size=self.cfg.tp_size)
            ident = self._identities[k] = make_identity(model=k[1], tenant=k[0], tokenizer=k[2], adapter=k[3],
                                                        layout=layout)
        return ident

    def _payload(self, key: StoreKey, size: int) -> object:
        """The bytes a host tier stores for ``key``: ``size`` zeros (accounting), the key repeated
        (real bytes, fp16), or the codec's stored block of the key's K/V (real bytes, a codec)."""
        if self.account:
            z = self._zeros.get(size)
            if z is None:
                z = self._zeros[size] = memoryview(np.zeros(size, dtype=np.uint8)).toreadonly()
            return z
        if self.tc is not None:
            return self.tc.encode(*_block_kv(key, self.tc.shape))
        return np.resize(np.frombuffer(key.to_bytes(), dtype=np.uint8), size)

    def _check_bytes(self, key: StoreKey, data: object) -> None:
        if self.account:
            return
        if self.tc is not None:  # the promotion to GPU: decode (crc32c) and dequantize
            self.dequantized += 1
            try:
                k2, v2 = self.tc.decode(data)
            except ValueError:  # KVBlockError (a KVQuantError, a ValueError) or a wrong length
                self.verify_failures += 1
                return
            k, v = _block_kv(key, self.tc.shape)
            self.verify_failures += not (self.tc.within_error(k2, k) and self.tc.within_error(v2, v))
            return
        raw = key.to_bytes()
        if bytes(memoryview(data)[: len(raw)]) != raw:
            self.verify_failures += 1

    def _offload(self, dp: StoreDataPlane, key: StoreKey, size: int) -> None:
        """A block leaving the GPU: keep its KV in the node's DRAM (the data plane demotes/drops);
        ``size`` is its 16-bit size on the GPU, the DRAM copy is ``self.tb`` bytes (quantized with a
        codec)."""
        if key in dp.dram or (dp.ssd is not None and key in dp.ssd):
            return
        size = self.tb if self.tc is not None else size
        try:
            placed = dp.put(key, self._payload(key, size), tier=DRAM)
        except StoreFullError:  # every DRAM/SSD block is pinned: the KV is dropped
            return
        if placed is not None:
            self.moved["offloaded"] += size
            self._pool_ops.append(("offload", PoolBlock(key, dp.node, size)))

    def _drain_victims(self, dp: StoreDataPlane, size: int) -> None:
        while self._victims:
            self._offload(dp, self._victims.pop(0), size)

    # ---- events ------------------------------------------------------------------------------
    def arrive(self, rid: int, r: TraceRequest, t: float) -> _Flight | None:
        cfg, bs, em = self.cfg, self.bs, self.em
        if r.input_tokens == 0:
            self.skipped_empty += 1
            return None
        ident = self._identity(r)
        scope = self.planner.scope(ident)
        nfull = r.input_tokens // bs
        hashes = np.fromiter(r.hash_ids[:nfull], dtype=np.uint64, count=nfull)
        plan = self.planner.plan(PlanRequest(scope, hashes, r.input_tokens, r.output_tokens))
        w = plan.worker_index
        me = self.names[w]
        dp = self.dps[w]
        hits = {"gpu": 0, "dram": 0, "ssd": 0, "peer": 0}
        kinds: list[int] = []
        pins: list[StoreKey] = []
        fetched = 0
        for e in plan.reused_entries() if plan.reused_blocks else ():
            key = StoreKey(e.block_hash, e.identity)
            src = self.planes[e.node]
            local = e.node == me
            if e.tier == GPU:
                if GPU not in src.tiers_of(key):
                    break
                if local:
                    dp.pin(key)
                    pins.append(key)
                    hits["gpu"] += 1
                    kinds.append(0)
                else:  # GPU-to-GPU: the data plane holds no bytes for a GPU-only block
                    hits["peer"] += 1
                    kinds.append(3)
                    self.moved["fetched_peer"] += e.size_bytes
                    fetched += e.size_bytes
                continue
            tier = DRAM if key in src.dram else SSD
            try:
                data = src.get(key)
            except BlockNotFoundError:
                break
            self._check_bytes(key, data)
            size = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
            self.moved["fetched_dram" if tier == DRAM else "fetched_ssd"] += size
            fetched += size
            if local:
                hits["dram" if tier == DRAM else "ssd"] += 1
                kinds.append(1 if tier == DRAM else 2)
            else:
                hits["peer"] += 1
                kinds.append(4 if tier == DRAM else 5)
                self.moved["fetched_peer"] += size
                self._pool_ops.append(("fetch", PoolBlock(key, e.node, size,
                                                          PEER_DRAM_KIND if tier == DRAM else PEER_SSD_KIND)))
        self._flush_pool()
        k = len(kinds)
        cached = min(k * bs, r.input_tokens - 1)
        fetch_s = em.fetch_s(kinds)
        prefill_s = em.prefill_s(r.input_tokens - cached, cached)
        lease = self.planner.admit(plan)
        start = max(t + fetch_s, self.free_at[w])
        done = start + prefill_s
        self.free_at[w] = done
        row = RequestRow(
            request_id=rid, engine=me, tenant=ident.tenant, arrival_s=t, input_tokens=r.input_tokens,
            output_tokens=r.output_tokens, full_blocks=nfull, hit_gpu=hits["gpu"], hit_dram=hits["dram"],
            hit_ssd=hits["ssd"], hit_peer=hits["peer"], recompute_blocks=nfull - k, cached_tokens=cached,
            fetch_bytes=fetched, fetch_s=fetch_s, queue_s=start - (t + fetch_s), prefill_s=prefill_s,
            ttft_s=done - t, decode_s=0.0, finish_s=math.nan, predicted_ttft_s=plan.predicted_ttft_s,
            meets_slo=done - t <= cfg.ttft_slo_s)
        return _Flight(row, plan, lease, w, pins, set(pins))

    def prefill_done(self, fl: _Flight, t: float) -> float:
        """Record the blocks on the engine's GPU; returns the decode time."""
        fl.lease.prefill_done()
        dp = self.dps[fl.engine]
        me = self.names[fl.engine]
        mine = [e for e in self.planner.resident_entries(fl.plan) if e.node == me]
        keys = [StoreKey(e.block_hash, e.identity) for e in mine]
        num_hit = 0
        while num_hit < len(keys) and GPU in dp.tiers_of(keys[num_hit]):
            num_hit += 1
        # Prefix-aware policies (QuillHD, length-aware) learn from the request's block order; the
        # keys are full blocks only, so no partial-tail hint (input_tokens=None).
        dp.begin_request(keys, num_hit, tier=GPU)
        for e, key in zip(mine, keys):
            if GPU in dp.tiers_of(key):
                dp.touch(key, GPU)  # a GPU hit: refresh its place in the GPU policy
                if key not in fl.pinned:
                    dp.pin(key)
                    fl.pins.append(key)
                    fl.pinned.add(key)
                continue
            try:
                placed = dp.put(key, e.size_bytes, tier=GPU)
            except StoreFullError:  # every GPU block is pinned by running requests
                placed = None
            self._drain_victims(dp, e.size_bytes)
            if placed is None:
                self._offload(dp, key, e.size_bytes)
            else:
                dp.pin(key)
                fl.pins.append(key)
                fl.pinned.add(key)
        self._flush_pool()
        r = fl.row
        own = -(-r.input_tokens // self.bs) * self.bs
        batch = max(0, int(self.planner.loads.decode_blocks[fl.engine]) * self.bs - own)
        return self.em.decode_s(r.output_tokens, r.input_tokens, batch)

    def finish(self, fl: _Flight, t: float) -> None:
        dp = self.dps[fl.engine]
        for key in fl.pins:
            dp.unpin(key)
        fl.lease.release()
        fl.row.finish_s = t

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, progress: Progress | None) -> list[RequestRow]:
        reqs, rids = self.requests, self.rids
        n = len(reqs)
        scale = 1000.0 * self.cfg.time_scale
        t0_ms = self.t0_ms  # simulated time starts at the trace's first arrival (skipped or not)
        heap: list[tuple[float, int, int, _Flight]] = []
        rows: list[RequestRow] = []
        seq = 0
        i = 0
        step = max(1, n // 200)
        while i < n or heap:
            t_arr = (reqs[i].timestamp_ms - t0_ms) / scale if i < n else math.inf
            if heap and heap[0][0] <= t_arr:
                t, _, kind, fl = heapq.heappop(heap)
                if t > MAX_SIMULATED_S:  # _too_large bounds each request alone; queueing could still add up
                    arrival_ms = t0_ms + round(fl.row.arrival_s * scale)  # request_id: its index in the trace
                    raise RequestTooLargeError(fl.row.request_id, arrival_ms, (
                        f"has events at {t:.3g} s of simulated time (its queueing included), past "
                        f"{MAX_SIMULATED_S:.3g} s where times lose microsecond precision"))
                self.now = t
                if kind == _PREFILL_DONE:
                    dec = self.prefill_done(fl, t)
                    fl.row.decode_s = dec
                    heapq.heappush(heap, (t + dec, seq, _DECODE_DONE, fl))
                    seq += 1
                else:
                    self.finish(fl, t)
                continue
            self.now = t_arr
            fl = self.arrive(rids[i], reqs[i], t_arr)
            if fl is not None:
                rows.append(fl.row)
                heapq.heappush(heap, (t_arr + fl.row.ttft_s, seq, _PREFILL_DONE, fl))
                seq += 1
            i += 1
            if progress is not None and (i % step == 0 or i == n):
                progress(i, n)
        return rows

    def bytes_moved(self) -> dict[str, int]:
        st = [dp.stats() for dp in self.dps]
        return {**self.moved, "dram_to_ssd": sum(s.bytes_dram_to_ssd for s in st),
                "ssd_to_dram": sum(s.bytes_ssd_to_dram for s in st), "evicted": sum(s.bytes_evicted for s in st)}

    def close(self) -> None:
        _close_all(self.dps, self.index, self._tmp)


def _close_all(planes, index: IndexBackend | None, tmp: tempfile.TemporaryDirectory | None) -> None:
    """Close every data plane, then the index, then remove the temporary folder, each one tried even
    when an earlier one raised (a failed index refuses the planes' flush); the first error is raised
    once all were tried."""
    first: BaseException | None = None
    steps = [dp.close for dp in planes] + [index.close if index is not None else None,
                                           tmp.cleanup if tmp is not None else None]
    for step in steps:
        if step is None:
            continue
        try:
            step()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once everything was closed
            first = exc if first is None else first
    if first is not None:
        raise first


def replay(requests: Sequence[TraceRequest], config: ReplayConfig | None = None, *,
           progress: Progress | None = None, keep_open: bool = False, pool: BytePool | None = None) -> ReplayResult:
    """Replay ``requests`` (sorted by arrival) under ``config``; see the module docstring.

    ``progress(done, total)`` is called every 0.5% of arrivals. ``keep_open=True`` keeps the index
    and data planes open in the result (for inspection; ``result.close()`` them). ``pool``: where
    offloads, drops and peer fetches move bytes (default ``AccountingPool``: nowhere); the caller
    owns it (closes it), the replay only calls it."""
    cfg = config if config is not None else ReplayConfig()
    if not isinstance(cfg, ReplayConfig):
        raise TypeError(f"config must be a ReplayConfig, got {type(cfg).__name__}")
    if pool is not None and not isinstance(pool, BytePool):
        raise TypeError(f"pool must be a BytePool (offload, drop, fetch, report, close), got {type(pool).__name__}")
    reqs = _checked(requests, cfg)
    t0 = time.perf_counter()
    sim = _Replay(reqs, cfg, pool)
    try:
        rows = sim.run(progress)
        wall = time.perf_counter() - t0
        setup = {"engines": cfg.engines, "router": cfg.router, "policy": cfg.policy, "model": cfg.model,
                 "gpu": cfg.gpu, "account_bytes": sim.account, "block_tokens": sim.bs,
                 "gpu_capacity_blocks": sim.gpu_cap, "dram_capacity_blocks": sim.dram_cap_blocks,
                 "ssd_capacity_blocks": sim.ssd_cap_blocks, "kv_codec": cfg.kv_codec,
                 "tier_block_bytes": sim.tb, "dram_capacity_bytes": sim.dram_budget,
                 "ssd_capacity_bytes": sim.ssd_budget}
        summary = summarize(rows, setup=setup, bytes_moved=sim.bytes_moved(), slo_ttft_s=cfg.ttft_slo_s, wall_s=wall)
    except BaseException as exc:
        try:
            sim.close()
        except Exception as close_exc:  # noqa: BLE001 - the first error (Ctrl-C, a stop signal) is what happened
            # e.g. an interrupt inside the index's batch fails the index, whose flush then refuses the planes'
            # close: said in one line, never raised in place of what is propagating
            log.warning("closing the replay after %s also failed: %s", type(exc).__name__,
                        " ".join(str(close_exc).split()))
        raise
    result = ReplayResult(cfg, summary, rows, sim.em, sim.account, sim.verify_failures, sim.skipped_empty,
                          sim.skipped_oversize, sim.dequantized, sim.pool.report())
    if keep_open:
        result.index, result.planes, result._tmp = sim.index, sim.planes, sim._tmp
    else:
        sim.close()
    return result
