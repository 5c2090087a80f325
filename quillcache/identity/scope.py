"""Identity scope, sharing policy and the reuse audit: who may reuse a cached block.

A cached block is reused only by a request of the same identity scope. The scope is every field
of :class:`quillcache.types.Identity`:

=============  ================================================================================
field          why it must match
=============  ================================================================================
model          KV of another model is numerically meaningless here (a silent correctness error)
tokenizer      the same token ids mean different text under another tokenizer
adapter        a LoRA adapter changes the K/V projections: its KV differs from the base model's
layout         dtype, block size and tensor-parallel rank decide what the bytes are
tenant         another tenant's KV is a privacy leak (prompt-leakage attacks rebuild prompts
               from what is cached) - unless the block is shared under an explicit policy
=============  ================================================================================

The one exception is :class:`SharingPolicy`: the operator registers *public* prefixes (e.g. a
provider-wide system prompt, :meth:`SharingPolicy.with_public_prompt`); those blocks live under the
public scope of their model (same model/tokenizer/adapter/layout, tenant ``""``) and may be read by
every tenant the policy names. Nothing else is ever shared, and model, tokenizer, adapter and layout
must match even for public blocks.

Public writes are checked by CONTENT, never by hash alone. A block hash (XXH3-64, the Dynamo chain)
is not second-preimage resistant: a tenant can build different tokens whose chained block hashes
equal a registered prompt's. So the policy keeps, per registered block, a BLAKE2b digest of the
registered token prefix through that block, and a request's block is written under the public
scope only when (a) the request's tenant may read the public scope and (b) the request's own token
prefix through that block has the registered digest, i.e. the request's tokens ARE the registered
prompt's tokens (:meth:`RequestScope.write_digests`). Everything else, a forged collision or a
block registered by hash alone (``public_blocks`` without its tokens), is written under the
request's own scope. Invariant: a public-scope entry written by a tenant request holds KV computed
from the registered tokens, which is what makes :attr:`ReuseReason.SHARED_PUBLIC` safe. Reads are
still checked by hash: a request whose tokens collide with a public prompt without being it may
read the public KV, which computes ITS OWN answer from the wrong KV (as a collision inside its own
scope would) and discloses nothing that is not public.

Validation rule for tenant ids and salts (``TENANT_ID_RE``, ``SALT_RE``): 1 to 128 characters from
``[A-Za-z0-9._:@-]`` - ASCII letters, digits and ``. _ : @ -``; nothing else (no spaces, slashes,
control or non-ASCII characters). A request must name a tenant (``""`` is the reserved public
scope). Model, tokenizer and adapter names: 1 to 256 characters from ``[A-Za-z0-9._:@/+=-]``
(model names carry ``/``); tokenizer and adapter may be empty ("the model's own" / "no adapter").
A malformed identity is refused with ``ValueError``/``TypeError`` naming the field and value
before any scope exists, so nothing can be cached under it.

Guard design (the fast path). A :class:`RequestScope` is built once per identity (and cached by the
bounded, LRU :class:`IdentityRegistry`; an evicted one is rebuilt, equal, on demand): it holds the
16-byte digests the request may read - its own and, where the policy allows, its model's public
scope - as a ``(k, 16)`` uint8 array. The planner compares each located replica's identity digest
with these rows inside its lookup kernel, so the check is part of the lookup; public-scope replicas
additionally need their block hash in the policy's sorted public set. Only :func:`audit_reuse` (the
audit path, also the plain-Python reference of the guard) decodes digests back to identities through
the registry and names reasons.

What is exposed to whom (no side channel)
-----------------------------------------
- A request's plan is computed from (a) replicas of ITS OWN scope, (b) public-scope replicas of
  registered public blocks, and (c) per-worker load counters (in-flight prefill tokens and decode
  blocks of all tenants). Replicas of any other scope are dropped inside the lookup before any
  score, action, cost or timing class is derived, so the chosen worker, the per-block actions,
  ``cached_tokens``, the predicted TTFT, the timing class and every ``x-quillcache-*`` header are
  identical whether or not another tenant has the same prefix cached (tested).
- Exposed to the requesting tenant: how many of its prompt tokens were reused from its own scope or
  from registered public prefixes (``cached_tokens``), the timing class (within / over SLO) and the
  worker name. Public-prefix residency is visible to every tenant the policy names - that is what
  registering a prefix as public means.
- Exposed to nobody through responses: whether another tenant (or another model, adapter,
  tokenizer or layout) has any block cached, and the identity digests in the index.
- Not hidden: aggregate load (a busy cluster answers slower for everyone), and capacity contention
  (another tenant's blocks can evict yours, a prime+probe style channel inherent to any shared
  pool; per-tenant quotas would close it and are not implemented here). The planner's own
  CPU time grows by nanoseconds per colliding replica of another scope; it is not reported in any
  response and is far below network jitter.
"""

