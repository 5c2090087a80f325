"""Dynamo's KV-router cost with tier credits and live load (REFERENCE section 3).

Per worker ``w`` (lower is better)::

    cached_tokens      = device_overlap_blocks[w] * block_size
    raw_prefill_blocks = (active_prefill_tokens[w] + max(isl - cached_tokens, 0) + cached_tokens) / block_size
    overlap_credit     = 1.0 * device_overlap_blocks[w]    # GPU (G1) consecutive prefix blocks
                       + 0.75 * host_overlap_blocks[w]     # host DRAM (G2), beyond the device prefix
                       + 0.25 * disk_overlap_blocks[w]     # disk (G3), beyond the host prefix
    adjusted_prefill   = max(0, raw_prefill_blocks - overlap_credit)
    logit[w]           = prefill_load_scale * adjusted_prefill + decode_blocks[w] + ceil(isl / block_size)

``decode_blocks[w]`` is the live count of active blocks of requests decoding on ``w``; the new
request's own blocks are added to every worker (as Dynamo does), which changes no decision.
Selection: temperature 0 (default) -> the minimum, ties broken uniformly at random; temperature
``T > 0`` -> sample ``p_i ∝ exp(-(v_i - v_min) / ((v_max - v_min) * T))`` over the eligible
workers, uniform when all are equal. When the scale ``(v_max - v_min) * T`` is 0 (a subnormal
``T`` underflows it) or not finite, the temperature-0 rule decides instead, so every accepted
temperature gives a decision. Tier credits ``(1, 0, 0)`` with ``prefill_load_scale`` as the weight
give the older documented form ``overlap_score_weight * prefill_blocks + decode_blocks`` (with
``prefill_blocks = (active_prefill_tokens + isl) / block_size - device_overlap_blocks``, plus the
request's own blocks on every worker); with all credits 0 the cache term vanishes instead (cached
tokens count as prefill, so the cost ignores the cache).

Inputs are bounded by :func:`~quillcache.routing.base.check_route` (``isl_tokens`` and
``block_size_tokens`` at most 2**40, each worker's overlaps at most the request's blocks), so the
kernel's int64 products and sums never wrap.

The plain-Python reference (:func:`dynamo_logits_reference`, :func:`select_reference`) is the
specification; the Numba kernel computes the same floats in the same order and consumes the same
single uniform draw per decision, so both pick the same worker for the same seed (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numba
import numpy as np

from quillcache._checks import check_float
from quillcache.routing.base import Router, RouteRequest, check_route

__all__ = ["DEFAULT_TIER_CREDITS", "DynamoCostRouter", "dynamo_logits_reference", "select_reference"]

DEFAULT_TIER_CREDITS = (1.0, 0.75, 0.25)


@numba.njit(cache=True, nogil=True)
def _logits(overlaps, apt, dec, isl, bs, scale, c0, c1, c2, out):  # pragma: no cover - jitted
    n = overlaps.shape[1]
    new_blocks = (isl + bs - 1) // bs
    for w in range(n):
        dev = overlaps[0, w]
        cached = dev * bs
        new_tokens = isl - cached
        new_tokens = max(new_tokens, 0)
        raw = (apt[w] + new_tokens + cached) / bs
        credit = c0 * dev + c1 * overlaps[1, w] + c2 * overlaps[2, w]
        adj = raw - credit
        adj = max(adj, 0.0)
        out[w] = scale * adj + dec[w] + new_blocks


@numba.njit(cache=True, nogil=True)
def _select(values, eligible, temperature, u):  # pragma: no cover - jitted
    n = values.shape[0]
    vmin = np.inf
    vmax = -np.inf
    count = 0
    for w in range(n):
        if eligible[w]:
            count += 1
            v = values[w]
            vmin = min(vmin, v)
            vmax = max(vmax, v)
    if count == 0:
        return -1
    if temperature > 0.0 and vmax == vmin:  # all equal: uniform over the eligible
        k = int(u * count)
        for w in range(n):
            if eligible[w]:
                if k == 0:
                    return w
                k -= 1
    scale = (vmax - vmin) * temperature
    if temperature <= 0.0 or not (scale > 0.0 and scale < np.inf):  # T = 0, or a scale of 0 / not finite
        ties = 0
        for w in range(n):
            if eligible[w] and values[w] == vmin:
                ties += 1
        k = int(u * ties)
        for w in range(n):
            if eligible[w] and values[w] == vmin:
                if k == 0:
                    return w
                k -= 1
        return -1
    total = 0.0
    for w in range(n):
        if eligible[w]:
            total += math.exp(-(values[w] - vmin) / scale)
    target = u * total
    acc = 0.0
    last = -1
    for w in range(n):
        if eligible[w]:
            acc += math.exp(-(values[w] - vmin) / scale)
            last = w
            if acc > target:
                return w
    return last


def dynamo_logits_reference(
    device: Sequence[int], host: Sequence[int], disk: Sequence[int], active_prefill_tokens: Sequence[int],
    decode_blocks: Sequence[int], isl_tokens: int, block_size_tokens: int, *, prefill_load_scale: float = 1.0,
    tier_credits: tuple[float, float, float] = DEFAULT_TIER_CREDITS,
) -> list[float]:
    """The cost of every worker, one plain-Python loop (the specification)."""
    c0, c1, c2 = tier_credits
    bs = block_size_tokens
    new_blocks = (isl_tokens + bs - 1) // bs
    out = []
    for w in range(len(device)):
        cached = device[w] * bs
        new_tokens = max(isl_tokens - cached, 0)
        raw = (active_prefill_tokens[w] + new_tokens + cached) / bs
        credit = c0 * device[w] + c1 * host[w] + c2 * disk[w]
        adj = max(raw - credit, 0.0)
        out.append(prefill_load_scale * adj + decode_blocks[w] + new_blocks)
    return out


def select_reference(values: Sequence[float], eligible: Sequence[bool], temperature: float, u: float) -> int:
    """Dynamo's selection from one uniform draw ``u`` in [0, 1) (the specification)."""
    idx = [w for w in range(len(values)) if eligible[w]]
    if not idx:
        raise ValueError("no eligible worker for this request")
    vals = [values[w] for w in idx]
    vmin, vmax = min(vals), max(vals)
    if temperature > 0.0 and vmax == vmin:
        return idx[int(u * len(idx))]
    scale = (vmax - vmin) * temperature
    if temperature <= 0.0 or not 0.0 < scale < math.inf:  # scale 0 (subnormal T) or not finite: the T = 0 rule
        ties = [w for w in idx if values[w] == vmin]
        return ties[int(u * len(ties))]
    weights = [math.exp(-(values[w] - vmin) / scale) for w in idx]
    target = u * sum(weights)
    acc = 0.0
    for w, wt in zip(idx, weights):
        acc += wt
        if acc > target:
            return w
    return idx[-1]


