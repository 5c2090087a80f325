"""``cache_aware``: SGLang's cache-aware routing rule applied to exact block residency.

Per request (``n`` = the request's blocks, ``ceil(isl / block_size)``; a worker's load in blocks is
``active_prefill_tokens / block_size + decode_blocks``, Dynamo's load terms, expressed here in
request-equivalents ``load / n``)::

    if max_load - min_load > balance_abs_threshold and max_load > balance_rel_threshold * min_load:
        the least-loaded eligible worker                       # the cluster is imbalanced: balance
    elif best device overlap / n > cache_threshold:
        the worker with the longest prefix (GPU, then host, then disk; ties: the least loaded)
    else:
        the least-loaded eligible worker

It is SGLang's gateway rule (``--cache-threshold 0.3 --balance-abs-threshold 64
--balance-rel-threshold 1.5``, its defaults, used here unchanged) with two differences, both stated:
the match is the engine's exact consecutive block overlap from the residency index instead of a
character radix tree, and the low-match fallback is the least-loaded worker instead of the worker
with the smallest tree (the index does not expose tree sizes per worker). Load is compared in
request-equivalents because SGLang counts requests and the load tracker counts blocks.

Against Dynamo's cost (:mod:`quillcache.routing.dynamo`), which charges every active block as load
and so leaves a worker holding a long shared prefix as soon as it is busy, this rule stays on the
prefix until the imbalance is large. Exact ties are broken uniformly at random by the seeded
generator.
"""

from __future__ import annotations

import numpy as np

from quillcache._checks import check_float
from quillcache.routing.base import Router, RouteRequest, pick_min

__all__ = ["CacheAwareRouter"]


class CacheAwareRouter(Router):
    name = "cache_aware"

    def __init__(self, *, cache_threshold: float = 0.3, balance_abs_threshold: float = 64.0,
                 balance_rel_threshold: float = 1.5, seed: int | None = None) -> None:
        super().__init__(seed=seed)
        self.cache_threshold = check_float("cache_threshold", cache_threshold, 0.0, 1.0)
        self.balance_abs_threshold = check_float("balance_abs_threshold", balance_abs_threshold, 0.0)
        self.balance_rel_threshold = check_float("balance_rel_threshold", balance_rel_threshold, 1.0)

    def loads(self, route: RouteRequest) -> np.ndarray:
        """Each worker's live load in request-equivalents (blocks / this request's blocks)."""
        bs = route.block_size_tokens
        n_blocks = -(-route.isl_tokens // bs)
        return (route.active_prefill_tokens / bs + route.decode_blocks) / n_blocks

    def _select(self, route: RouteRequest) -> int:
        load = self.loads(route)
        elig = route.eligible
        live = load if elig is None else load[elig]
        if live.size == 0:
            raise ValueError("no eligible worker for this request")
        lo, hi = float(live.min()), float(live.max())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return pick_min(load, elig, self.rng)
        ov = route.overlaps.astype(np.float64)
        dev = ov[0] if elig is None else np.where(elig, ov[0], -1.0)
        n_blocks = -(-route.isl_tokens // route.block_size_tokens)
        if dev.max() / n_blocks > self.cache_threshold:
            scale = float(ov.max()) + 1.0
            prefix = ov[0] * scale * scale + ov[1] * scale + ov[2]
            # longest prefix first; among equal prefixes the least loaded (load < 1e6 request-equivalents)
            return pick_min(-prefix * 1e6 + np.minimum(load, 1e6 - 1), elig, self.rng)
        return pick_min(load, elig, self.rng)
