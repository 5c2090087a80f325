"""Prefix state of the engines in the residency index: speculative, confirmed and approximate entries.

The gateway's planner reads GPU-tier residency per engine from the index (node = engine name,
tier ``GPU``, identity = the request scope's digest, block hash = the Dynamo chain hash of the
prompt's tokens with no LoRA/namespace seed: the planner runs with ``hash_lora=False`` because the
identity digest already carries the adapter and the tenant). This module is the only writer.
Longer than 600 lines because its four attribution rules, the claims that make rule 2 sound and the
index writes are one state machine: each rule reads the others' state within the same event, and
``check()`` verifies them together.

Two sources, chosen per engine (``EngineConfig.prefix_state``):

``events`` (exact). At routing time :meth:`ResidencyTracker.speculate` writes a SPECULATIVE entry
per prompt block the plan did not already find on that engine, which expires after
``ttl_s`` (llm-d's 2 s) unless the engine's ``BlockStored`` event for the same unscoped chain hash
CONFIRMS it (:meth:`stored`). Events carry no tenant (vLLM's ``cache_salt`` only enters the
engine's own hash), so a stored block is attributed to a scope by, in order: (1) its parent's
scope - a child of a block attributed to scope S on that engine is S's, because the engine's hash
chain carries the salt onward - preferring a pending speculation of S for that chain hash, then
(2) for a block without an attributed parent, the pending speculation on that engine for that
chain hash, ONLY when every pending speculation for it belongs to one scope AND no other scope
holds a CLAIM on that (engine, chain hash); otherwise the store could be either's and is refused
as ambiguous. A stored block neither explains stays UNATTRIBUTED: counted, never written (safety
over hit rate). Why (2) is strict: a scope's pending entry confirmed by ANOTHER scope's store
would make that scope's later ``cached_tokens`` depend on the other tenant's traffic.

(3) An unattributed block is RESOLVED through a descendant: when a block is attributed to scope S
(by (1) or (2)), its unattributed ancestors on that engine - found by following the events' parent
engine hashes - are S's too, because an engine hash is computed from its parent's, so the whole
chain up to the root carries the salt the attributed block's hash was computed under. This is rule
(1) read upward, and the common case it recovers is a system prompt several tenants share: its
root is ambiguous while more than one of them is in flight, but each tenant's first private block
is claimed by that tenant alone, and it names the owner of the shared blocks before it. The
tracker keeps the unattributed blocks whose chain hash it knows (engine hash -> chain hash and
parent engine hash) until their ``BlockRemoved``, a clear or resync, at most
``max_unattributed_blocks`` per engine (the oldest forgotten first: they stay unattributed).

(4) A block stored again under an engine hash that was attributed to scope S before (evicted, then
recomputed; or computed again while still cached, as an engine does when an ancestor was evicted and
its prefix match ends there) is S's: the engine hash commits to the salt and the whole prefix, so it
names the same scope every time it is stored. This assumes what rule 2 already does: an engine's hash
of a block is a function of the salt and the prompt's tokens alone (vLLM's, without extra keys such as
multimodal inputs), so a recompute carries the engine hash the evicted block had. The tracker
remembers the scope of the last ``max_known_blocks`` engine hashes whose confirmed entries
``BlockRemoved``, ``AllBlocksCleared`` or a resync dropped, per engine (the relation is a property of
the hash, not of the cache's contents, so a clear keeps it).
Rules (1) and (4) come before the claims: they never credit a scope with another scope's salted
block, whoever is in flight.

Claims (:meth:`ResidencyTracker.claim`) are what make (2) sound: the pending set alone is not
every request that can still cause a store, because a speculation leaves it by TTL while its
request may still be queued or prefilling, and by retraction when the client left although the
engine may have prefilled already. A claim records, per request routed to an events engine, the
scope and the chain hashes it did not find there (all of them past the reused prefix, whatever
``speculative_max_blocks`` speculated), independent of the speculation's TTL. It blocks other
scopes' root attributions of those hashes while the request is IN FLIGHT (its routing lease is
live; a peer's claim until that peer says it ended, at most ``claim_max_s``), and after it ended
for ``claim_grace_s`` (default: the TTL) for its events still on the way - unless every block it
speculated was confirmed (its stores are in: nothing of it is on the way) and its speculation
covered all its claimed blocks. Of the reused prefix (the blocks the plan found on that engine for the
scope), the request claims every block from the first one whose entry is not CONFIRMED when it is
recorded (:meth:`confirmed_prefix`): a PENDING entry is another request's speculation, which may never
reach the engine (its client left, its upstream failed), so this request may store that block itself.
The CONFIRMED leading blocks are held WEAKLY (while the request is in flight and until the first claim
sweep after its grace period): a weakly held block blocks nobody, but rule 4 cannot forget its scope.
The engine stores such a block again either after evicting it (its ``BlockRemoved`` comes first on the
same stream) or while it is still cached (a recompute under an evicted ancestor); either way under the
same engine hash, which rule 4 credits to the scope the entry had - from the bounded memory, or, when
that entry left while the block was held, from the held blocks' own record (engine hash and scope per
chain hash, kept until the last hold ends). A store of that chain hash under another engine hash is
another scope's own, so a shared system prompt keeps its hit rate. Holds are counted per chain hash
(a hot shared prompt is held by every request that reuses it: one count per block keeps the cost
O(blocks) per request). A fully reused prompt claims its last block only (the rest weakly).
A claim's last block is its TAIL: the request's DECODE blocks continue the engine's chain from there
and no claim can name them, so rule 2 refuses a block whose unattributed ancestry passes through
another scope's tail while that request is in flight or within the grace period after it (ancestry it
cannot follow counts as passing through any tail). Without this, a tenant that guessed another's output
could have that tenant's decode block, and by rule 3 its prompt, credited to itself. A prompt with no
full block has no tail: its decode blocks are ROOTS, whose chain hashes depend on output nobody knows
yet. Its SHORT claim (:meth:`ResidencyTracker.claim_short`) keeps its prompt tokens instead, and claims
and holds as a tail every root another scope speculates (in the last TTL, or while it blocks) whose
first block BEGINS with them - exactly the roots its decode could store - so such a root, and any block
under it, is refused rather than credited to the tenant that guessed the output. (Refusing every root
while such a request was in flight cost the gateway study several points of hit rate: a one-token probe
before each cell refused every first block for its grace period.) A claim holds each chain hash once
(repeats are dropped). Deployment requirement: the engines
are reachable only through the gateway(s), whose salts scope every store; a store by an outside
client of a chain some scope is pending on could otherwise be attributed to that scope. A confirmed
entry remembers its engine hash, so ``BlockRemoved`` deletes exactly it; ``AllBlocksCleared`` and
a replay gap (resync) delete every entry of that engine, speculative ones included.

``approximate`` (engines without events). The gateway's own record of what it routed, stated as
approximate: entries never expire by time; an LRU of ``approx_capacity_blocks`` per engine (hits
refresh it) stands in for the engine's eviction, so the record drifts from the engine's real
cache whenever the engine's capacity or eviction order differs.

Invariants:
- At most one entry per (engine, block hash, scope digest); the index holds exactly the entries
  this tracker holds as pending, confirmed or approximate (``check()`` verifies it in tests).
- Nothing is ever written under a scope that no request of that scope routed (attribution only
  through a speculation - this replica's or a peer's - or a parent or descendant already attributed
  to that scope).
- A root-rule attribution of a chain hash to scope S happens only while no other scope's claim on
  that (engine, chain hash) blocks; claims and weak holds are indexed per (engine, chain hash) in one
  dict write per block, and the confirmed prefix is found, with C-level ``map``/``update`` (no
  per-block Python loop on the request's path or in the claim sweep).
- Memory is bounded by the engines' caches and the requests in flight: a confirmed entry drops its
  request's claim, and a claim swept out of the index keeps none of its blocks.
- Confined to one thread (the gateway's event loop): the KV-event subscriber's thread hands its
  calls over with ``loop.call_soon_threadsafe`` (:class:`EventSink`).

Two gateway replicas share prefix state by each subscribing to every engine's events AND linking
as peers (:mod:`.peers`): each replica's claims, speculations, retractions and request ends reach
the other, enter its tracker as if routed there, and are confirmed by the same engine events, so
both hold the same entries. A request's claim is decided by each replica from its own confirmed
entries (the link carries the whole prompt: :meth:`ResidencyTracker.claim_prompt`), so a replica
whose view lags after a resync claims the reused blocks it does not see confirmed. Replicas sharing
engines MUST be linked: a replica knows no claim of a request routed elsewhere, so another replica's
store of a chain that one scope alone is pending on here would be credited to that scope (see
:mod:`.peers` for the ordering limit of the link).
"""

