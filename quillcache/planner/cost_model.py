"""Fetch-versus-recompute cost model: what a block costs to bring in, and to recompute.

Source kinds (where the bytes of one block come from; the index of ``SOURCE_NAMES``): 0 the
chosen worker's GPU (free), 1 its host DRAM (host link), 2 its SSD (SSD read then host link,
pipelined: the slower of the two, both latencies), 3/4/5 another node's GPU/DRAM/SSD over the peer
link (bounded by the host link too: network bytes cross the GPU's PCIe; SSD: the slower of SSD and
network), 6 a remote tier. Each block takes its cheapest allowed source, by ``per_block_s +
latency_s`` of the kind (lower kind on a tie).

A prefix of ``k`` reusable blocks costs ``fetch(k) = sum_j<k block_bytes / bandwidth[kind_j]``
plus each distinct kind's per-transfer latency once (one batched transfer per source kind).
Prefilling tokens ``[s, e)`` costs ``a (e - s) + c (e(e-1)/2 - s(s-1)/2)`` seconds with
``a = 2 params / (peak x MFU)`` and ``c = 4 layers attn_dim / (peak x MFU)`` (the token at position
``t`` attends to ``t`` earlier tokens); at least the last prompt token is always computed (the engine
needs its logits), so the planner reuses at most ``(isl - 1) // bs`` blocks (vLLM's rule: a fully
cached block-aligned prompt recomputes its last block). Predicted TTFT of reusing ``k`` blocks =
queue + fetch(k) + prefill(min(k bs, isl - 1), isl), where queue = ``a x`` the worker's in-flight
prefill tokens. Transfers are assumed
NOT overlapped with compute (conservative; layer-wise pipelining would lower fetch costs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from quillcache._checks import check_float
from quillcache.planner.profiles import (
    DTYPE_BYTES,
    GPUS,
    LINKS,
    MODELS,
    GpuProfile,
    LinkProfile,
    ModelProfile,
)
from quillcache.types import KvLayout

__all__ = ["NUM_SOURCE_KINDS", "SOURCE_NAMES", "CostModel"]

SOURCE_NAMES = ("local-gpu", "local-dram", "local-ssd", "peer-gpu", "peer-dram", "peer-ssd", "remote")
NUM_SOURCE_KINDS = len(SOURCE_NAMES)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-block fetch costs by source kind and prefill time, from cited profiles."""

    model: ModelProfile = field(default_factory=lambda: MODELS["llama-3-8b"])
    gpu: GpuProfile = field(default_factory=lambda: GPUS["h100-sxm"])
    host_link: LinkProfile = field(default_factory=lambda: LINKS["pcie5-x16"])
    ssd_link: LinkProfile = field(default_factory=lambda: LINKS["nvme-gen4"])
    peer_link: LinkProfile = field(default_factory=lambda: LINKS["rdma-4x200g"])
    prefill_mfu: float = 0.5  # ASSUMPTION (see profiles module doc)

    def __post_init__(self) -> None:
        for name, cls in (("model", ModelProfile), ("gpu", GpuProfile), ("host_link", LinkProfile),
                          ("ssd_link", LinkProfile), ("peer_link", LinkProfile)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"CostModel.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        check_float("CostModel.prefill_mfu", self.prefill_mfu, 0.0, 1.0, lo_open=True, type_error=ValueError)

    # ---- compute ---------------------------------------------------------------------------
    @property
    def prefill_coeffs(self) -> tuple[float, float]:
        """``(a, c)`` seconds: per token, and per token per token of context."""
        rate = self.gpu.dense_bf16_flops * self.prefill_mfu
        return self.model.weight_flops_per_token / rate, self.model.attn_flops_per_token_per_context / rate

    def prefill_s(self, start_tokens: int, end_tokens: int) -> float:
        """Seconds to prefill prompt positions ``[start_tokens, end_tokens)``."""
        if not 0 <= start_tokens <= end_tokens:
            raise ValueError(f"prefill range [{start_tokens}, {end_tokens}) is invalid")
        a, c = self.prefill_coeffs
        s, e = start_tokens, end_tokens
        return a * (e - s) + c * (e * (e - 1) / 2 - s * (s - 1) / 2)

    # ---- bytes -----------------------------------------------------------------------------
    def block_bytes(self, layout: KvLayout) -> int:
        """KV bytes of one block of ``layout`` held by one tensor-parallel rank."""
        if not isinstance(layout, KvLayout):
            raise TypeError(f"layout must be a KvLayout, got {type(layout).__name__}")
        per_token = self.model.kv_bytes_per_token(DTYPE_BYTES[layout.dtype])
        return math.ceil(per_token * layout.block_size_tokens / layout.tp_size)

    def source_costs(self, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
        """``(per_block_s, latency_s)``, float64 arrays indexed by source kind."""
        h, s, p = self.host_link, self.ssd_link, self.peer_link
        hb, sb = h.bandwidth_bytes_per_s, s.bandwidth_bytes_per_s
        pb = min(p.bandwidth_bytes_per_s, hb)  # bytes from the network still cross the GPU's PCIe link
        bw = [math.inf, hb, min(sb, hb), pb, pb, min(sb, pb), min(sb, pb)]
        lat = [0.0, h.latency_s, s.latency_s + h.latency_s, p.latency_s, p.latency_s,
               s.latency_s + p.latency_s, s.latency_s + p.latency_s]
        per_block = np.array([block_bytes / b for b in bw], dtype=np.float64)
        return per_block, np.array(lat, dtype=np.float64)

    def fetch_s(self, kinds: list[int], block_bytes: int) -> float:
        """Seconds to bring in blocks from the given source kinds (reference formula). Every kind
        must be an integer in ``[0, NUM_SOURCE_KINDS)``; otherwise ``ValueError`` naming the first
        bad one (checked on the whole array at once)."""
        ks = np.asarray(kinds)
        if ks.size:
            if ks.ndim != 1 or ks.dtype.kind not in "iu":
                raise ValueError(f"kinds must be a 1-D sequence of integer source kinds, got {kinds!r:.80}")
            bad = (ks < 0) | (ks >= NUM_SOURCE_KINDS)
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"kinds[{i}]={int(ks[i])} is not a source kind: must be in [0, {NUM_SOURCE_KINDS}) "
                                 f"({', '.join(SOURCE_NAMES)})")
        per_block, lat = self.source_costs(block_bytes)
        total, seen = 0.0, set()
        for k in ks.tolist():
            total += float(per_block[k])
            if k not in seen:
                seen.add(k)
                total += float(lat[k])
        return total
