"""``cache_aware``: SGLang's cache-aware routing rule applied to exact block residency.

Per request (``n`` = the request's blocks, ``ceil(isl / block_size)``; a worker's load in blocks is
``active_prefill_tokens / block_size + decode_blocks``, Dynamo's load terms, expressed here in
request-equivalents ``load / n``; ``lo`` = the least eligible load)::

    overloaded(w) = load[w] - lo > balance_abs_threshold and load[w] > balance_rel_threshold * lo
    candidates    = the eligible workers that are not overloaded     # all of them while balanced
    if best device overlap among candidates / n > cache_threshold:
        the candidate with the longest prefix (GPU, then host, then disk; ties: the least loaded)
    else:                                                            # the low-match fallback
        the least-loaded candidate (``low_match="least_loaded"``, the default), or the candidate
        with the fewest resident blocks (``"most_free"``, when the owner gave ``resident_blocks``)

It is SGLang's gateway rule (``--cache-threshold 0.3 --balance-abs-threshold 64
--balance-rel-threshold 1.5``, its defaults, used here unchanged) with three differences, all stated:

- the match is the engine's exact consecutive block overlap from the residency index instead of a
  character radix tree;
- under imbalance SGLang sends the request to the single least-loaded worker, whatever it holds;
  here the prefix rule runs over every worker that is not overloaded (``imbalance="best_prefix"``;
  ``"least_loaded"`` is SGLang's). The overloaded workers are out exactly as in SGLang, so the
  balancing guarantee is the same, but a warm prefix on a moderately loaded worker is not thrown
  away because a third worker is busy;
- the low-match fallback is the least-loaded worker, where SGLang takes the worker with the
  smallest tree. SGLang's rule is available on exact residency as ``low_match="most_free"``: the
  worker holding the fewest resident blocks, read from ``resident_blocks`` (a callable the owner
  sets; the gateway: its residency tracker's live entries per engine; an answer that is not one
  finite count >= 0 per worker raises ``ValueError``). It is not the default
  because it measured worse than least-loaded in the gateway's setting (four stand-in engines, a
  sessions workload at 32 req/s).

Load is compared in request-equivalents because SGLang counts requests and the load tracker counts
blocks. Against Dynamo's cost (:mod:`quillcache.routing.dynamo`), which charges every active block
as load and so leaves a worker holding a long shared prefix as soon as it is busy, this rule stays
on the prefix until the imbalance is large. Exact ties are broken uniformly at random by the seeded
generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from quillcache._checks import check_float
from quillcache.routing.base import Router, RouteRequest, check_route

__all__ = ["CacheAwareRouter"]

IMBALANCE_RULES = ("best_prefix", "least_loaded")
LOW_MATCH_RULES = ("most_free", "least_loaded")


class CacheAwareRouter(Router):
    name = "cache_aware"

    def __init__(self, *, cache_threshold: float = 0.3, balance_abs_threshold: float = 64.0,
                 balance_rel_threshold: float = 1.5, imbalance: str = "best_prefix", low_match: str = "least_loaded",
                 seed: int | None = None) -> None:
        super().__init__(seed=seed)
        self.cache_threshold = check_float("cache_threshold", cache_threshold, 0.0, 1.0)
        self.balance_abs_threshold = check_float("balance_abs_threshold", balance_abs_threshold, 0.0)
        self.balance_rel_threshold = check_float("balance_rel_threshold", balance_rel_threshold, 1.0)
        if imbalance not in IMBALANCE_RULES:
            raise ValueError(f"imbalance={imbalance!r}; known: {list(IMBALANCE_RULES)}")
        if low_match not in LOW_MATCH_RULES:
            raise ValueError(f"low_match={low_match!r}; known: {list(LOW_MATCH_RULES)}")
        self.imbalance = imbalance
        self.low_match = low_match
        # per-worker resident GPU blocks (int array, worker order), set by the owner; None: least loaded.
        # With low_match="most_free", an answer of the wrong length or with NaN / negative counts raises
        # ValueError naming the source (no silent fallback)
        self.resident_blocks: Callable[[], np.ndarray] | None = None

    def clone(self, seed: int | None = None) -> CacheAwareRouter:
        return type(self)(cache_threshold=self.cache_threshold, balance_abs_threshold=self.balance_abs_threshold,
                          balance_rel_threshold=self.balance_rel_threshold, imbalance=self.imbalance,
                          low_match=self.low_match, seed=seed)

    def loads(self, route: RouteRequest) -> np.ndarray:
        """Each worker's live load in request-equivalents (blocks / this request's blocks)."""
        check_route(route)
        bs = route.block_size_tokens
        n_blocks = -(-route.isl_tokens // bs)
        return (route.active_prefill_tokens / bs + route.decode_blocks) / n_blocks

    def _pick(self, cand: list[int], key) -> int:
        """The candidate with the smallest ``key(i)``; exact ties uniformly at random (``pick_min``'s rule)."""
        best = min(key(i) for i in cand)
        ties = [i for i in cand if key(i) == best]
        return ties[0] if len(ties) == 1 else ties[int(self.rng.random() * len(ties))]

    def _select(self, route: RouteRequest) -> int:
        # plain Python over the few workers: numpy's per-call overhead dominates arrays this small, and this
        # runs on every request's path (the decision; ``loads`` is the same computation as an array)
        bs = route.block_size_tokens
        n_blocks = -(-route.isl_tokens // bs)
        load = [(a / bs + d) / n_blocks
                for a, d in zip(route.active_prefill_tokens.tolist(), route.decode_blocks.tolist())]
        elig = route.eligible
        idx = list(range(len(load))) if elig is None else [i for i, e in enumerate(elig.tolist()) if e]
        if not idx:
            raise ValueError("no eligible worker for this request")
        lo = min(load[i] for i in idx)
        hi = max(load[i] for i in idx)
        cand = idx
        by_load = load.__getitem__
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            if self.imbalance == "least_loaded":
                return self._pick(idx, by_load)
            # never empty: the least loaded is not overloaded
            cand = [i for i in idx if not (load[i] - lo > self.balance_abs_threshold
                                           and load[i] > self.balance_rel_threshold * lo)]
        dev, host, disk = route.overlaps.tolist()
        if max(dev[i] for i in cand) / n_blocks > self.cache_threshold:
            # longest prefix first (GPU, then host, then disk); among equal prefixes the least loaded
            return self._pick(cand, lambda i: (-dev[i], -host[i], -disk[i], load[i]))
        source = self.resident_blocks
        if source is not None and self.low_match == "most_free":
            resident = _resident_counts(source(), len(load))
            # the fewest resident blocks first; among equal counts the least loaded
            return self._pick(cand, lambda i: (resident[i], load[i]))
        return self._pick(cand, by_load)


def _resident_counts(values: object, n_workers: int) -> list:
    """``resident_blocks()``'s answer as a list: one finite count >= 0 per worker, else ``ValueError``
    naming the source (a wrong answer is refused, never silently replaced by the least-loaded rule). A list of
    plain ints and floats (the gateway's answer) is checked without NumPy: this runs once per decision."""
    if type(values) is list and len(values) == n_workers and all(
            (type(x) is int and x >= 0) or (type(x) is float and 0.0 <= x < math.inf) for x in values):
        return values
    try:
        a = np.asarray(values)
    except (TypeError, ValueError):  # a ragged or otherwise unconvertible answer
        a = np.asarray(None)
    if a.shape != (n_workers,) or a.dtype.kind not in "iuf":
        raise ValueError(f"resident_blocks (the low_match='most_free' source) must return {n_workers} numbers, "
                         f"one per worker, got dtype {a.dtype} shape {a.shape}")
    if a.size and (not np.isfinite(a).all() or a.min() < 0):
        raise ValueError(f"resident_blocks (the low_match='most_free' source) must return finite counts >= 0, "
                         f"got {a.tolist()!r:.120}")
    return a.tolist()