from __future__ import annotations

import asyncio
import enum
import math
import operator
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from itertools import compress, count, repeat

import numpy as np

from quillcache.index.base import IndexBackend
from quillcache.index.keys import IDENTITY_BYTES, U32_MAX, U64_MAX, ReplicaKey, ResidencyEntry
from quillcache.types import CacheTier

__all__ = ["Claim", "EntryState", "EventSink", "ResidencyStats", "ResidencyTracker"]

_GPU = CacheTier.GPU
_COLUMNS_MIN = 8  # entries from which one ``put_columns`` costs less than ``put``'s per-entry objects
_MAX_ANCESTRY_STEPS = 4096  # rule 2's walk up unattributed ancestors; longer counts as unknown ancestry
_GPU_MEDIA = (None, "GPU", "gpu")  # vLLM's medium field (absent in older builds)
_STATE = operator.attrgetter("state")


class EntryState(enum.Enum):
    PENDING = "pending"  # speculative, waiting for a BlockStored
    CONFIRMED = "confirmed"  # an engine event stored it
    APPROX = "approximate"  # routed to an engine without events
    DROPPED = "dropped"  # expired or removed (kept only by stale queue references)


class Claim:
    """One request's claim on the chain hashes it may cause ``engine`` to store (module doc).

    Open while ``lease.live`` (a local request's routing lease) or, with no lease (a peer's request),
    until :meth:`ResidencyTracker.end_claim` or ``open_until_s``; ``ended_s`` is when it was first seen
    ended. ``unconfirmed``: entries its speculation wrote that no store confirmed yet; ``lost``: one of
    them left unconfirmed (expired, retracted, cleared) or the speculation did not cover every claimed
    block, so its stores may still be on the way."""

    __slots__ = ("cid", "digest", "ended_s", "engine", "hashes", "lease", "lost", "notified", "open_until_s",
                 "roots", "short", "tail", "unconfirmed", "weak")

    def __init__(self, engine: str, digest: bytes, hashes: list[int], lease, open_until_s: float,
                 lost: bool, cid: int, tail: int | None = None, weak: list[int] | None = None) -> None:
        self.engine = engine
        self.digest = digest
        self.hashes = hashes
        self.weak = weak  # the reused blocks confirmed when it was claimed (chain hashes), or None
        self.short: tuple[int, ...] | None = None  # a prompt with no full block: its tokens (its decode is a root)
        self.roots: list[int] | None = None  # other scopes' pending roots such a request's decode may store
        self.tail = tail  # the chain hash its engine's decode blocks continue from, or None
        self.lease = lease
        self.open_until_s = open_until_s
        self.lost = lost
        self.cid = cid
        self.unconfirmed = 0
        self.ended_s: float | None = None
        self.notified = False


class _Rec:
    __slots__ = ("claim", "digest", "engine", "engine_hash", "expires_s", "h", "state")

    def __init__(self, engine: str, h: int, digest: bytes, state: EntryState, expires_s: float,
                 claim: Claim | None = None) -> None:
        self.engine = engine
        self.h = h
        self.digest = digest
        self.state = state
        self.expires_s = expires_s
        self.engine_hash: int | None = None
        self.claim = claim

    def drop_unconfirmed(self) -> None:
        """PENDING -> DROPPED without a store: its claim's stores may still come."""
        self.state = EntryState.DROPPED
        if self.claim is not None:
            self.claim.lost = True


