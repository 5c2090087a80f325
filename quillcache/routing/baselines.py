"""Baseline routers the Dynamo cost is measured against.

- ``round_robin``: the next eligible worker in a fixed cycle; ignores cache and load.
- ``least_loaded``: the smallest live load in blocks, ``active_prefill_tokens / block_size +
  decode_blocks`` (Dynamo's cost with every tier credit 0); ignores the cache.
- ``prefix_affinity``: the longest consecutive prefix held on GPU (then host, then disk breaks
  ties); ignores load, so under load it dog-piles the cache-hot worker - the failure the load
  term exists to prevent.

Every baseline breaks exact ties uniformly at random with the router's seeded generator.
"""

from __future__ import annotations

import numpy as np

from quillcache.routing.base import Router, RouteRequest, check_route, pick_min

__all__ = ["LeastLoadedRouter", "PrefixAffinityRouter", "RoundRobinRouter"]


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self, *, seed: int | None = None) -> None:
        super().__init__(seed=seed)
        self._next = 0

    def _select(self, route: RouteRequest) -> int:
        n = route.num_workers
        elig = route.eligible
        for k in range(n):
            w = (self._next + k) % n
            if elig is None or elig[w]:
                self._next = w + 1
                return w
        raise ValueError("no eligible worker for this request")


class LeastLoadedRouter(Router):
    name = "least_loaded"

    def logits(self, route: RouteRequest) -> np.ndarray:
        check_route(route)
        return self._logits(route)

    @staticmethod
    def _logits(route: RouteRequest) -> np.ndarray:
        return route.active_prefill_tokens / route.block_size_tokens + route.decode_blocks

    def _select(self, route: RouteRequest) -> int:
        return pick_min(self._logits(route), route.eligible, self.rng)


class PrefixAffinityRouter(Router):
    name = "prefix_affinity"

    def logits(self, route: RouteRequest) -> np.ndarray:
        check_route(route)
        return self._logits(route)

    @staticmethod
    def _logits(route: RouteRequest) -> np.ndarray:
        # lexicographic (device, host, disk) overlap, negated so that lower is better
        ov = route.overlaps.astype(np.float64)
        scale = float(ov.max()) + 1.0
        return -(ov[0] * scale * scale + ov[1] * scale + ov[2])

    def _select(self, route: RouteRequest) -> int:
        return pick_min(self._logits(route), route.eligible, self.rng)