from __future__ import annotations

import enum
import hashlib
import re
import struct
import types
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from quillcache._checks import check_int
from quillcache.index.keys import ResidencyEntry
from quillcache.types import Identity, KvLayout

__all__ = [
    "DEFAULT_REGISTRY_CAPACITY",
    "DIGEST_BYTES",
    "NAME_RE",
    "PUBLIC_TENANT",
    "SALT_RE",
    "TENANT_ID_RE",
    "IdentityRegistry",
    "RequestScope",
    "ReuseReason",
    "ReuseVerdict",
    "SharingPolicy",
    "audit_reuse",
    "make_identity",
    "reuse_reason",
    "validate_identity",
    "validate_salt",
    "validate_tenant_id",
]

DIGEST_BYTES = 16
PUBLIC_TENANT = ""  # the reserved tenant of public scopes; never a request's tenant
TENANT_ID_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
SALT_RE = TENANT_ID_RE
NAME_RE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,256}")
_U64_MAX = (1 << 64) - 1


def _show(value: object) -> str:
    """A short, escaped rendering of a rejected value (never raw control characters)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_token(kind: str, value: object, rx: re.Pattern[str], rule: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{kind} must be str, got {type(value).__name__} {_show(value)}")
    if rx.fullmatch(value) is None:
        raise ValueError(f"{kind}={_show(value)} is malformed; expected {rule}")
    return value


_TOKEN_RULE = "1-128 characters from [A-Za-z0-9._:@-]"
_NAME_RULE = "1-256 characters from [A-Za-z0-9._:@/+=-]"


def validate_tenant_id(tenant: object) -> str:
    """``tenant`` if it follows ``TENANT_ID_RE`` (1-128 of ``[A-Za-z0-9._:@-]``), else an error."""
    return _check_token("tenant", tenant, TENANT_ID_RE, _TOKEN_RULE)


def validate_salt(salt: object) -> str:
    """``salt`` (a cache salt, as in vLLM's ``cache_salt``) if it follows ``SALT_RE``, else an error."""
    return _check_token("salt", salt, SALT_RE, _TOKEN_RULE)


def _check_name(kind: str, value: object, *, allow_empty: bool) -> str:
    if allow_empty and value == "":
        return ""
    return _check_token(kind, value, NAME_RE, _NAME_RULE + (" or empty" if allow_empty else ""))


def validate_identity(identity: object) -> Identity:
    """A request identity, checked field by field (stricter than ``Identity`` itself)."""
    if not isinstance(identity, Identity):
        raise TypeError(f"identity must be a quillcache.types.Identity, got {type(identity).__name__}")
    _check_name("model", identity.model, allow_empty=False)
    _check_name("tokenizer", identity.tokenizer, allow_empty=True)
    _check_name("adapter", identity.adapter, allow_empty=True)
    validate_tenant_id(identity.tenant)
    return identity


def make_identity(
    *, model: str, tenant: str, tokenizer: str = "", adapter: str = "", layout: KvLayout | None = None
) -> Identity:
    """Build a request identity from raw strings (e.g. gateway headers), validating first."""
    _check_name("model", model, allow_empty=False)
    _check_name("tokenizer", tokenizer, allow_empty=True)
    _check_name("adapter", adapter, allow_empty=True)
    validate_tenant_id(tenant)
    if layout is not None and not isinstance(layout, KvLayout):
        raise TypeError(f"layout must be a KvLayout, got {type(layout).__name__}")
    return Identity(model=model, tokenizer=tokenizer, adapter=adapter, tenant=tenant, layout=layout or KvLayout())


def public_identity(identity: Identity) -> Identity:
    """The public scope of ``identity``'s model, tokenizer, adapter and layout."""
    return identity.with_tenant(PUBLIC_TENANT)


# --------------------------------------------------------------------------- sharing policy
def _check_block_hashes(values: Iterable[object]) -> frozenset[int]:
    out = set()
    for v in values:
        out.add(check_int("public block hash", v, 0, _U64_MAX))
    return frozenset(out)


_PREFIX_PERSON = b"qc-public-pfx"


def _prefix_hasher(block_size_tokens: int) -> hashlib.blake2b:
    """The running digest of a token prefix: BLAKE2b-128 over ``le_u32(bs)`` then the tokens as
    little-endian uint32; ``.copy().digest()`` after block ``i`` commits to tokens ``[0, (i+1)*bs)``."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PREFIX_PERSON)
    h.update(struct.pack("<I", block_size_tokens))
    return h


def _le_tokens(tokens: object) -> np.ndarray:
    from quillcache.hashing.blocks import as_token_array

    return np.ascontiguousarray(as_token_array(tokens), dtype="<u4")


def _check_prefixes(value: object) -> dict[int, bytes]:
    if not isinstance(value, Mapping):
        raise TypeError(f"public_prefixes must be a mapping block hash -> 16-byte digest, got {type(value).__name__}")
    out: dict[int, bytes] = {}
    for h, d in value.items():
        h = check_int("public block hash", h, 0, _U64_MAX)
        if not isinstance(d, bytes) or len(d) != DIGEST_BYTES:
            raise ValueError(f"public_prefixes[{h}] must be a {DIGEST_BYTES}-byte digest, got {_show(d)}")
        out[h] = d
    return out


@dataclass(frozen=True, kw_only=True)
class SharingPolicy:
    """Which blocks may cross tenants: only operator-registered public prefixes.

    ``public_blocks``: block hashes whose public-scope replica may be read (e.g. a provider system
    prompt); ``shared_tenants``: tenants allowed to read them (``None`` = every tenant). A public
    block is still scoped to its model, tokenizer, adapter and layout.
    ``public_prefixes``: block hash -> BLAKE2b-128 digest of the registered token prefix through that
    block (``with_public_prompt`` fills it; every key is also in ``public_blocks``). Only these
    blocks are ever WRITTEN under the public scope, and only by a request whose token prefix has
    that digest (:meth:`public_mask`). A hash registered in ``public_blocks`` without a prefix
    digest may be read but is never written by a tenant request: its content cannot be checked.
    """

    public_blocks: frozenset[int] = frozenset()
    shared_tenants: frozenset[str] | None = None
    public_prefixes: Mapping[int, bytes] = field(default_factory=dict, repr=False, hash=False)
    _sorted: np.ndarray = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.public_blocks, (frozenset, set, list, tuple, np.ndarray)):
            raise TypeError(f"public_blocks must be a set of block hashes, got {type(self.public_blocks).__name__}")
        prefixes = _check_prefixes(self.public_prefixes)
        blocks = _check_block_hashes(self.public_blocks) | frozenset(prefixes)
        object.__setattr__(self, "public_blocks", blocks)
        object.__setattr__(self, "public_prefixes", types.MappingProxyType(prefixes))
        if self.shared_tenants is not None:
            if isinstance(self.shared_tenants, str) or not isinstance(self.shared_tenants, Iterable):
                raise TypeError(f"shared_tenants must be a set of tenant ids or None, got {_show(self.shared_tenants)}")
            object.__setattr__(self, "shared_tenants", frozenset(validate_tenant_id(t) for t in self.shared_tenants))
        arr = np.array(sorted(blocks), dtype=np.uint64)
        arr.flags.writeable = False
        object.__setattr__(self, "_sorted", arr)

    def __reduce__(self):
        # the read-only prefix view does not pickle; rebuild from plain values (pickle, copy.deepcopy)
        return (_sharing_policy, (self.public_blocks, self.shared_tenants, dict(self.public_prefixes)))

    @property
    def enabled(self) -> bool:
        return bool(self.public_blocks)

    @property
    def public_sorted(self) -> np.ndarray:
        """The public block hashes as a sorted read-only uint64 array (the kernel's binary search)."""
        return self._sorted

    def shares_with(self, tenant: str) -> bool:
        return self.enabled and (self.shared_tenants is None or tenant in self.shared_tenants)

    def allows(self, tenant: str, block_hash: int) -> bool:
        """May ``tenant`` read the public-scope replica of ``block_hash``?"""
        return self.shares_with(tenant) and int(block_hash) in self.public_blocks

    def public_mask(self, block_hashes: Sequence[int] | np.ndarray, tokens: object,
                    block_size_tokens: int) -> np.ndarray:
        """Per block, True when its hash has a registered prefix digest AND ``tokens[: (i+1)*bs]``
        has that digest (the request's tokens are the registered prompt's through block ``i``);
        the scan stops at the first registered block whose digest differs (every later block is
        False: with digests from ``with_public_prompt`` a longer prefix cannot match either).

        ``tokens`` are the request's prompt token ids (at least ``len(block_hashes) * bs`` of them).
        The digests cost one BLAKE2b pass over the prompt up to its last registered hash, only
        when some block hash is registered.
        """
        n = len(block_hashes)
        out = np.zeros(n, dtype=np.bool_)
        pref = self.public_prefixes
        if not pref or n == 0:
            return out
        bs = check_int("block_size_tokens", block_size_tokens, 1)
        want = [(i, pref.get(int(h))) for i, h in enumerate(block_hashes)]
        want = [(i, d) for i, d in want if d is not None]
        if not want:
            return out
        toks = _le_tokens(tokens)
        if len(toks) < n * bs:
            raise ValueError(f"tokens has {len(toks)} ids, fewer than {n} full blocks of {bs}")
        raw = memoryview(toks).cast("B")
        hasher = _prefix_hasher(bs)
        done = 0  # bytes hashed so far
        for i, d in want:
            end = (i + 1) * bs * 4
            hasher.update(raw[done:end])
            done = end
            if hasher.copy().digest() != d:
                # a longer prefix cannot match either: registration refuses two contents per hash
                break
            out[i] = True
        return out

    def with_public_prompt(
        self, tokens: object, block_size_tokens: int, *, lora: str | None = None, namespace: str | None = None
    ) -> SharingPolicy:
        """A policy that also shares every full block of ``tokens`` (hashed as the planner does),
        keeping a digest of each block's token prefix so that only these tokens are written public.

        Raises ``ValueError`` when a block hash is already registered with different tokens (a hash
        collision between two registered prompts: the public scope can hold one content per hash).
        """
        from quillcache.hashing.blocks import hash_blocks

        hashes = hash_blocks(tokens, block_size_tokens, lora=lora, namespace=namespace)
        if len(hashes) == 0:
            raise ValueError(f"a public prompt needs at least one full block of {block_size_tokens} tokens")
        toks = _le_tokens(tokens)
        raw = memoryview(toks).cast("B")
        hasher = _prefix_hasher(block_size_tokens)
        prefixes = dict(self.public_prefixes)
        step = block_size_tokens * 4
        for i, h in enumerate(hashes.tolist()):
            hasher.update(raw[i * step:(i + 1) * step])
            d = hasher.digest()
            known = prefixes.setdefault(h, d)
            if known != d:
                raise ValueError(f"public block {i} (hash {h:#018x}) is already registered with other tokens; "
                                 "two public prompts collide on this block hash")
        return SharingPolicy(public_blocks=self.public_blocks, shared_tenants=self.shared_tenants,
                             public_prefixes=prefixes)


def _sharing_policy(public_blocks: frozenset[int], shared_tenants: frozenset[str] | None,
                    public_prefixes: dict[int, bytes]) -> SharingPolicy:
    return SharingPolicy(public_blocks=public_blocks, shared_tenants=shared_tenants, public_prefixes=public_prefixes)


# --------------------------------------------------------------------------- verdicts
class ReuseReason(enum.Enum):
    """Why a candidate replica may or may not serve a request (the first two are safe)."""

    SAME_SCOPE = "same-scope"
    SHARED_PUBLIC = "shared-public"
    CROSS_MODEL = "cross-model"
    CROSS_TOKENIZER = "cross-tokenizer"
    CROSS_ADAPTER = "cross-adapter"
    LAYOUT_MISMATCH = "layout-mismatch"
    CROSS_TENANT = "cross-tenant"
    UNKNOWN_IDENTITY = "unknown-identity"

    @property
    def safe(self) -> bool:
        return self in (ReuseReason.SAME_SCOPE, ReuseReason.SHARED_PUBLIC)


UNSAFE_REASONS: tuple[ReuseReason, ...] = tuple(r for r in ReuseReason if not r.safe)


@dataclass(frozen=True, slots=True)
class ReuseVerdict:
    """The audit of one candidate replica: ``reason`` is the first mismatch in the order
    model, tokenizer, adapter, layout, tenant; ``mismatches`` lists every mismatching field."""

    block_hash: int
    candidate: bytes  # the replica's 16-byte identity digest
    reason: ReuseReason
    mismatches: tuple[ReuseReason, ...] = ()

    @property
    def safe(self) -> bool:
        return self.reason.safe


def reuse_reason(request: Identity, candidate: Identity, block_hash: int, policy: SharingPolicy | None = None):
    """(primary reason, every mismatch) for ``candidate``'s replica of ``block_hash`` serving ``request``.

    The plain-Python reference of the guard: safe iff every scope field matches, or the candidate
    is the public scope of the request's model/tokenizer/adapter/layout and the policy shares
    ``block_hash`` with the request's tenant. ``SHARED_PUBLIC`` is safe because public-scope
    replicas are written only from the registered tokens (:meth:`RequestScope.write_digests`);
    a forged collision is written under its writer's scope and audits as ``CROSS_TENANT``.
    """
    mism = []
    if candidate.model != request.model:
        mism.append(ReuseReason.CROSS_MODEL)
    if candidate.tokenizer != request.tokenizer:
        mism.append(ReuseReason.CROSS_TOKENIZER)
    if candidate.adapter != request.adapter:
        mism.append(ReuseReason.CROSS_ADAPTER)
    if candidate.layout != request.layout:
        mism.append(ReuseReason.LAYOUT_MISMATCH)
    if candidate.tenant != request.tenant:
        public_ok = (
            candidate.tenant == PUBLIC_TENANT and policy is not None and policy.allows(request.tenant, block_hash)
        )
        if not public_ok:
            mism.append(ReuseReason.CROSS_TENANT)
        elif not mism:
            return ReuseReason.SHARED_PUBLIC, ()
    if not mism:
        return ReuseReason.SAME_SCOPE, ()
    return mism[0], tuple(mism)


DEFAULT_REGISTRY_CAPACITY = 1 << 16


class IdentityRegistry:
    """digest -> Identity (so audits can name reasons) and the per-identity scope cache, both bounded.

    Every scope handed out is registered here together with its public scope. Both maps are LRU:
    at most ``capacity`` scopes are cached and at most ``2 * capacity`` digests remembered (a scope
    and its public scope are refreshed together on every :meth:`scope` call, so unless
    :meth:`register` is also called directly, the identities of the ``capacity`` most recently used
    request scopes and of their public scopes are known). An identity seen again after its eviction
    is validated and registered again on demand. Memory is therefore bounded whatever the
    number of distinct identities (e.g. one per client ``cache_salt`` at the gateway).

    What eviction never changes: the guard (a :class:`RequestScope`'s ``allowed`` rows are computed
    from the identity alone, so a re-built scope is equal) and the audit's safe/unsafe verdicts
    (:func:`audit_reuse` derives the request's own and public digests itself, and only those can be
    safe). What it may change: an UNSAFE candidate written under an identity forgotten since is
    reported ``UNKNOWN_IDENTITY`` instead of its ``CROSS_*`` reason. ``capacity=None``: unbounded.
    """

    def __init__(self, policy: SharingPolicy | None = None, *,
                 capacity: int | None = DEFAULT_REGISTRY_CAPACITY) -> None:
        if policy is not None and not isinstance(policy, SharingPolicy):
            raise TypeError(f"policy must be a SharingPolicy, got {type(policy).__name__}")
        if capacity is not None:
            check_int("IdentityRegistry capacity", capacity, 1)
        self.policy = policy or SharingPolicy()
        self.capacity = capacity
        self._max_digests = None if capacity is None else 2 * capacity
        self._by_digest: OrderedDict[bytes, Identity] = OrderedDict()
        # identity -> (scope, digest of its public identity, registered whether or not it is shared)
        self._scopes: OrderedDict[Identity, tuple[RequestScope, bytes]] = OrderedDict()

    def register(self, identity: Identity) -> bytes:
        """Record ``identity`` (any scope, public ones included) as most recently used; its digest."""
        if not isinstance(identity, Identity):
            raise TypeError(f"identity must be an Identity, got {type(identity).__name__}")
        d = identity.digest()
        known = self._by_digest.setdefault(d, identity)
        if known != identity:  # a 128-bit BLAKE2b collision: refuse rather than mislabel
            raise ValueError(f"identity digest collision between {known} and {identity}")
        self._by_digest.move_to_end(d)
        if self._max_digests is not None and len(self._by_digest) > self._max_digests:
            self._by_digest.popitem(last=False)
        return d

    def identity_of(self, digest: bytes) -> Identity | None:
        return self._by_digest.get(bytes(digest))

    def __len__(self) -> int:
        return len(self._by_digest)

    def scope(self, identity: Identity) -> RequestScope:
        """The (cached) read/write scope of a request identity; validates it first."""
        hit = self._scopes.get(identity)
        if hit is not None:
            sc, pub = hit
            self._scopes.move_to_end(identity)
            by_digest = self._by_digest
            if pub in by_digest:
                by_digest.move_to_end(pub)
            else:  # forgotten meanwhile (other identities registered since): known again
                self.register(public_identity(identity))
            if sc.digest in by_digest:
                by_digest.move_to_end(sc.digest)
            else:
                self.register(identity)
            return sc
        validate_identity(identity)
        pub_id = public_identity(identity)
        pub = self.register(pub_id)
        own = self.register(identity)
        shares = self.policy.shares_with(identity.tenant)
        rows = [own, pub] if shares else [own]
        allowed = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), DIGEST_BYTES).copy()
        allowed.flags.writeable = False
        sc = RequestScope(
            identity=identity,
            digest=own,
            public_digest=pub if shares else None,
            allowed=allowed,
            public_slot=1 if shares else -1,
            policy=self.policy,
        )
        self._scopes[identity] = (sc, pub)
        if self.capacity is not None and len(self._scopes) > self.capacity:
            self._scopes.popitem(last=False)
        return sc