class DynamoCostRouter(Router):
    """Dynamo's KV-router cost (tier credits 1.0/0.75/0.25) over live load; see module doc."""

    name = "dynamo"

    def __init__(
        self,
        *,
        prefill_load_scale: float = 1.0,
        tier_credits: tuple[float, float, float] = DEFAULT_TIER_CREDITS,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__(seed=seed)
        self.prefill_load_scale = check_float("prefill_load_scale", prefill_load_scale, 0.0)
        if not isinstance(tier_credits, (tuple, list)) or len(tier_credits) != 3:
            raise ValueError(f"tier_credits must be 3 numbers (device, host, disk), got {tier_credits!r:.80}")
        self.tier_credits = tuple(check_float(f"tier_credits[{i}]", c, 0.0) for i, c in enumerate(tier_credits))
        self.temperature = check_float("temperature", temperature, 0.0)
        self._ones: dict[int, np.ndarray] = {}
        self._out: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return (f"DynamoCostRouter(prefill_load_scale={self.prefill_load_scale}, tier_credits={self.tier_credits}, "
                f"temperature={self.temperature})")

    def clone(self, seed: int | None = None) -> DynamoCostRouter:
        return DynamoCostRouter(prefill_load_scale=self.prefill_load_scale, tier_credits=self.tier_credits,
                                temperature=self.temperature, seed=seed)

    def _logits_into(self, route: RouteRequest, out: np.ndarray) -> np.ndarray:
        c0, c1, c2 = self.tier_credits
        _logits(route.overlaps, route.active_prefill_tokens, route.decode_blocks, int(route.isl_tokens),
                int(route.block_size_tokens), self.prefill_load_scale, c0, c1, c2, out)
        return out

    def logits(self, route: RouteRequest) -> np.ndarray:
        check_route(route)
        return self._logits_into(route, np.empty(route.num_workers, dtype=np.float64))

    def _select(self, route: RouteRequest) -> int:
        n = route.overlaps.shape[1]
        out = self._out.get(n)
        if out is None:
            out = self._out[n] = np.empty(n, dtype=np.float64)
            self._ones[n] = np.ones(n, dtype=np.bool_)
        self._logits_into(route, out)
        elig = route.eligible if route.eligible is not None else self._ones[n]
        w = _select(out, elig, self.temperature, self.rng.random())
        if w < 0:
            raise ValueError("no eligible worker for this request")
        return int(w)
