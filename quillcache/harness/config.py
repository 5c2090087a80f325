"""``ReplayConfig``: every knob of a trace replay, with its default (frozen, validated on creation).

Defaults describe a small aggregated cluster serving the Mooncake conversation trace: 4 engines of
Llama-3-8B on H100 SXM GPUs (every engine prefills and decodes), the Dynamo cost router, LRU in
every tier, per node 8,192 DRAM blocks and 32,768 SSD blocks (at 512-token blocks of Llama-3-8B,
64 MiB each: 512 GiB of DRAM and 2 TiB of SSD per node), a 2 s TTFT SLO. GPU KV capacity comes
from the engine model unless ``gpu_capacity_blocks`` is set.

Byte accounting (``account_bytes``): ``True`` = DRAM/SSD tiers allocate offsets without bytes
(``LocalKvStore(account_only=True)``, ``SsdTier(account_only=True)``); ``False`` = real bytes
(DRAM segments, SSD slab files in a temporary directory); ``None`` (default) = real bytes only
when the trace's distinct blocks fit in ``real_bytes_budget_bytes`` (2 GiB), else accounting.

Quantized tiers (``kv_codec``): ``"fp16"`` (default) stores the GPU's 16-bit KV as is; ``"int8"``,
``"fp8_e4m3"``, ``"int4"``, ``"int2"`` (``quillcache.kvquant``) quantize every block that leaves a GPU
for DRAM and SSD (the GPU keeps 16-bit KV, like vLLM's offloading), see
``quillcache.store.tier_codec``. Tier capacity is a BYTE budget per node: ``dram_capacity_bytes`` /
``ssd_capacity_bytes`` when given, else ``dram_capacity_blocks`` / ``ssd_capacity_blocks`` x the
footprint of one 16-bit block in that tier. So "equal tier bytes" is the same budget whatever the
codec: an fp16 tier holds exactly ``*_capacity_blocks`` blocks, a quantized tier
``budget // quantized footprint`` (about 1.94x for int8, 2.67x for int4 at Llama-3-8B shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

from quillcache._checks import check_float, check_int
from quillcache.identity.scope import validate_tenant_id
from quillcache.index import INDEX_BACKENDS
from quillcache.planner.profiles import DTYPE_BYTES, GPUS, MODELS
from quillcache.policies import POLICIES
from quillcache.routing import ROUTERS
from quillcache.store.tier_codec import FP16, check_tier_codec

__all__ = ["REPLAY_POLICIES", "ReplayConfig"]

# belady needs a next-use oracle from the whole trace (an offline bound) and lookahead one from the engine's
# queue (semi-online, quillcache.hitrate only): neither is a tier policy
_NEEDS_ORACLE = {"belady": "belady needs the future; it is the offline bound of quillcache.hitrate",
                 "lookahead": "lookahead sees the engine's queued requests; it is a semi-online policy of "
                              "quillcache.hitrate (quillcache hitrate --policies lookahead)"}
REPLAY_POLICIES = tuple(sorted(n for n in POLICIES if n not in _NEEDS_ORACLE))


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """Every knob of :func:`quillcache.harness.replay` (see the module docstring for defaults)."""

    model: str = "llama-3-8b"  # quillcache.planner.profiles.MODELS
    gpu: str = "h100-sxm"  # quillcache.planner.profiles.GPUS
    kv_dtype: str = "bfloat16"  # default KV layout dtype (a trace line may name its own)
    tp_size: int = 1  # tensor-parallel GPUs per engine
    engines: int = 4
    router: str = "dynamo"  # quillcache.routing.ROUTERS
    policy: str = "lru"  # eviction policy of every tier (REPLAY_POLICIES)
    gpu_capacity_blocks: int | None = None  # None: from the engine model
    dram_capacity_blocks: int = 8192  # per node (the CLI's --capacity-blocks)
    ssd_capacity_blocks: int = 32768  # per node; 0 = no SSD tier
    # byte budgets per node (None: the *_capacity_blocks of 16-bit blocks; module docstring)
    dram_capacity_bytes: int | None = None
    ssd_capacity_bytes: int | None = None  # 0 = no SSD tier
    kv_codec: str = FP16  # codec of the DRAM and SSD tiers: fp16 (none), int8, fp8_e4m3, int4, int2
    # ASSUMPTION (stand-in): share of the GPU's HBM bandwidth a dequantize kernel reaches, reading the
    # quantized block and writing 16-bit KV (issue 17's GPU target: >= 70% of a device-to-device copy)
    dequant_hbm_share: float = 0.7
    account_bytes: bool | None = None  # None = auto (module docstring)
    real_bytes_budget_bytes: int = 2 << 30
    ttft_slo_s: float = 2.0
    time_scale: float = 1.0  # arrival times are divided by this (2.0 = twice the request rate)
    gpu_memory_utilization: float = 0.9  # vLLM's default share of GPU memory for weights + KV
    decode_mbu: float = 0.6  # ASSUMPTION: achieved share of HBM bandwidth while decoding
    prefill_mfu: float = 0.5  # ASSUMPTION: see quillcache.planner.profiles
    enable_guard: bool = True
    index: str = "art"
    tenant: str = "default"  # tenant of trace lines that name none (Mooncake traces)
    seed: int = 0
    limit: int | None = None  # replay only the first `limit` requests
    # a request whose prompt KV does not fit an engine's GPU KV capacity cannot be prefilled: "stop" refuses the trace naming it, "skip" leaves it out and counts it
    on_oversize: str = "stop"

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; known: {sorted(MODELS)}")
        if self.gpu not in GPUS:
            raise ValueError(f"unknown GPU {self.gpu!r}; known: {sorted(GPUS)}")
        ROUTERS.check(self.router)
        if self.policy not in REPLAY_POLICIES:
            extra = f" ({_NEEDS_ORACLE[self.policy]})" if self.policy in _NEEDS_ORACLE else ""
            raise ValueError(f"unknown policy {self.policy!r}{extra}; the replay takes: {list(REPLAY_POLICIES)}")
        if self.kv_dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown kv_dtype {self.kv_dtype!r}; known: {sorted(DTYPE_BYTES)}")
        INDEX_BACKENDS.check(self.index)
        check_int("tp_size", self.tp_size, 1, 2**32 - 1)  # KvLayout packs it into 4 bytes
        check_int("engines", self.engines, 1, 1024)
        if self.gpu_capacity_blocks is not None:
            check_int("gpu_capacity_blocks", self.gpu_capacity_blocks, 1)
        check_int("dram_capacity_blocks", self.dram_capacity_blocks, 1)
        check_int("ssd_capacity_blocks", self.ssd_capacity_blocks, 0)
        if self.dram_capacity_bytes is not None:
            check_int("dram_capacity_bytes", self.dram_capacity_bytes, 1)
        if self.ssd_capacity_bytes is not None:
            check_int("ssd_capacity_bytes", self.ssd_capacity_bytes, 0)
        check_tier_codec(self.kv_codec)
        if self.kv_codec != FP16 and DTYPE_BYTES[self.kv_dtype] != 2:
            raise ValueError(f"kv_codec={self.kv_codec!r} quantizes 16-bit KV; kv_dtype={self.kv_dtype!r} is "
                             f"{DTYPE_BYTES[self.kv_dtype]} byte(s) per element (use float16 or bfloat16)")
        if self.account_bytes is not None and not isinstance(self.account_bytes, bool):
            raise TypeError(f"account_bytes={self.account_bytes!r}; expected True, False or None (auto)")
        check_int("real_bytes_budget_bytes", self.real_bytes_budget_bytes, 1)
        check_float("ttft_slo_s", self.ttft_slo_s, 0.0, 1e6, lo_open=True)
        check_float("time_scale", self.time_scale, 1e-6, 1e6)  # beyond: arrival times lose their precision
        for name in ("gpu_memory_utilization", "decode_mbu", "prefill_mfu", "dequant_hbm_share"):
            check_float(name, getattr(self, name), 0.0, 1.0, lo_open=True)
        if not isinstance(self.enable_guard, bool):
            raise TypeError(f"enable_guard={self.enable_guard!r}; expected a bool")
        validate_tenant_id(self.tenant)
        check_int("seed", self.seed, 0)
        if self.limit is not None:
            check_int("limit", self.limit, 1)
        if self.on_oversize not in ("stop", "skip"):
            raise ValueError(f"on_oversize={self.on_oversize!r} must be 'stop' or 'skip'")