@dataclass(slots=True)
class ResidencyStats:
    """Block counts (monotonic: they back a Prometheus counter). Every stored block of an events engine is
    counted when it is stored as ``confirmed`` (``inherited`` among them) or ``unattributed`` (``ambiguous``
    among them: a root refused because several scopes could own it); ``resolved`` counts the unattributed
    blocks attributed later through a descendant (module doc, rule 3), so ``unattributed - resolved`` are
    the stored blocks no scope was ever credited with."""

    speculated: int = 0
    confirmed: int = 0
    inherited: int = 0  # confirmed through the parent's scope without a speculation
    expired: int = 0
    removed: int = 0
    cleared: int = 0
    unattributed: int = 0
    ambiguous: int = 0  # root stores refused: pending speculations or claims of several scopes matched
    resolved: int = 0  # unattributed blocks attributed later, through a descendant's scope
    remembered: int = 0  # stored again under an engine hash attributed before (rule 4; ``confirmed`` among them)
    approx_evicted: int = 0
    unknown_removals: int = 0

    def counts(self) -> dict[str, int]:
        """Every counter by name (the gateway's ``residency_outcomes_total``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class ResidencyTracker:
    """Writes engine GPU residency into ``index`` (see module doc)."""

    def __init__(self, index: IndexBackend, engines: dict[str, str], *, ttl_s: float = 2.0,
                 block_bytes: int = 0, approx_capacity_blocks: dict[str, int] | None = None,
                 clock: Callable[[], float] = time.monotonic, claim_grace_s: float | None = None,
                 max_unattributed_blocks: int = 1 << 18, max_known_blocks: int = 1 << 18) -> None:
        """``engines``: engine name -> ``"events"`` or ``"approximate"``. ``claim_grace_s``: how long an
        ended request's claim still blocks other scopes (default ``ttl_s``). Per events engine,
        ``max_unattributed_blocks``: how many unattributed blocks are remembered for rule 3, and
        ``max_known_blocks``: how many removed blocks' scopes are remembered for rule 4 (module doc; 0 turns
        a rule off)."""
        self.index = index
        self.modes = dict(engines)
        self.ttl_s = float(ttl_s)
        self.claim_grace_s = self.ttl_s if claim_grace_s is None else float(claim_grace_s)
        if not (math.isfinite(self.claim_grace_s) and self.claim_grace_s >= 0):
            raise ValueError(f"claim_grace_s must be a finite number >= 0, got {claim_grace_s!r}")
        # (engine) -> chain hash -> the claims on it (one Claim, or a tuple of several)
        self._claims: dict[str, dict[int, Claim | tuple[Claim, ...]]] = {
            e: {} for e, m in self.modes.items() if m == "events"}
        self._claimed: list[Claim] = []  # every claim still indexed (open, or ended and not yet dead)
        # (engine) -> chain hash -> how many indexed claims hold it WEAKLY (reused, confirmed when claimed), and
        # chain hash -> {engine hash: scope digest} of its confirmed entries that left while it was held (rule 4)
        self._weak: dict[str, dict[int, int]] = {e: {} for e, m in self.modes.items() if m == "events"}
        self._weak_gone: dict[str, dict[int, dict[int, bytes]]] = {
            e: {} for e, m in self.modes.items() if m == "events"}
        # (engine) -> the claims of requests whose prompt has no full block, open or within the grace; and the
        # root speculations of the last TTL, oldest first: (expires_s, chain hash, digest, first block's tokens)
        self._shorts: dict[str, list[Claim]] = {e: [] for e, m in self.modes.items() if m == "events"}
        self._roots: dict[str, deque[tuple[float, int, bytes, tuple[int, ...]]]] = {
            e: deque() for e, m in self.modes.items() if m == "events"}
        # (engine) -> a claim's tail (its last prompt block's chain hash) -> the claims ending there
        self._tails: dict[str, dict[int, Claim | tuple[Claim, ...]]] = {
            e: {} for e, m in self.modes.items() if m == "events"}
        self._next_sweep_s = -math.inf
        self._sweep_every_s = min(0.25, self.claim_grace_s / 4) if self.claim_grace_s else 0.0
        self._cids = 0
        self.on_claim_end: Callable[[Claim], None] | None = None  # a local claim was seen ended (peers)
        self.block_bytes = int(block_bytes)
        self.clock = clock
        caps = approx_capacity_blocks or {}
        self._cap = {e: int(caps.get(e, 65536)) for e in self.modes}
        self._live: dict[str, dict[tuple[int, bytes], _Rec]] = {e: {} for e in self.modes}
        self._approx: dict[str, OrderedDict[tuple[int, bytes], _Rec]] = {
            e: OrderedDict() for e, m in self.modes.items() if m == "approximate"}
        self._pending: dict[tuple[str, int], deque[_Rec]] = {}
        self._expiry: deque[_Rec] = deque()
        self._by_engine_hash: dict[str, dict[int, _Rec]] = {e: {} for e in self.modes}
        for name, v in (("max_unattributed_blocks", max_unattributed_blocks), ("max_known_blocks", max_known_blocks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        self.max_unattributed_blocks = max_unattributed_blocks
        self.max_known_blocks = max_known_blocks
        # per events engine: unattributed engine hash -> (chain hash, parent engine hash or None), oldest first
        # (rule 3)
        self._orphans: dict[str, OrderedDict[int, tuple[int, int | None]]] = {
            e: OrderedDict() for e, m in self.modes.items() if m == "events"}
        # per events engine: engine hash of a removed confirmed block -> its scope digest, oldest first (rule 4)
        self._known: dict[str, OrderedDict[int, bytes]] = {
            e: OrderedDict() for e, m in self.modes.items() if m == "events"}
        self.stats = ResidencyStats()

    # ---- routing-time side (event loop) ------------------------------------------------------
    def claim(self, engine: str, block_hashes: Sequence[int], digest: bytes, lease=None, *,
              complete: bool = True, open_for_s: float | None = None, weak: Sequence[int] | None = None
              ) -> Claim:
        """Claim ``block_hashes`` (the chain hashes a request routed to ``engine`` may cause it to store)
        for scope ``digest``: open while ``lease.live`` or, with ``lease=None`` (a peer's request), until
        :meth:`end_claim` or ``open_for_s`` from now. ``complete=False``: the request's speculation does not
        cover every claimed block (its stores cannot all be seen confirmed). The last hash is the claim's
        TAIL: the request's decode blocks continue the engine's chain from there, so no block below it is
        credited to another scope by rule 2 (module doc). For an approximate engine the claim is only a
        handle (nothing is attributed there, nothing is indexed). ``weak``: the chain hashes of the reused
        blocks that were CONFIRMED when claimed, held only once their entry is gone (module doc). Cost: one
        dict write per block, at C level."""
        if engine not in self.modes:
            raise KeyError(f"unknown engine {engine!r}")
        table = self._claims.get(engine)
        tolist = getattr(block_hashes, "tolist", None)
        hl = list(dict.fromkeys(tolist() if tolist is not None else [int(h) for h in block_hashes]))
        now = self.clock()
        self._cids += 1
        tail = hl[-1] if hl and table is not None else None
        c = Claim(engine, digest, hl, lease, math.inf if open_for_s is None else now + open_for_s,
                  not complete, self._cids, tail,
                  (weak if type(weak) is list else list(weak)) if weak and table is not None else None)
        if table is not None:
            if hl:
                self._index(table, hl, c, now, self._blocking)
                tails = self._tails[engine]
                tails[tail] = self._merge(tails.get(tail), c, now, self._tail_blocking)
            if c.weak:  # counts, not claim tuples: a hot shared prompt is held by every request reusing it
                weak = self._weak[engine]
                hw = c.weak
                weak.update(zip(hw, map((1).__add__, map(weak.get, hw, repeat(0)))))
            if hl or c.weak:
                self._claimed.append(c)
        return c

    def _index(self, table: dict, hl: list[int], c: Claim, now: float, blocking) -> None:
        """Index claim ``c`` under each of ``hl`` in ``table``, beside the claims there that still block."""
        prevs = list(map(table.get, hl))
        merged = {p: self._merge(p, c, now, blocking) for p in set(prevs)}  # one per overlapping claim set: few
        table.update(zip(hl, map(merged.__getitem__, prevs)))

    def _unindex(self, table: dict, hl: list[int], now: float, blocking) -> None:
        """Drop from ``table`` under each of ``hl`` the claims that no longer block."""
        prevs = list(map(table.get, hl))
        repl = {p: self._prune(p, now, blocking) for p in set(prevs)}
        if all(q is None for q in repl.values()):
            deque(map(table.pop, hl, repeat(None)), maxlen=0)
        else:  # pop with a default: a hash that is gone already (or repeated) cannot break the sweep
            table.update(zip(hl, map(repl.__getitem__, prevs)))
            deque(map(table.pop, [h for h, p in zip(hl, prevs) if repl[p] is None], repeat(None)), maxlen=0)

    def end_claim(self, c: Claim) -> None:
        """A peer's request ended: its claim blocks for the grace period from now (or less, module doc)."""
        if c.ended_s is None:
            c.ended_s = self.clock()

    @staticmethod
    def _in_flight(c: Claim, now: float) -> bool:
        """Whether ``c``'s request is still in flight; the first time it is seen ended, ``ended_s`` is set."""
        if c.ended_s is None:
            lease = c.lease
            if (lease.live if lease is not None else now < c.open_until_s):
                return True
            c.ended_s = now
        return False

    def _blocking(self, c: Claim, now: float) -> bool:
        """Whether ``c`` still blocks other scopes' root attributions (module doc)."""
        if self._in_flight(c, now):
            return True
        if c.unconfirmed <= 0 and not c.lost:
            return False  # every block it speculated was stored: none of its stores is on the way
        return now < c.ended_s + self.claim_grace_s

    def _tail_blocking(self, c: Claim, now: float) -> bool:
        """Whether ``c``'s tail still blocks: while its request is in flight and for the grace period after,
        whatever was confirmed (its decode blocks are never speculated, so none is ever seen confirmed)."""
        return self._in_flight(c, now) or now < c.ended_s + self.claim_grace_s

    def _merge(self, prev, c: Claim, now: float, blocking=None):
        if prev is None:
            return c
        blocking = blocking or self._blocking
        kept = tuple(x for x in (prev if type(prev) is tuple else (prev,)) if blocking(x, now))
        return kept + (c,) if kept else c

    def _prune(self, prev, now: float, blocking=None):
        if prev is None:
            return None
        blocking = blocking or self._blocking
        kept = tuple(x for x in (prev if type(prev) is tuple else (prev,)) if blocking(x, now))
        return (kept[0] if len(kept) == 1 else kept) if kept else None

    def _other_scope_tail(self, engine: str, tail: int, digest: bytes) -> bool:
        """Whether a claim of a scope other than ``digest`` whose decode continues from ``tail`` blocks."""
        v = self._tails[engine].get(tail)
        if v is None:
            return False
        now = self.clock()
        return any(c.digest != digest and self._tail_blocking(c, now) for c in (v if type(v) is tuple else (v,)))

    def _continues_another_scope(self, engine: str, parent_engine_hash: int | None, digest: bytes) -> bool:
        """Rule 2's decode check (module doc): whether a block stored under ``parent_engine_hash`` (None: a
        root), with no attributed parent, could be a decode block of a request of a scope other than
        ``digest``: some unattributed ancestor up its chain is the tail of another scope's blocking claim, or
        the chain reaches another scope's attributed block, or the ancestry is unknown (a parent neither
        remembered nor attributed) while another scope's tail blocks. A root passes here: a short claim
        holds the roots its decode could store (:meth:`claim_short`)."""
        tails = self._tails[engine]
        if not tails:
            return False
        orphans = self._orphans[engine]
        p = parent_engine_hash
        for _ in range(_MAX_ANCESTRY_STEPS):
            if p is None:
                return False
            o = orphans.get(p)
            if o is None:
                rec = self._by_engine_hash[engine].get(p)
                if rec is not None and rec.state is EntryState.CONFIRMED:
                    return rec.digest != digest
                break  # unknown ancestry
            h, p = o
            if self._other_scope_tail(engine, h, digest):
                return True
        return any(self._other_scope_tail(engine, t, digest) for t in list(tails))

    def _other_scope_blocks(self, engine: str, h: int, digest: bytes) -> bool:
        """Whether a claim of a scope other than ``digest`` blocks chain hash ``h`` on ``engine``."""
        v = self._claims[engine].get(h)
        if v is None:
            return False
        now = self.clock()
        if type(v) is not tuple:
            return v.digest != digest and self._blocking(v, now)
        return any(c.digest != digest and self._blocking(c, now) for c in v)

    def _sweep_claims(self, now: float) -> None:
        """Tell the peer link of local claims seen ended; unindex claims that no longer block. Runs at
        most every ``_sweep_every_s`` (a claim seen late blocks longer: the safe side)."""
        if now < self._next_sweep_s:
            return
        self._next_sweep_s = now + self._sweep_every_s
        kept: list[Claim] = []
        for c in self._claimed:
            blocking = self._blocking(c, now) or ((c.tail is not None or c.weak is not None or c.short is not None)
                                                  and self._tail_blocking(c, now))
            if c.ended_s is not None and not c.notified:
                c.notified = True
                if c.lease is not None and self.on_claim_end is not None:
                    self.on_claim_end(c)
            if blocking:
                kept.append(c)
                continue
            tails = self._tails[c.engine]
            for t in ([c.tail] if c.tail is not None else []) + (c.roots or []):
                q = self._prune(tails.get(t), now, self._tail_blocking)
                if q is None:
                    tails.pop(t, None)
                else:
                    tails[t] = q
            if c.short is not None:
                self._shorts[c.engine].remove(c)
            self._unindex(self._claims[c.engine], c.hashes, now, self._blocking)
            if c.weak:
                self._unindex_weak(c)
            c.weak = None  # a peer's claim outlives its sweep in the link: not what it held
            c.hashes = []
        self._claimed = kept

    def _unindex_weak(self, c: Claim) -> None:
        """Count ``c``'s weak holds off; a chain hash no claim holds any more leaves the held record too."""
        weak = self._weak[c.engine]
        hw = c.weak
        left = list(map((-1).__add__, map(weak.get, hw, repeat(1))))
        weak.update(zip(hw, left))
        zeros = list(compress(hw, map(operator.not_, left)))
        deque(map(weak.pop, zeros, repeat(None)), maxlen=0)
        gone = self._weak_gone[c.engine]
        if gone:
            deque(map(gone.pop, zeros, repeat(None)), maxlen=0)

    def confirmed_prefix(self, engine: str, block_hashes: Sequence[int], digests: Sequence[bytes]) -> int:
        """How many leading ``block_hashes`` have a CONFIRMED entry under their ``digests`` on ``engine``
        (a request claims its reused blocks from there on: module doc)."""
        live = self._live[engine]
        tolist = getattr(block_hashes, "tolist", None)
        hl = tolist() if tolist is not None else [int(h) for h in block_hashes]
        recs = list(map(live.get, zip(hl, digests)))  # C-level: a hot prompt may be thousands of blocks
        n = recs.index(None) if None in recs else len(recs)
        not_confirmed = map(operator.is_not, map(_STATE, recs[:n]), repeat(EntryState.CONFIRMED))
        return next(compress(count(), not_confirmed), n)

    def claim_prompt(self, engine: str, block_hashes: Sequence[int], digest: bytes, lease=None, *,
                     reused_blocks: int, speculated_blocks: int, digests: Sequence[bytes] | None = None,
                     open_for_s: float | None = None, tokens: Sequence[int] = ()) -> Claim:
        """:meth:`claim` what a request of scope ``digest`` with prompt chain hashes ``block_hashes`` may cause
        ``engine`` to store, decided from THIS tracker's confirmed entries (module doc): the first
        ``reused_blocks`` were found on ``engine`` by its plan (under ``digests``, its per-block write
        digests; default ``digest``) and its speculation covers the next ``speculated_blocks``. It claims
        every block from the first reused one not CONFIRMED here; a prompt confirmed whole claims its last
        block only (its tail). Linked replicas each call this with the whole prompt (:mod:`.peers`), so
        each claims from its own view: a replica whose view lags (after a resync) claims the reused blocks
        it does not see confirmed, and no replica's attribution relies on another's confirmed state. A prompt
        with no full block makes a short claim from its ``tokens`` (:meth:`claim_short`)."""
        events = self.modes[engine] == "events"
        if events and not len(block_hashes) and len(tokens):
            return self.claim_short(engine, tokens, digest, lease, open_for_s=open_for_s)
        if digests is None:
            digests = [digest] * reused_blocks
        first = self.confirmed_prefix(engine, block_hashes[:reused_blocks], digests) if events and reused_blocks \
            else reused_blocks
        tail_only = events and first == len(block_hashes) > 0
        if tail_only:
            first -= 1
        claimed = block_hashes[first:]
        weak = None
        if first > 0:
            tolist = getattr(block_hashes, "tolist", None)
            head = block_hashes[:first]
            weak = head.tolist() if tolist is not None else [int(h) for h in head]
        return self.claim(engine, claimed, digest, lease, complete=tail_only or speculated_blocks == len(claimed),
                          open_for_s=open_for_s, weak=weak)

    def claim_short(self, engine: str, tokens: Sequence[int], digest: bytes, lease=None, *,
                    open_for_s: float | None = None) -> Claim:
        """Claim for a request of scope ``digest`` on an events engine whose prompt ``tokens`` has no full
        block: its decode blocks are ROOTS whose chain hashes nobody can name in advance (module doc). It
        claims, and holds as tails, the pending root speculations of other scopes whose first block
        begins with ``tokens`` - those of the last TTL now, later ones as :meth:`speculate` records them -
        while it is in flight and for the grace period after."""
        c = self.claim(engine, [], digest, lease, complete=False, open_for_s=open_for_s)
        if self.modes[engine] != "events":
            return c
        c.short = tuple(int(t) for t in tokens)
        self._shorts[engine].append(c)
        self._claimed.append(c)
        now = self.clock()
        roots = self._roots[engine]
        while roots and roots[0][0] <= now:
            roots.popleft()
        n = len(c.short)
        for _, h, d, first in roots:
            if d != digest and first[:n] == c.short:
                self._claim_root(c, h, now)
        return c

    def _claim_root(self, c: Claim, h: int, now: float) -> None:
        """Short claim ``c``'s decode may store root ``h``: claim it and hold it as a tail."""
        if c.roots is None:
            c.roots = []
        elif h in c.roots:
            return
        c.roots.append(h)
        c.hashes.append(h)
        table, tails = self._claims[c.engine], self._tails[c.engine]
        table[h] = self._merge(table.get(h), c, now)
        tails[h] = self._merge(tails.get(h), c, now, self._tail_blocking)

    def speculate(self, engine: str, block_hashes: Sequence[int], digests: Sequence[bytes], *,
                  reused_blocks: int = 0, claim: Claim | None = None, root_tokens: Sequence[int] = ()) -> list[_Rec]:
        """Record that the blocks ``[reused_blocks:]`` of a routed request will be on ``engine``
        (the first ``reused_blocks`` the plan found there are refreshed in approximate mode).
        Returns the new entries (``retract`` takes them back if the request fails); ``claim`` (the
        request's, from :meth:`claim`) counts the pending ones it waits for. ``root_tokens``: the leading tokens
        of the prompt's first block (all but its last suffice), for a root speculated on an events engine
        (:meth:`claim_short`). The new entries reach the index in one write (:meth:`_write`)."""
        live = self._live[engine]
        approx = self._approx.get(engine)
        if approx is not None:
            for j in range(min(reused_blocks, len(block_hashes))):
                k = (int(block_hashes[j]), digests[j])
                if k in approx:
                    approx.move_to_end(k)
        state = EntryState.APPROX if approx is not None else EntryState.PENDING
        expires = self.clock() + self.ttl_s
        put_h: list[int] = []
        put_d: list[bytes] = []
        recs: list[_Rec] = []
        pending = self._pending
        expiry = self._expiry
        tail = block_hashes[reused_blocks:]
        hl = tail.tolist() if isinstance(tail, np.ndarray) and tail.dtype.kind in "ui" else [int(h) for h in tail]
        for h, d in zip(hl, digests[reused_blocks:]):
            k = (h, d)
            if k in live:
                if approx is not None:
                    approx.move_to_end(k)
                continue
            rec = _Rec(engine, h, d, state, expires, claim)
            live[k] = rec
            recs.append(rec)
            put_h.append(h)
            put_d.append(d)
            if approx is not None:
                approx[k] = rec
            else:
                pq = pending.get((engine, h))
                if pq is None:
                    pending[(engine, h)] = deque((rec,))
                else:
                    pq.append(rec)
                expiry.append(rec)
        if put_h:
            self._write(engine, put_h, put_d)
            self.stats.speculated += len(put_h)
            if claim is not None and approx is None:
                claim.unconfirmed += len(recs)
        if approx is not None and len(approx) > self._cap[engine]:
            self._evict_approx(engine, approx)
        if recs and not reused_blocks and len(root_tokens) and approx is None and recs[0].h == int(block_hashes[0]):
            self._speculated_root(engine, recs[0], tuple(int(t) for t in root_tokens))
        return recs

    def _speculated_root(self, engine: str, rec: _Rec, first: tuple[int, ...]) -> None:
        """A root speculation with its first block's tokens: the short claims of other scopes whose prompt
        begins it claim it (:meth:`claim_short`); it is kept for the short claims of the next TTL."""
        roots = self._roots[engine]
        while roots and roots[0][0] <= rec.expires_s - self.ttl_s:
            roots.popleft()
        roots.append((rec.expires_s, rec.h, rec.digest, first))
        shorts = self._shorts[engine]
        if shorts:
            now = self.clock()
            for c in shorts:
                if c.digest != rec.digest and first[: len(c.short)] == c.short and self._tail_blocking(c, now):
                    self._claim_root(c, rec.h, now)

    def _write(self, engine: str, hashes: list[int], digests: list[bytes]) -> None:
        """Write ``engine``'s GPU entries of chain ``hashes`` under their scope ``digests``: the records
        ``index.put`` writes, through one ``put_columns`` call (no per-entry objects) when there are at least
        ``_COLUMNS_MIN`` of them and every hash and digest fits the columns; else through ``put``, which names
        a bad field."""
        n = len(hashes)
        bb = self.block_bytes
        if (n >= _COLUMNS_MIN and min(hashes) >= 0 and max(hashes) <= U64_MAX and 0 <= bb <= U32_MAX
                and all(type(d) is bytes and len(d) == IDENTITY_BYTES for d in set(digests))):
            self.index.put_columns(np.array(hashes, dtype=np.uint64), b"".join(digests), [engine] * n,
                                   np.full(n, int(_GPU), dtype=np.uint8), np.zeros(n, dtype=np.uint32),
                                   np.zeros(n, dtype=np.uint64), np.full(n, bb, dtype=np.uint32))
        else:
            self.index.put([ResidencyEntry(h, engine, _GPU, d, 0, 0, bb) for h, d in zip(hashes, digests)])

    def retract(self, recs: Iterable[_Rec]) -> int:
        """Take back entries a failed request speculated (those no event confirmed meanwhile). Its claim
        stays: the engine may have stored the blocks before the client left (module doc)."""
        gone = []
        for rec in recs:
            if rec.state is EntryState.PENDING or rec.state is EntryState.APPROX:
                k = (rec.h, rec.digest)
                del self._live[rec.engine][k]
                approx = self._approx.get(rec.engine)
                if approx is not None:
                    approx.pop(k, None)
                rec.drop_unconfirmed()
                gone.append(ReplicaKey(rec.h, rec.engine, _GPU, rec.digest))
        if gone:
            self.index.remove(gone)
        return len(gone)

    def _evict_approx(self, engine: str, approx: OrderedDict) -> None:
        live = self._live[engine]
        gone = []
        while len(approx) > self._cap[engine]:
            k, rec = approx.popitem(last=False)
            del live[k]
            rec.state = EntryState.DROPPED
            gone.append(ReplicaKey(rec.h, engine, _GPU, rec.digest))
        self.index.remove(gone)
        self.stats.approx_evicted += len(gone)

    def expire(self, now: float | None = None) -> int:
        """Drop speculative entries whose TTL ran out unconfirmed (their claims stay); returns how many.
        Also sweeps the claims (:meth:`_sweep_claims`)."""
        now = self.clock() if now is None else now
        if self._claimed:
            self._sweep_claims(now)
        q = self._expiry
        if not q or q[0].expires_s > now:
            return 0
        gone = []
        while q and q[0].expires_s <= now:
            rec = q.popleft()
            if rec.state is EntryState.PENDING:
                rec.drop_unconfirmed()
                del self._live[rec.engine][(rec.h, rec.digest)]
                gone.append(ReplicaKey(rec.h, rec.engine, _GPU, rec.digest))
                pq = self._pending.get((rec.engine, rec.h))
                if pq is not None:
                    while pq and pq[0].state is not EntryState.PENDING:
                        pq.popleft()
                    if not pq:
                        del self._pending[(rec.engine, rec.h)]
        if gone:
            self.index.remove(gone)
            self.stats.expired += len(gone)
        return len(gone)

    # ---- engine-event side (event loop, handed over from the subscriber thread) --------------
    def _pop_pending(self, engine: str, h: int, digest: bytes | None, parent_engine_hash: int | None = None
                     ) -> _Rec | None:
        """``digest``: that scope's pending entry for ``h``, if any. ``digest=None`` (rule 2): the only scope's
        pending entry, unless another scope may have stored the block (its pending entry or claim on ``h``,
        or a decode continuation of its request from the block's ancestry under ``parent_engine_hash``)."""
        pq = self._pending.get((engine, h))
        if not pq:
            return None
        found = None
        if digest is None:
            while pq and pq[0].state is not EntryState.PENDING:
                pq.popleft()
            if pq and (any(r.state is EntryState.PENDING and r.digest != pq[0].digest for r in pq)
                       or self._other_scope_blocks(engine, h, pq[0].digest)
                       or self._continues_another_scope(engine, parent_engine_hash, pq[0].digest)):
                self.stats.ambiguous += 1  # two scopes may have stored this chain: whose block is it? nobody's
                return None
            if pq:
                found = pq.popleft()
        else:
            for rec in pq:
                if rec.state is EntryState.PENDING and rec.digest == digest:
                    found = rec
                    break
            if found is not None:
                pq.remove(found)
        if not pq:
            del self._pending[(engine, h)]
        return found

    def stored(self, engine: str, engine_hashes: Sequence[int], chain_hashes: Sequence[int | None],
               parent_engine_hash: int | None) -> int:
        """A ``BlockStored`` of ``engine``: per block its engine hash and its unscoped chain hash
        (None where the subscriber could not compute it), in chain order after
        ``parent_engine_hash``. Returns how many of these blocks were attributed (earlier blocks this
        store resolved through rule 3 are counted in ``stats.resolved``)."""
        if self.modes.get(engine) != "events":
            return 0
        if len(engine_hashes) != len(chain_hashes):
            raise ValueError(f"{len(engine_hashes)} engine hashes for {len(chain_hashes)} chain hashes")
        by_e = self._by_engine_hash[engine]
        orphans = self._orphans[engine]
        known = self._known[engine]
        held_gone = self._weak_gone[engine]
        parent = by_e.get(parent_engine_hash) if parent_engine_hash is not None else None
        prev_e = None if parent_engine_hash is None else int(parent_engine_hash)  # this block's parent in the chain
        puts: list[ResidencyEntry] = []
        n = 0
        for e, h in zip(engine_hashes, chain_hashes):
            if h is None:  # the subscriber does not know this block's prefix: it cannot be matched
                self.stats.unattributed += 1
                parent = None
                prev_e = int(e)  # not remembered (no chain hash to write): a walk up stops here
                continue
            e, h = int(e), int(h)
            digest = known.pop(e, None) if known else None  # stored again: live from here on
            if digest is None:  # stored again while still cached (a recompute under an evicted ancestor)
                cur = by_e.get(e)
                if cur is not None and cur.state is EntryState.CONFIRMED and cur.h == h:
                    digest = cur.digest
                elif held_gone:  # its entry left while a request held it (module doc)
                    g = held_gone.get(h)
                    if g is not None:
                        digest = g.get(e)
            if parent is not None and parent.state is EntryState.CONFIRMED:  # rule 1
                rec, new = self._take(engine, h, parent.digest, puts)
                self.stats.inherited += new
            else:
                if digest is not None:  # rule 4
                    rec, _ = self._take(engine, h, digest, puts)
                    self.stats.remembered += 1
                else:  # rule 2
                    rec = self._pop_pending(engine, h, None, prev_e)
                    if rec is None and self.max_unattributed_blocks:
                        orphans[e] = (h, prev_e)
                        orphans.move_to_end(e)
                        if len(orphans) > self.max_unattributed_blocks:
                            orphans.popitem(last=False)
                if rec is not None and prev_e is not None and orphans:  # rule 3
                    self.stats.resolved += self._resolve(engine, prev_e, rec.digest, puts)
            if rec is None:
                self.stats.unattributed += 1
                parent = None
                prev_e = e
                continue
            self._confirm(rec, e, by_e)
            parent = rec
            prev_e = e
            n += 1
        if puts:
            self.index.put(puts)
        self.stats.confirmed += n
        return n

    def _take(self, engine: str, h: int, digest: bytes, puts: list[ResidencyEntry]) -> tuple[_Rec, bool]:
        """The entry a store of chain hash ``h`` known to be scope ``digest``'s confirms, and whether it is new:
        that scope's pending speculation, else its live entry, else a new one (appended to ``puts``)."""
        rec = self._pop_pending(engine, h, digest)
        if rec is not None:
            return rec, False
        live = self._live[engine]
        k = (h, digest)
        rec = live.get(k)
        if rec is not None:
            return rec, False
        rec = live[k] = _Rec(engine, h, digest, EntryState.CONFIRMED, 0.0)
        puts.append(ResidencyEntry(h, engine, _GPU, digest, 0, 0, self.block_bytes))
        return rec, True

    @staticmethod
    def _confirm(rec: _Rec, engine_hash: int, by_e: dict[int, _Rec]) -> None:
        if rec.state is EntryState.PENDING and rec.claim is not None:
            rec.claim.unconfirmed -= 1
        rec.claim = None  # a confirmed entry never needs its request's claim again
        rec.state = EntryState.CONFIRMED
        rec.engine_hash = engine_hash
        by_e[engine_hash] = rec

    def _resolve(self, engine: str, engine_hash: int, digest: bytes, puts: list[ResidencyEntry]) -> int:
        """Rule 3 (module doc): a block of scope ``digest`` was just attributed and its parent's engine hash
        is ``engine_hash``; credit every unattributed ancestor up that chain to the same scope (their pending
        speculations of that scope confirmed, or new entries appended to ``puts``). Returns how many."""
        orphans = self._orphans[engine]
        by_e = self._by_engine_hash[engine]
        n = 0
        p: int | None = engine_hash
        while p is not None:
            o = orphans.pop(p, None)
            if o is None:
                break
            h, up = o
            rec, new = self._take(engine, h, digest, puts)
            if not new and rec.state is EntryState.CONFIRMED:  # the scope holds it under another engine hash
                p = up
                continue
            self._confirm(rec, p, by_e)
            n += 1
            p = up
        return n

    def _remember_scope(self, engine: str, engine_hash: int, h: int, digest: bytes) -> None:
        """A confirmed block left the tracker: rule 4 remembers its scope should the engine store it again (in
        the bounded memory, and while a request holds the block weakly, in the held record: module doc)."""
        weak = self._weak.get(engine)
        if weak and weak.get(h):  # held: kept until the last hold ends, whatever the bounded memory forgets
            self._weak_gone[engine].setdefault(h, {})[engine_hash] = digest
        if self.max_known_blocks:
            known = self._known[engine]
            known[engine_hash] = digest
            known.move_to_end(engine_hash)
            if len(known) > self.max_known_blocks:
                known.popitem(last=False)

    def removed(self, engine: str, engine_hashes: Iterable[int]) -> int:
        """A ``BlockRemoved`` of ``engine``: delete the entries those engine hashes confirmed."""
        by_e = self._by_engine_hash.get(engine)
        if by_e is None:
            return 0
        live = self._live[engine]
        orphans = self._orphans.get(engine)
        gone = []
        for e in engine_hashes:
            if orphans:
                orphans.pop(int(e), None)
            rec = by_e.pop(int(e), None)
            if rec is None or rec.engine_hash != int(e) or rec.state is not EntryState.CONFIRMED:
                self.stats.unknown_removals += 1
                continue
            rec.state = EntryState.DROPPED
            del live[(rec.h, rec.digest)]
            gone.append(ReplicaKey(rec.h, engine, _GPU, rec.digest))
            self._remember_scope(engine, int(e), rec.h, rec.digest)
        if gone:
            self.index.remove(gone)
            self.stats.removed += len(gone)
        return len(gone)

    def cleared(self, engine: str) -> int:
        """``AllBlocksCleared`` or a resync of ``engine``: delete every entry of that engine."""
        live = self._live.get(engine)
        if live is None:
            return 0
        gone = [ReplicaKey(rec.h, engine, _GPU, rec.digest) for rec in live.values()]
        for rec in live.values():
            if rec.state is EntryState.PENDING:
                rec.drop_unconfirmed()  # its request is still in flight: its claim stays
            elif rec.state is EntryState.CONFIRMED and rec.engine_hash is not None:
                self._remember_scope(engine, rec.engine_hash, rec.h, rec.digest)
            rec.state = EntryState.DROPPED
        live.clear()
        self._by_engine_hash[engine].clear()
        if engine in self._orphans:
            self._orphans[engine].clear()
        if engine in self._approx:
            self._approx[engine].clear()
        for key in [k for k in self._pending if k[0] == engine]:
            del self._pending[key]
        if gone:
            self.index.remove(gone)
        self.stats.cleared += len(gone)
        return len(gone)

    # ---- introspection -----------------------------------------------------------------------
    def resident_counts(self, engines: Sequence[str]) -> list[int]:
        """Entries per engine (pending, confirmed or approximate), in ``engines`` order: the blocks the
        gateway knows are, or are about to be, in each engine's GPU cache (blocks no scope could be
        attributed to are not counted). O(number of engines)."""
        live = self._live
        return [len(live[e]) for e in engines]

    def count(self, engine: str, state: EntryState | None = None) -> int:
        live = self._live[engine]
        return len(live) if state is None else sum(1 for r in live.values() if r.state is state)

    def check(self) -> None:
        """Assert the index holds exactly this tracker's entries (tests)."""
        for engine, live in self._live.items():
            held = {(e.block_hash, e.identity) for e in self.index.entries_on_node(engine)}
            assert held == set(live), f"engine {engine}: index {len(held)} entries, tracker {len(live)}"
            for rec in live.values():
                assert rec.state in (EntryState.PENDING, EntryState.CONFIRMED, EntryState.APPROX)
        for engine, gone in self._weak_gone.items():  # the held record is bounded by the weak holds
            weak = self._weak[engine]
            assert all(weak.get(h, 0) > 0 for h in gone) and all(gone.values())
            assert all(n > 0 for n in weak.values())


class EventSink:
    """The sink of :class:`quillcache.kvevents.KvEventSubscriber`: hands each call from the
    subscriber's thread to the event loop that owns the tracker (``call_soon_threadsafe``)."""

    def __init__(self, tracker: ResidencyTracker, loop: asyncio.AbstractEventLoop, *,
                 on_event: Callable[[str, str], None] | None = None,
                 on_caught_up: Callable[[str], None] | None = None) -> None:
        self.tracker = tracker
        self.loop = loop
        self.on_event = on_event
        self._on_caught_up = on_caught_up

    def on_caught_up(self, engine_id: str) -> None:
        """Posted like the events, so it runs on the loop after every replayed call the catch-up made."""
        if self._on_caught_up is not None:
            self._post(self._on_caught_up, engine_id)

    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the gateway is shutting down
            pass

    def _count(self, engine: str, kind: str) -> None:
        if self.on_event is not None:
            self.on_event(engine, kind)

    def on_stored(self, engine_id: str, stored) -> None:
        if stored.medium not in _GPU_MEDIA:  # only the engine's GPU blocks are its prefix cache
            return
        engine_hashes = list(stored.block_hashes)
        chain_hashes = list(stored.chain_hashes)
        parent = stored.parent_block_hash
        self._post(self._stored, engine_id, engine_hashes, chain_hashes, parent)

    def _stored(self, engine_id, engine_hashes, chain_hashes, parent) -> None:
        self.tracker.stored(engine_id, engine_hashes, chain_hashes, parent)
        self._count(engine_id, "stored")

    def on_removed(self, engine_id: str, hashes) -> None:
        if getattr(hashes, "medium", None) not in _GPU_MEDIA:
            return
        self._post(self._removed, engine_id, list(hashes))

    def _removed(self, engine_id, hashes) -> None:
        self.tracker.removed(engine_id, hashes)
        self._count(engine_id, "removed")

    def on_cleared(self, engine_id: str) -> None:
        self._post(self._cleared, engine_id, "cleared")

    def on_resync(self, engine_id: str) -> None:
        self._post(self._cleared, engine_id, "resync")

    def _cleared(self, engine_id, kind) -> None:
        self.tracker.cleared(engine_id)
        self._count(engine_id, kind)
