"""Hit-rate-only replay of the prefix-aware block cache: ``simulate`` and ``HITRATE_POLICIES``.

``simulate(trace_or_arrays, policy, capacity_blocks)`` validates its input, converts a trace to
CSR arrays (``quillcache.hitrate.arrays``) and runs the Numba kernel of the policy
(``quillcache.hitrate.kernels``). Each kernel reproduces, hit for hit, the online policy class of
the same name driven by the plain-Python harness ``quillcache.hitrate.reference`` (tested).

Registered policies (``HITRATE_POLICIES``: name -> online class): the shared registry
``quillcache.policies.POLICIES`` (lru, lfu, fifo, s3fifo) merged with this study's additions
(lengthaware, tinylfu, belady, quillhd) until those are registered there.

Capacity: a positive int number of blocks, or None for unlimited. Capacities at or above the
number of distinct blocks never evict, so they are run as exactly that many (same hits).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from quillcache.hitrate import kernels
from quillcache.hitrate.arrays import (
    TraceArrays,
    arrays_from_requests,
    load_arrays,
    validate_arrays,
)
from quillcache.policies import POLICIES, EvictionPolicy
from quillcache.policies.belady import BeladyPolicy
from quillcache.policies.lengthaware import LengthAwarePolicy
from quillcache.policies.quillhd import QuillHdPolicy
from quillcache.policies.tinylfu import DOORKEEPER_SEED, TinyLfuPolicy
from quillcache.sketch.reference import seed_key
from quillcache.traces.loader import TraceRequest

__all__ = ["HITRATE_POLICIES", "HitRateResult", "TraceArrays", "load_arrays", "make_hitrate_policy", "simulate"]

HITRATE_POLICIES: dict[str, type[EvictionPolicy]] = {
    **POLICIES,
    **{cls.name: cls for cls in (LengthAwarePolicy, TinyLfuPolicy, BeladyPolicy, QuillHdPolicy)},
}

# kernel-side options each policy accepts in simulate() (defaults = the online class's defaults)
_KERNEL_OPTIONS: dict[str, dict[str, object]] = {
    "lru": {}, "fifo": {}, "lfu": {}, "lengthaware": {},
    "s3fifo": {"small_ratio": 0.10, "ghost_ratio": 0.90, "move_to_main_threshold": 2},
    "tinylfu": {"window_ratio": 0.01, "protected_ratio": 0.8, "sample_factor": 10, "doorkeeper": True},
    "belady": {"bypass": True},
    "quillhd": {"mode": "adaptive", "period": 4096, "decay": 0.9, "quantile": 0.95, "che_mult": 1.0,
                "block_tokens": 512},
}


def make_hitrate_policy(name: str, **options) -> EvictionPolicy:
    """An online policy from the merged registry (ValueError lists the registered names)."""
    if not isinstance(name, str):
        raise TypeError(f"policy name must be str, got {type(name).__name__} {name!r}")
    cls = HITRATE_POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown hit-rate policy {name!r}; registered: {sorted(HITRATE_POLICIES)}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise TypeError(f"policy {name!r} rejected options {sorted(options)}: {exc}") from None


@dataclass(frozen=True, eq=False)
class HitRateResult:
    policy: str
    capacity_blocks: int | None  # None = unlimited
    hit_blocks: int
    total_blocks: int
    hits_per_request: np.ndarray  # int32[R]
    elapsed_s: float

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def refs_per_s(self) -> float:
        return self.total_blocks / self.elapsed_s if self.elapsed_s > 0 else math.inf


def as_arrays(trace_or_arrays: object) -> TraceArrays:
    """TraceArrays as given (validated), from a trace path, or from a list of TraceRequest."""
    if isinstance(trace_or_arrays, TraceArrays):
        return validate_arrays(trace_or_arrays)
    if isinstance(trace_or_arrays, (str, os.PathLike)):
        return load_arrays(trace_or_arrays)
    if isinstance(trace_or_arrays, Sequence) and all(isinstance(q, TraceRequest) for q in trace_or_arrays):
        return arrays_from_requests(trace_or_arrays)
    raise TypeError("trace_or_arrays must be TraceArrays, a trace path or a sequence of TraceRequest, "
                    f"got {type(trace_or_arrays).__name__}")


def _check_options(policy: str, options: dict) -> dict:
    allowed = _KERNEL_OPTIONS[policy]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"policy {policy!r} takes no kernel option(s) {unknown}; it takes {sorted(allowed)}")
    merged = {**allowed, **options}
    # option values are validated by building the online class once (it names the bad value)
    if policy in ("s3fifo", "quillhd"):
        make_hitrate_policy(policy, **options)
    elif policy == "tinylfu":
        make_hitrate_policy(policy, capacity_keys=1, **options)
    elif policy == "belady" and not isinstance(merged["bypass"], bool):
        raise TypeError(f"bypass must be bool, got {merged['bypass']!r}")
    return merged


def run_kernel(arrs: TraceArrays, policy: str, cap: int, hits: np.ndarray, opts: dict) -> int:
    off, blocks, u = arrs.req_offsets, arrs.blocks, arrs.num_unique
    if policy == "lru":
        return kernels.lru(off, blocks, u, cap, hits)
    if policy == "fifo":
        return kernels.fifo(off, blocks, u, cap, hits)
    if policy == "lfu":
        return kernels.lfu(off, blocks, u, cap, hits)
    if policy == "lengthaware":
        return kernels.lengthaware(off, blocks, u, cap, hits)
    if policy == "belady":
        return kernels.belady(off, blocks, u, cap, hits, arrs.next_use, bool(opts["bypass"]))
    if policy == "s3fifo":
        return kernels.s3fifo(off, blocks, u, cap, hits, float(opts["small_ratio"]), float(opts["ghost_ratio"]),
                              int(opts["move_to_main_threshold"]))
    if policy == "tinylfu":
        p = TinyLfuPolicy(capacity_keys=cap, window_ratio=opts["window_ratio"], protected_ratio=opts["protected_ratio"],
                          sample_factor=opts["sample_factor"], doorkeeper=opts["doorkeeper"])
        return kernels.tinylfu(off, blocks, u, cap, hits, p.window_cap, p.main_cap, p.protected_cap, p.sample_size,
                               p.sketch.width, p.sketch.depth, np.uint64(seed_key(0)), p.doorkeeper_bits,
                               np.uint64(seed_key(DOORKEEPER_SEED)))
    if policy == "quillhd":
        mode = {"adaptive": 0, "hd": 1, "lru": 2}[opts["mode"]]
        return kernels.quillhd(off, blocks, u, cap, hits, arrs.input_tokens, int(opts["block_tokens"]),
                               int(opts["period"]), float(opts["decay"]), kernels.NUM_BUCKETS,
                               float(opts["quantile"]), float(opts["che_mult"]), mode)
    raise AssertionError(policy)


def simulate(trace_or_arrays: object, policy: str, capacity_blocks: int | None, **options) -> HitRateResult:
    """Replay a trace through ``policy`` with a cache of ``capacity_blocks`` blocks (None = unlimited)."""
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str, got {type(policy).__name__} {policy!r}")
    if policy not in _KERNEL_OPTIONS:
        raise ValueError(f"unknown hit-rate policy {policy!r}; registered: {sorted(_KERNEL_OPTIONS)}")
    if capacity_blocks is not None:
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, (int, np.integer)):
            raise TypeError(f"capacity_blocks must be a positive int or None, got "
                            f"{type(capacity_blocks).__name__} {capacity_blocks!r}")
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks={int(capacity_blocks)} must be positive (None = unlimited)")
    opts = _check_options(policy, options)
    arrs = as_arrays(trace_or_arrays)
    u = arrs.num_unique
    cap = max(1, u) if capacity_blocks is None else int(min(int(capacity_blocks), max(1, u)))
    hits = np.zeros(arrs.num_requests, dtype=np.int32)
    t0 = time.perf_counter()
    total = int(run_kernel(arrs, policy, cap, hits, opts))
    elapsed = time.perf_counter() - t0
    return HitRateResult(policy, None if capacity_blocks is None else int(capacity_blocks), total, arrs.num_refs,
                         hits, elapsed)
