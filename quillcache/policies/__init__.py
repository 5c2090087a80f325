"""Eviction/admission policies by name: ``POLICIES`` (a ``Registry``, name → class) and ``make_policy``.

Every policy implements :class:`quillcache.policies.base.EvictionPolicy`; the data plane builds
one instance per tier by name, and trace-replay studies build them the same way. Registered:
``lru``, ``lfu`` (LRU tie-break), ``fifo``, ``s3fifo``, ``lengthaware`` (Mooncake's length-aware
cache, as read from the FAST'25 paper), ``tinylfu`` (W-TinyLFU admission over an SLRU), ``sieve``
(NSDI '24), ``arc`` (FAST '03), ``2q`` (VLDB '94), ``lhd`` (NSDI '18), ``lrb`` (a learned next-use
predictor in the spirit of LRB, NSDI '20), ``quillhd`` and ``quillchain`` (ours: learned hit
density per prefix-structure class), ``belady`` (the offline optimum; needs a next-use oracle
from a trace replay) and ``lookahead`` (SEMI-ONLINE: LRU that sees the requests queued at the
engine; reported apart from online policies). A new policy is one module and one line here; the hit-rate
study (``quillcache.hitrate``) reads this same registry and adds only its kernels.
"""

from __future__ import annotations

from quillcache.policies.base import (
    EvictionPolicy,
    PolicyKeyError,
    UnknownKeyError,
    always,
)
from quillcache.policies.arc import ArcPolicy
from quillcache.policies.belady import BeladyPolicy
from quillcache.policies.fifo import FifoPolicy
from quillcache.policies.lengthaware import LengthAwarePolicy
from quillcache.policies.lfu import LfuPolicy
from quillcache.policies.lookahead import LookaheadPolicy
from quillcache.policies.lhd import LhdPolicy
from quillcache.policies.lrb import LrbPolicy
from quillcache.policies.lru import LruPolicy
from quillcache.policies.quillchain import QuillChainPolicy
from quillcache.policies.quillhd import QuillHdPolicy
from quillcache.policies.s3fifo import S3FifoPolicy
from quillcache.policies.sieve import SievePolicy
from quillcache.policies.tinylfu import TinyLfuPolicy
from quillcache.policies.twoq import TwoQPolicy
from quillcache.registry import Registry

POLICIES: Registry[type[EvictionPolicy]] = Registry("eviction policy")
for _cls in (LruPolicy, LfuPolicy, FifoPolicy, S3FifoPolicy, LengthAwarePolicy, TinyLfuPolicy, QuillHdPolicy,
             BeladyPolicy, SievePolicy, ArcPolicy, TwoQPolicy, LhdPolicy, LrbPolicy, QuillChainPolicy, LookaheadPolicy):
    POLICIES.register(_cls.name, _cls)
del _cls


def make_policy(name: str, **options) -> EvictionPolicy:
    """A new policy of a registered kind; ``options`` go to its constructor.

    ValueError names an unknown policy and lists the registered ones; TypeError names a non-str
    name or an option the policy does not take."""
    return POLICIES.create(name, **options)  # type: ignore[return-value]


__all__ = [
    "POLICIES",
    "ArcPolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "FifoPolicy",
    "LengthAwarePolicy",
    "LfuPolicy",
    "LhdPolicy",
    "LookaheadPolicy",
    "LrbPolicy",
    "LruPolicy",
    "PolicyKeyError",
    "QuillChainPolicy",
    "QuillHdPolicy",
    "S3FifoPolicy",
    "SievePolicy",
    "TinyLfuPolicy",
    "TwoQPolicy",
    "UnknownKeyError",
    "always",
    "make_policy",
]
