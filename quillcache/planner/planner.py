"""The control plane: ``Planner.plan(request) -> Plan``.

Per request, in one pass over ONLY the request's own blocks:

1. locate the request's block hashes in the residency index (``IndexBackend.locate_arrays``, the
   columnar seam; workers are index node names, GPU-tier entries are what an engine holds on its
   GPU, DRAM/SSD entries on a worker node are its own host tiers, entries on other nodes are peers);
2. scan the replicas with the identity guard inside the scan (``_kernels.scan_overlaps``): each
   worker's consecutive device/host/disk prefix overlap counts only replicas whose identity digest
   the request may read;
3. route: the router (Dynamo cost by default) picks the prefill worker among prefill-capable
   workers from the overlaps and the live load counters;
4. actions (``_kernels.choose_actions``): per block the cheapest allowed source on/for that worker,
   then the reuse length that minimises predicted TTFT (fetch vs recompute, :mod:`cost_model`),
   at most ``(input_tokens - 1) // block_size`` blocks: the engine always computes the prompt's
   last token (vLLM's rule; the stand-in engine's too), so a fully cached block-aligned prompt
   reuses all but its last block and ``new_prefill_tokens >= 1``;
5. decode worker: the prefill worker itself when it also decodes, otherwise the decode-capable
   worker with the fewest active decode blocks (random tie-break).

``plan`` decides only; ``admit(plan)`` counts the load (before the upstream call; release the
lease after) and ``record(plan)`` writes the request's blocks as resident on success, under the
scope :meth:`RequestScope.write_digests` names - never under an unvalidated identity, since a
``RequestScope`` only exists for an identity that passed validation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from quillcache._checks import check_float, check_int
from quillcache.hashing.blocks import as_token_array, hash_blocks
from quillcache.identity.scope import IdentityRegistry, RequestScope
from quillcache.index.base import IndexBackend
from quillcache.index.keys import KEY_BYTES, ResidencyEntry
from quillcache.planner import _kernels as K
from quillcache.planner.cost_model import CostModel
from quillcache.planner.plan import KIND_ACTION, Plan, PlanRequest
from quillcache.routing import (
    DynamoCostRouter,
    Lease,
    LoadTracker,
    Router,
    RouteRequest,
    WorkerSpec,
    make_router,
)
from quillcache.routing.base import as_worker_specs, pick_min
from quillcache.types import CacheTier, Identity, KvLayout

__all__ = ["Planner", "PlannerConfig"]


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """``enable_guard=False`` is the naive baseline of the same planner (every replica counts).

    ``enable_guard`` and ``hash_lora`` are bools (``TypeError`` otherwise: a truthy string would
    silently switch the block hashes); ``seed`` is None or an integer ``>= 0`` (the gateway's and the
    harness's rule, kept as a Python int), checked here rather than when a router is first built from it.
    """

    block_size_tokens: int = 16
    ttft_slo_s: float = 1.0
    enable_guard: bool = True
    cost_model: CostModel = field(default_factory=CostModel)
    hash_lora: bool = False  # mix the adapter into the block-hash seed (Dynamo's LoRA seed)
    seed: int | None = None

    def __post_init__(self) -> None:
        check_int("block_size_tokens", self.block_size_tokens, 1, 65536, type_error=ValueError)
        check_float("ttft_slo_s", self.ttft_slo_s, 0.0, lo_open=True, finite=False, type_error=ValueError)
        if not isinstance(self.enable_guard, bool):
            raise TypeError(f"enable_guard must be a bool, got {type(self.enable_guard).__name__}")
        if not isinstance(self.hash_lora, bool):
            raise TypeError(f"hash_lora must be a bool, got {type(self.hash_lora).__name__} {self.hash_lora!r:.40}")
        if self.seed is not None:  # stored as a Python int: random.Random refuses NumPy integers
            object.__setattr__(self, "seed", check_int("seed", self.seed, 0))
        if not isinstance(self.cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(self.cost_model).__name__}")


class _LayoutCosts:
    __slots__ = ("block_bytes", "latency_s", "per_block_s")

    def __init__(self, cm: CostModel, layout: KvLayout) -> None:
        self.block_bytes = cm.block_bytes(layout)
        self.per_block_s, self.latency_s = cm.source_costs(self.block_bytes)


class Planner:
    """Cache-aware, identity-guarded planner over a residency index (see module doc)."""

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
        if not isinstance(index, IndexBackend):
            raise TypeError(f"index must be an IndexBackend (quillcache.index.open_index), got {type(index).__name__}")
        self.config = config or PlannerConfig()
        if not isinstance(self.config, PlannerConfig):
            raise TypeError(f"config must be a PlannerConfig, got {type(self.config).__name__}")
        specs = as_worker_specs(workers)
        if loads is None:
            loads = LoadTracker(specs)
        elif not isinstance(loads, LoadTracker) or loads.workers != specs:
            raise ValueError("loads must be a LoadTracker over exactly these workers")
        self.index = index
        self.workers = specs
        self.loads = loads
        if isinstance(router, str):
            router = make_router(router, seed=self.config.seed)
        elif not isinstance(router, Router):
            raise TypeError(f"router must be a Router or a registered name, got {type(router).__name__}")
        self.router = router
        self.registry = registry if registry is not None else IdentityRegistry()
        if not isinstance(self.registry, IdentityRegistry):
            raise TypeError(f"registry must be an IdentityRegistry, got {type(self.registry).__name__}")
        self._rng = random.Random(self.config.seed)
        self._bs = self.config.block_size_tokens
        self._guard = self.config.enable_guard
        self._a, self._c = self.config.cost_model.prefill_coeffs
        pm = np.array([w.role.prefills for w in specs], dtype=np.bool_)
        dm = np.array([w.role.decodes for w in specs], dtype=np.bool_)
        if not pm.any() or not dm.any():
            raise ValueError("the workers need at least one prefill-capable and one decode-capable engine")
        self._prefill_mask = None if pm.all() else pm
        self._decode_mask = dm
        self._both = np.array([w.role.prefills and w.role.decodes for w in specs], dtype=np.bool_)
        self._node_worker = np.full(1, -1, dtype=np.int32)  # index node number -> worker index / -1
        self._overlaps = np.zeros((3, len(specs)), dtype=np.int64)
        self._layout_costs: dict[KvLayout, _LayoutCosts] = {}
        self._kind_action = KIND_ACTION
        # fused-kernel scratch for the Dynamo router (see _kernels.plan_dynamo)
        self._elig = pm if self._prefill_mask is not None else np.ones(len(specs), dtype=np.bool_)
        self._logits = np.empty(len(specs), dtype=np.float64)
        self._out_i = np.zeros(3, dtype=np.int64)
        self._out_f = np.zeros(2, dtype=np.float64)
        # the router's parameters are copied in from the live router on every plan (see _plan_located)
        self._fparams = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, self._a, self._c])

    def with_guard(self, enable_guard: bool) -> Planner:
        """The same planner (index, workers, loads, registry, router kind and seed) with the guard
        switched; a fresh router instance so the two never share random draws."""
        return Planner(self.index, self.workers, router=self.router.clone(self.config.seed), registry=self.registry,
                       config=replace(self.config, enable_guard=enable_guard), loads=self.loads)

    # ---- requests ----------------------------------------------------------------------------
    def scope(self, identity: Identity) -> RequestScope:
        """The validated scope of ``identity`` (its layout must use the planner's block size)."""
        sc = self.registry.scope(identity)
        if sc.identity.layout.block_size_tokens != self._bs:
            raise ValueError(f"identity layout block_size_tokens={sc.identity.layout.block_size_tokens}, "
                             f"planner block_size_tokens={self._bs}")
        return sc

    def request(self, identity: Identity, tokens, *, output_tokens: int = 0) -> PlanRequest:
        """Validate, hash the prompt's full blocks and build a request (an empty prompt is refused)."""
        scope = self.scope(identity)
        lora = identity.adapter if self.config.hash_lora else None
        toks = as_token_array(tokens)  # validated once; hash_blocks uses it as is
        hashes = hash_blocks(toks, self._bs, lora=lora)
        n_tokens = len(toks)
        if n_tokens == 0:
            raise ValueError("an empty prompt cannot be planned (0 tokens)")
        return PlanRequest(scope, hashes, n_tokens, output_tokens, toks)

    # ---- planning ----------------------------------------------------------------------------
    def _costs(self, layout: KvLayout) -> _LayoutCosts:
        lc = self._layout_costs.get(layout)
        if lc is None:
            lc = self._layout_costs[layout] = _LayoutCosts(self.config.cost_model, layout)
        return lc

    def _refresh_nodes(self, missing: int) -> None:
        old = self._node_worker
        new = np.full(missing + 1, -1, dtype=np.int32)
        new[: len(old)] = old[: missing + 1]
        for no in range(len(old), missing + 1):
            try:
                name = self.index.node_name(no)
            except KeyError:
                continue
            new[no] = self.loads.index_of.get(name, -1)
        self._node_worker = new

    def _check(self, request: PlanRequest) -> _LayoutCosts:
        if type(request) is not PlanRequest:
            raise TypeError(f"plan() takes a PlanRequest (Planner.request), got {type(request).__name__}")
        layout = request.scope.identity.layout
        if layout.block_size_tokens != self._bs:
            raise ValueError(f"request block size {layout.block_size_tokens} != planner block size {self._bs}")
        lc = self._layout_costs.get(layout)
        return lc if lc is not None else self._costs(layout)

    def plan(self, request: PlanRequest) -> Plan:
        """Decide worker and per-block actions for ``request`` (no side effects on the index or load)."""
        lc = self._check(request)
        hashes = request.block_hashes
        located = self.index.locate_arrays(hashes)
        keys = located.keys.view(np.uint8).reshape(-1, KEY_BYTES)
        return self._plan_located(request, lc, located, keys, hashes, 0)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> list[Plan]:
        """Plan several requests with ONE index lookup: the same plans as calling ``plan`` on
        each in order (nothing is admitted or recorded in between)."""
        if isinstance(requests, PlanRequest) or not isinstance(requests, Sequence):
            raise TypeError(f"plan_batch() takes a sequence of PlanRequest, got {type(requests).__name__}")
        if not requests:
            return []
        costs = [self._check(r) for r in requests]
        hashes = np.concatenate([r.block_hashes for r in requests]) if len(requests) > 1 else requests[0].block_hashes
        located = self.index.locate_arrays(hashes)
        keys = located.keys.view(np.uint8).reshape(-1, KEY_BYTES)
        out = []
        b0 = 0
        for r, lc in zip(requests, costs):
            out.append(self._plan_located(r, lc, located, keys, hashes, b0))
            b0 += r.block_hashes.shape[0]
        return out

    def _plan_located(self, request: PlanRequest, lc: _LayoutCosts, located, keys: np.ndarray,
                      hashes: np.ndarray, b0: int) -> Plan:
        scope = request.scope
        n = request.block_hashes.shape[0]
        b1 = b0 + n
        offsets = located.offsets
        public_sorted = scope.policy.public_sorted
        loads = self.loads
        isl = request.input_tokens
        ov = self._overlaps
        actions = np.empty(n, dtype=np.int8)
        kinds = np.empty(n, dtype=np.int8)
        rows = np.empty(n, dtype=np.int32)
        router = self.router
        if type(router) is DynamoCostRouter:  # the default router: scan + route + actions in one kernel
            # read from the router now, not at construction: a changed attribute or a newly assigned
            # router decides exactly as ReferencePlanner's router._select does
            fp = self._fparams
            fp[0] = router.prefill_load_scale
            fp[1], fp[2], fp[3] = router.tier_credits
            fp[4] = router.temperature
            fp[5] = router.rng.random()
            out_i, out_f = self._out_i, self._out_f
            while True:
                st = K.plan_dynamo(keys, offsets, b0, b1, hashes, self._node_worker, scope.allowed, scope.public_slot,
                                   public_sorted, self._guard, loads._prefill, loads._decode, self._elig, isl, self._bs,
                                   fp, lc.per_block_s, lc.latency_s, self._kind_action, ov, self._logits,
                                   actions, kinds, rows, out_i, out_f)
                if st < 0:
                    break
                self._refresh_nodes(st)
            if st == -2:
                raise ValueError("no eligible worker for this request")
            w, k, fetched = int(out_i[0]), int(out_i[1]), int(out_i[2])
            fetch_s, ttft_s = float(out_f[0]), float(out_f[1])
        else:
            ok = np.empty(int(offsets[b1] - offsets[b0]) if self._guard else 0, dtype=np.bool_)
            while True:
                missing = K.scan_overlaps(keys, offsets, b0, b1, hashes, self._node_worker, scope.allowed,
                                          scope.public_slot, public_sorted, self._guard, ov, ok)
                if missing < 0:
                    break
                self._refresh_nodes(missing)
            w = router._select(RouteRequest(ov, isl, self._bs, loads._prefill, loads._decode, self._prefill_mask))
            k, fetched, fetch_s, ttft_s = K.choose_actions(
                keys, offsets, b0, b1, self._node_worker, self._guard, ok, w, lc.per_block_s, lc.latency_s, self._kind_action, self._a, self._c, isl, self._bs,
                self._a * float(loads._prefill[w]), actions, kinds, rows,
            )
        if self._both[w]:
            d = w
        else:
            d = pick_min(loads._decode.astype(np.float64), self._decode_mask, self._rng)
        names = loads.names
        return Plan(
            request, names[w], w, names[d], d, actions, kinds, rows, k, fetched * lc.block_bytes, fetch_s,
            isl - k * self._bs, -(-isl // self._bs), ttft_s, self.config.ttft_slo_s, self._guard, located,
            self.index.node_name,
        )

    # ---- after the decision ------------------------------------------------------------------
    def admit(self, plan: Plan) -> Lease:
        """Count the plan's load now, before the upstream call; ``release()`` it (or use ``with``) after."""
        return self.loads.acquire(plan.worker_index, prefill_tokens=plan.new_prefill_tokens,
                                  decode_blocks=plan.decode_blocks, decode_worker=plan.decode_worker_index)

    def resident_entries(self, plan: Plan) -> list[ResidencyEntry]:
        """Index entries to record once the request succeeded: every full prompt block on the
        prefill worker's GPU (and the decode worker's, when it is another engine), each under the
        scope ``RequestScope.write_digests`` names from the request's tokens (a request built
        without tokens records every block under its own scope)."""
        req = plan.request
        hashes = req.block_hashes.tolist()
        digests = req.scope.write_digests(hashes, req.tokens)
        size = self._costs(req.scope.identity.layout).block_bytes
        nodes = [plan.worker] if plan.decode_worker == plan.worker else [plan.worker, plan.decode_worker]
        return [ResidencyEntry(h, node, CacheTier.GPU, d, 0, 0, size) for node in nodes for h, d in zip(hashes, digests)]

    def record(self, plan: Plan) -> int:
        """Write ``resident_entries(plan)`` into the index; returns how many were written."""
        return self.index.put(self.resident_entries(plan))
