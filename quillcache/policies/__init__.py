"""Eviction/admission policies by name: ``POLICIES`` (a ``Registry``, name → class) and ``make_policy``.

Every policy implements :class:`quillcache.policies.base.EvictionPolicy`; the data plane builds
one instance per tier by name, and trace-replay studies build them the same way. Registered:
``lru``, ``lfu`` (LRU tie-break), ``fifo``, ``s3fifo``, ``lengthaware`` (Mooncake's length-aware
cache, as read from the FAST'25 paper), ``tinylfu`` (W-TinyLFU admission over an SLRU), ``quillhd``
(ours: learned hit density per prefix-structure class) and ``belady`` (the offline optimum; needs a
next-use oracle from a trace replay). A new policy is one module and one line here; the hit-rate
study (``quillcache.hitrate``) reads this same registry and adds only its kernels.
"""

from __future__ import annotations

from quillcache.policies.base import (
    EvictionPolicy,
    PolicyKeyError,
    UnknownKeyError,
    always,
)
from quillcache.policies.belady import BeladyPolicy
from quillcache.policies.fifo import FifoPolicy
from quillcache.policies.lengthaware import LengthAwarePolicy
from quillcache.policies.lfu import LfuPolicy
from quillcache.policies.lru import LruPolicy
from quillcache.policies.quillhd import QuillHdPolicy
from quillcache.policies.s3fifo import S3FifoPolicy
from quillcache.policies.tinylfu import TinyLfuPolicy
from quillcache.registry import Registry

POLICIES: Registry[type[EvictionPolicy]] = Registry("eviction policy")
for _cls in (LruPolicy, LfuPolicy, FifoPolicy, S3FifoPolicy, LengthAwarePolicy, TinyLfuPolicy, QuillHdPolicy,
             BeladyPolicy):
    POLICIES.register(_cls.name, _cls)
del _cls


def make_policy(name: str, **options) -> EvictionPolicy:
    """A new policy of a registered kind; ``options`` go to its constructor.

    ValueError names an unknown policy and lists the registered ones; TypeError names a non-str
    name or an option the policy does not take."""
    return POLICIES.create(name, **options)  # type: ignore[return-value]


__all__ = [
    "POLICIES",
    "BeladyPolicy",
    "EvictionPolicy",
    "FifoPolicy",
    "LengthAwarePolicy",
    "LfuPolicy",
    "LruPolicy",
    "PolicyKeyError",
    "QuillHdPolicy",
    "S3FifoPolicy",
    "TinyLfuPolicy",
    "UnknownKeyError",
    "always",
    "make_policy",
]
