"""Per-request routing decision: identity scope -> block hashes -> the real planner -> an admitted lease.

``Decider.decide(identity, token_ids, output_tokens, excluded)`` hashes the prompt's full blocks
(Dynamo chain, ``hash_lora=False``: the identity digest carries tenant and adapter), plans with
:class:`quillcache.planner.Planner` (Dynamo cost router + identity guard over the residency
index), counts the chosen worker's load BEFORE the upstream call (``Planner.admit``) and records a
speculative residency entry for the blocks the plan did not find there
(:meth:`ResidencyTracker.speculate`) - all of them by default; with ``speculative_max_blocks > 0``,
for an engine with KV events, only the first that many (the engine's ``BlockStored`` attributes the
rest through their parents). Speculating the whole prompt makes the next decision independent of
the events' latency: with a cap, a later turn of a conversation that arrived before the engine's
events saw only the capped prefix, fell under the router's match threshold and went elsewhere
(the gateway study's diagnosis; the default was chosen on workload seeds the study does not use).
The gateway writes the speculation after the request's bytes have left (it is off the TTFT path),
together with the request's CLAIM on every prompt block past the reused prefix (capped or not) and on
the reused blocks from the first one whose entry is not yet CONFIRMED (another request's pending
speculation, which may never reach the engine, or an entry gone since the plan); the confirmed ones
are held weakly, and a fully confirmed prompt claims its last block: a claim's last block is where
the request's decode blocks continue. A prompt with no full block makes a short claim from its
tokens (its decode blocks are roots).
The claim is open while the decision's lease is live: the residency tracker refuses to credit a root
store of those blocks, or a decode continuation of the request, to any other scope meanwhile
(:mod:`.residency`, rule 2).

A router that takes per-worker resident block counts (``cache_aware``'s optional ``most_free``
low-match fallback) reads them from the tracker's live entries per engine.

When the planner's choice is excluded (unhealthy, or failed earlier in this request), the
next-best worker is chosen by the planner's own router over the remaining workers, fed with each
worker's consecutive GPU overlap computed from the plan's located replicas through the same
guard rule (own scope, or a registered public block under the public scope), and the live loads.

Invariants:
- Every ``Decision`` holds a live lease; the caller releases it exactly once (``finally``).
- ``cached_tokens`` and ``timing_class`` are computed only from the request's own scope, public
  blocks and aggregate load (the planner's guard; the fallback applies the same rule), so they
  reveal nothing about another tenant's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from quillcache.gateway.residency import ResidencyTracker
from quillcache.identity.scope import IdentityRegistry, RequestScope
from quillcache.index.base import IndexBackend
from quillcache.planner import Planner, PlannerConfig
from quillcache.planner.plan import BlockAction, Plan, TimingClass
from quillcache.routing import Lease, RouteRequest, make_router
from quillcache.types import CacheTier, Identity

__all__ = ["Decider", "Decision", "NoWorkerError"]

_GPU = int(CacheTier.GPU)
_LOCAL_HIT = int(BlockAction.LOCAL_HIT)


def _local_prefix(plan: Plan) -> int:
    """Leading blocks the plan serves from the worker's own GPU. The planner may also plan fetches
    from another node (a peer engine's GPU); an OpenAI upstream cannot import KV, so the gateway
    counts only local hits as cached (the rest is recomputed by the engine)."""
    a = plan.actions[: plan.reused_blocks]
    if not len(a):
        return 0
    miss = np.flatnonzero(a != _LOCAL_HIT)
    return int(miss[0]) if len(miss) else len(a)


class NoWorkerError(RuntimeError):
    """No engine may take the request (all excluded or unhealthy)."""


@dataclass(slots=True)
class Decision:
    worker: str
    worker_index: int
    cached_tokens: int
    timing_class: str
    reason: str  # prefix_hit, no_hit, retry, unhealthy (metrics label)
    lease: Lease
    prompt_tokens: int
    speculation: tuple | None = None  # (engine, hashes, scope, reused, first block's tokens) until recorded
    speculated: list | None = None  # the entries written (for retract)
    claim: object | None = None  # its residency Claim once recorded (for retract: entries drop theirs when confirmed)


class Decider:
    def __init__(self, index: IndexBackend, workers: Sequence[str], tracker: ResidencyTracker, *,
                 block_size_tokens: int, router: str = "dynamo", router_options: dict | None = None,
                 seed: int | None = None, speculative_max_blocks: int = 0) -> None:
        self.planner = Planner(index, list(workers), router=make_router(router, seed=seed, **(router_options or {})),
                               registry=IdentityRegistry(),
                               config=PlannerConfig(block_size_tokens=block_size_tokens, seed=seed))
        self.tracker = tracker
        self.index = index
        self.names = self.planner.loads.names
        if hasattr(self.planner.router, "resident_blocks"):  # cache_aware's low-match fallback: the most free cache
            names = self.names
            self.planner.router.resident_blocks = lambda: tracker.resident_counts(names)
        self._bs = block_size_tokens
        self.peers = None  # a PeerLink when replicas share speculation (quillcache.gateway.peers)
        self.speculative_max_blocks = speculative_max_blocks

    def warm_up(self) -> None:
        """Load the compiled hashing and planning kernels now, not on the first request: one plan of a
        throwaway request on a throwaway planner over an empty in-memory index (nothing is admitted,
        recorded or registered here)."""
        from quillcache.index import open_index
        from quillcache.types import KvLayout

        with open_index("flat") as scratch:
            p = Planner(scratch, list(self.names), router=self.planner.router.clone(0),
                        config=self.planner.config)
            ident = Identity(model="warm-up", tenant="warm-up", layout=KvLayout(block_size_tokens=self._bs))
            p.plan(p.request(ident, list(range(4 * self._bs + 1)), output_tokens=1))

    def scope(self, identity: Identity) -> RequestScope:
        return self.planner.scope(identity)

    def decide(self, identity: Identity, token_ids: Sequence[int], output_tokens: int,
               excluded: frozenset[int] | set[int] = frozenset(), why_excluded: str = "unhealthy", *,
               record: bool = True) -> Decision:
        """Plan, admit and (with ``record``) speculate; ``record=False`` leaves the speculation to a
        later :meth:`record` (the gateway runs it while the upstream request is in flight)."""
        planner = self.planner
        req = planner.request(identity, token_ids, output_tokens=output_tokens)
        plan = planner.plan(req)
        w = plan.worker_index
        if w in excluded:
            w, reused = self._fallback(plan, excluded)
            cached = reused * self._bs
            new_prefill = req.input_tokens - cached
            lease = planner.loads.acquire(w, prefill_tokens=new_prefill, decode_blocks=plan.decode_blocks)
            cm = planner.config.cost_model
            tc = (TimingClass.WITHIN_SLO if cm.prefill_s(cached, req.input_tokens) <= plan.ttft_slo_s
                  else TimingClass.OVER_SLO).value
            reason = why_excluded
        else:
            lease = planner.admit(plan)
            reused = _local_prefix(plan)
            cached = reused * self._bs
            tc = plan.timing_class.value
            reason = "prefix_hit" if reused else "no_hit"
        # engines recompute at least the prompt's last token (vLLM): a fully cached prompt reports one block less
        cached = min(cached, (req.input_tokens - 1) // self._bs * self._bs)
        name = self.names[w]
        hashes = req.block_hashes
        d = Decision(name, w, cached, tc, reason, lease, req.input_tokens)
        # a fully reused prompt still claims its tail; a prompt with no full block claims roots (residency doc)
        if len(hashes) or len(token_ids) or self.tracker.modes[name] == "approximate":
            # a prompt with no full block has at most bs - 1 tokens: that much of a first block can be compared
            d.speculation = (name, hashes, req.scope, reused, tuple(token_ids[: self._bs - 1]) if not reused else ())
            if record:
                self.record(d)
        return d

    def record(self, d: Decision) -> None:
        """Drop speculation whose TTL ran out, then write the decision's speculative entries (once;
        nothing after ``retract``). Expiry runs here, off the decision's path (the gateway records after
        the upstream write; its health loop expires too): a decision may still see an entry that ran
        out since the previous request's record, which the TTL, a heuristic, allows."""
        self.tracker.expire()
        spec = d.speculation
        if spec is None:
            return
        d.speculation = None
        name, hashes, scope, reused, first = spec
        tracker = self.tracker
        digests = scope.write_digests(hashes)
        prompt = hashes
        cap = self.speculative_max_blocks
        if cap and tracker.modes[name] == "events" and len(hashes) > reused + cap:
            # the engine's events attribute the rest through their parents (residency module doc)
            hashes = hashes[: reused + cap]
        n_spec = len(hashes) - reused
        # every block past the reused prefix may be stored by this request, speculated or not; so may a reused
        # block whose entry is not confirmed (pending: another request's, which may never reach the engine), and
        # a confirmed one once the engine evicted it (held weakly: residency module doc)
        claim = tracker.claim_prompt(name, prompt, scope.digest, d.lease, reused_blocks=reused,
                                     speculated_blocks=n_spec, digests=digests[:reused], tokens=first)
        d.claim = claim
        d.speculated = tracker.speculate(name, hashes, digests, reused_blocks=reused, claim=claim, root_tokens=first)
        if self.peers is not None and (len(prompt) or len(first)):
            self.peers.claimed(claim, prompt, reused, n_spec, first)

    def retract(self, d: Decision) -> None:
        """The request failed before its engine took it: drop what it speculated (or would have)."""
        d.speculation = None
        if d.speculated:
            recs = d.speculated
            d.speculated = None
            self.tracker.retract(recs)
            if self.peers is not None and d.claim is not None:  # even if some of its entries were confirmed
                self.peers.retracted(d.claim)

    def _fallback(self, plan: Plan, excluded) -> tuple[int, int]:
        """(worker, consecutive GPU blocks it holds for this scope) among the non-excluded workers."""
        loads = self.planner.loads
        n = len(loads)
        eligible = np.ones(n, dtype=np.bool_)
        for w in excluded:
            eligible[w] = False
        if not eligible.any():
            raise NoWorkerError("no engine is available (all unhealthy or failed for this request)")
        scope = plan.request.scope
        hashes = plan.request.block_hashes
        allowed = {bytes(r) for r in scope.allowed}
        public = scope.public_digest
        public_blocks = scope.policy.public_blocks
        loc = plan.located
        overlaps = np.zeros((3, n), dtype=np.int64)
        alive = eligible.copy()
        if loc is not None:
            keys, offs = loc.keys, loc.offsets
            for j in range(len(hashes)):
                holders = set()
                for r in range(int(offs[j]), int(offs[j + 1])):
                    k = keys[r]
                    if int(k["tier"]) != _GPU:
                        continue
                    d = bytes(k["identity"])
                    if d not in allowed or (d == public and int(hashes[j]) not in public_blocks):
                        continue
                    wi = loads.index_of.get(self.index.node_name(int(k["node_no"])))
                    if wi is not None:
                        holders.add(wi)
                for wi in np.flatnonzero(alive):
                    if wi in holders:
                        overlaps[0, wi] += 1
                    else:
                        alive[wi] = False
                if not alive.any():
                    break
        route = RouteRequest(overlaps, plan.request.input_tokens, self._bs, loads.active_prefill_tokens,
                             loads.decode_blocks, eligible)
        w = self.planner.router.select(route)
        return w, int(overlaps[0, w])