@dataclass(frozen=True, slots=True, eq=False)
class RequestScope:
    """What one request identity may read (``allowed`` digests) and write (``write_digests``).

    Invariant: a request writes only scopes it may read - its own, and the public scope only when
    the policy shares with its tenant (``public_digest`` is not None)."""

    identity: Identity
    digest: bytes
    public_digest: bytes | None  # readable public scope, None when the policy does not share
    allowed: np.ndarray  # (k, 16) uint8, read-only: row 0 own digest, row 1 public (if shared)
    public_slot: int  # row of the public digest in ``allowed``, -1 if none
    policy: SharingPolicy

    def write_digests(self, block_hashes: Sequence[int] | np.ndarray, tokens: object = None) -> list[bytes]:
        """Per block, the scope its KV is recorded under.

        The public scope for exactly the blocks where (a) this tenant may read the public scope and
        (b) ``tokens`` (the request's prompt token ids) are the registered public prompt's tokens
        through that block (:meth:`SharingPolicy.public_mask`); the request's own scope for every
        other block. Without ``tokens`` nothing can be checked, so every block is written under the
        own scope. Hence nothing private is ever written public, a forged hash collision with a
        public prompt lands only in its writer's scope, and a tenant the policy excludes keeps (and
        can reuse) its own copy of a public prompt.
        """
        n = len(block_hashes)
        if self.public_digest is None or tokens is None or not self.policy.public_prefixes:
            return [self.digest] * n
        mask = self.policy.public_mask(block_hashes, tokens, self.identity.layout.block_size_tokens)
        return [self.public_digest if m else self.digest for m in mask.tolist()]


