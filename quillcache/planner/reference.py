"""The plain-Python reference planner: the specification of :class:`Planner`, and the
"straightforward per-block Python planner" its benchmark is measured against.

Same decisions, made the obvious way: ``index.locate`` builds one ``ResidencyEntry`` object per
replica, the guard is a per-replica digest comparison, overlaps, sources and the fetch-versus-
recompute choice are Python loops over blocks and replicas. Floats are computed in the same order
as the kernels, and the router and decode tie-break consume the same random draws, so for the same
seed both planners return the same plan (tested on random indexes).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np

from quillcache.identity.scope import IdentityRegistry
from quillcache.index.base import IndexBackend
from quillcache.index.keys import ResidencyEntry
from quillcache.planner.plan import KIND_ACTION, BlockAction, Plan, PlanRequest
from quillcache.planner.planner import PlannerConfig, _LayoutCosts
from quillcache.routing import (
    LoadTracker,
    Router,
    RouteRequest,
    WorkerSpec,
    make_router,
)
from quillcache.routing.base import as_worker_specs, pick_min

__all__ = ["ReferencePlanner"]


class ReferencePlanner:
    """Plain-Python planner with the same constructor and ``plan`` contract as ``Planner``."""

    def __init__(
        self,
        index: IndexBackend,
        workers: Sequence[WorkerSpec | str],
        *,
        router: Router | str = "dynamo",
        registry: IdentityRegistry | None = None,
        config: PlannerConfig | None = None,
        loads: LoadTracker | None = None,
    ) -> None:
        self.config = config or PlannerConfig()
        self.index = index
        self.workers = as_worker_specs(workers)
        self.loads = loads if loads is not None else LoadTracker(self.workers)
        self.router = make_router(router, seed=self.config.seed) if isinstance(router, str) else router
        self.registry = registry if registry is not None else IdentityRegistry()
        self._rng = random.Random(self.config.seed)
        self._widx = {w.name: i for i, w in enumerate(self.workers)}

    def plan(self, request: PlanRequest) -> Plan:
        if not isinstance(request, PlanRequest):
            raise TypeError(f"plan() takes a PlanRequest, got {type(request).__name__}")
        cfg = self.config
        bs = cfg.block_size_tokens
        scope = request.scope
        policy = scope.policy
        tenant = scope.identity.tenant
        guard = cfg.enable_guard
        costs = _LayoutCosts(cfg.cost_model, scope.identity.layout)
        a, c = cfg.cost_model.prefill_coeffs
        hashes = [int(h) for h in request.block_hashes]
        located = self.index.locate(hashes)
        n_workers = len(self.workers)

        def allowed(e: ResidencyEntry) -> bool:
            if not guard:
                return True
            if e.identity == scope.digest:
                return True
            return scope.public_digest is not None and e.identity == scope.public_digest and policy.allows(tenant, e.block_hash)

        # 1. per-worker consecutive overlaps by tier
        best = [[127] * n_workers for _ in hashes]
        for j, reps in enumerate(located):
            for e in reps:
                w = self._widx.get(e.node)
                if w is None or not allowed(e):
                    continue
                best[j][w] = min(best[j][w], int(e.tier))
        ov = np.zeros((3, n_workers), dtype=np.int64)
        for w in range(n_workers):
            j = 0
            for row, limit in enumerate((0, 1, 2)):
                j0 = j
                while j < len(hashes) and best[j][w] <= limit:
                    j += 1
                ov[row, w] = j - j0
        # 2. route
        mask = np.array([s.role.prefills for s in self.workers], dtype=np.bool_)
        loads = self.loads
        isl = request.input_tokens
        route = RouteRequest(ov, isl, bs, loads._prefill, loads._decode, None if mask.all() else mask)
        w = self.router._select(route)
        # 3. per-block best source for w
        kinds: list[int] = []
        rows: list[int] = []
        entries: list[ResidencyEntry] = []
        base_row = 0
        max_reuse = (isl - 1) // bs  # the engine computes at least the last prompt token (planner module doc)
        for j, reps in enumerate(located):
            if j >= max_reuse:
                break
            bk, br, be, bc = 127, -1, None, math.inf
            for pos, e in enumerate(reps):
                if not allowed(e):
                    continue
                t = int(e.tier)
                if t >= 3:
                    kind = 6
                elif self._widx.get(e.node) == w:
                    kind = t
                else:
                    kind = 3 + t
                cost = float(costs.per_block_s[kind] + costs.latency_s[kind])
                if cost < bc or (cost == bc and kind < bk):
                    bk, br, be, bc = kind, base_row + pos, e, cost
            if br < 0:
                break
            kinds.append(bk)
            rows.append(br)
            entries.append(be)
            base_row += len(reps)
        # 4. fetch vs recompute: the reuse length with the smallest predicted TTFT
        queue_s = a * float(loads._prefill[w])
        seen: set[int] = set()
        fetch = 0.0
        best_k, best_fetch, best_t = 0, 0.0, math.inf
        for k in range(len(kinds) + 1):
            if k > 0:
                kd = kinds[k - 1]
                fetch += float(costs.per_block_s[kd])
                if kd not in seen:
                    seen.add(kd)
                    fetch += float(costs.latency_s[kd])
            s = min(k * bs, isl - 1)
            t = queue_s + fetch + (a * (isl - s) + c * (isl * (isl - 1) / 2 - s * (s - 1) / 2))
            if t < best_t:
                best_k, best_fetch, best_t = k, fetch, t
        n = len(hashes)
        actions = np.full(n, BlockAction.RECOMPUTE, dtype=np.int8)
        kind_arr = np.full(n, -1, dtype=np.int8)
        row_arr = np.full(n, -1, dtype=np.int32)
        for j in range(best_k):
            actions[j] = KIND_ACTION[kinds[j]]
            kind_arr[j] = kinds[j]
            row_arr[j] = rows[j]
        fetched = sum(1 for j in range(best_k) if kinds[j] > 0)
        # 5. decode worker
        if self.workers[w].role.prefills and self.workers[w].role.decodes:
            d = w
        else:
            dmask = np.array([s.role.decodes for s in self.workers], dtype=np.bool_)
            d = pick_min(loads._decode.astype(np.float64), dmask, self._rng)
        names = loads.names
        return Plan(
            request, names[w], w, names[d], d, actions, kind_arr, row_arr, best_k, fetched * costs.block_bytes,
            best_fetch, isl - best_k * bs, -(-isl // bs), best_t, cfg.ttft_slo_s, guard, None, None,
            entries[:best_k],
        )