Candidate = ResidencyEntry | tuple[int, Identity | bytes]


def audit_reuse(
    request_identity: Identity,
    candidates: Iterable[Candidate],
    *,
    registry: IdentityRegistry | None = None,
    policy: SharingPolicy | None = None,
) -> list[ReuseVerdict]:
    """Per candidate replica, safe or unsafe with the reason (the audit path; builds reasons).

    ``candidates``: ``ResidencyEntry`` objects (identity digests, decoded through ``registry``) or
    ``(block_hash, Identity | digest)`` pairs. A digest the registry does not know is unsafe
    (``UNKNOWN_IDENTITY``): the audit never assumes. The request's own and public digests are
    decoded from ``request_identity`` itself, registered or not: those are the only candidates that
    can be safe, so a verdict's safety never depends on what a (bounded) registry still remembers.
    ``policy`` defaults to the registry's.
    """
    validate_identity(request_identity)
    if policy is None:
        policy = registry.policy if registry is not None else SharingPolicy()
    own = request_identity.digest()
    pub_identity = public_identity(request_identity)
    known = {own: request_identity, pub_identity.digest(): pub_identity}
    out: list[ReuseVerdict] = []
    for c in candidates:
        if isinstance(c, ResidencyEntry):
            h, cand = c.block_hash, c.identity
        elif isinstance(c, tuple) and len(c) == 2:
            h, cand = c
        else:
            raise TypeError(f"a candidate is a ResidencyEntry or (block_hash, identity), got {_show(c)}")
        if isinstance(cand, Identity):
            ident: Identity | None = cand
            digest = cand.digest()
        elif isinstance(cand, (bytes, bytearray)) and len(cand) == DIGEST_BYTES:
            digest = bytes(cand)
            ident = known.get(digest) or (registry.identity_of(digest) if registry else None)
        else:
            raise TypeError(f"candidate identity must be an Identity or a 16-byte digest, got {_show(cand)}")
        if ident is None:
            out.append(ReuseVerdict(int(h), digest, ReuseReason.UNKNOWN_IDENTITY, (ReuseReason.UNKNOWN_IDENTITY,)))
            continue
        reason, mism = reuse_reason(request_identity, ident, int(h), policy)
        out.append(ReuseVerdict(int(h), digest, reason, mism))
    return out
