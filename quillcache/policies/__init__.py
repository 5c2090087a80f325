"""Eviction/admission policy registry: ``POLICIES`` (name → class) and ``make_policy``.

Every policy implements :class:`quillcache.policies.base.EvictionPolicy`; the data plane builds
one instance per tier by name, and trace-replay studies build them the same way. Registered:
``lru``, ``lfu`` (LRU tie-break), ``fifo``, ``s3fifo``, ``lengthaware`` (Mooncake's length-aware
cache, as read from the FAST'25 paper), ``tinylfu`` (W-TinyLFU admission over an SLRU), ``quillhd``
(ours: learned hit density per prefix-structure class) and ``belady`` (the offline optimum; needs a
next-use oracle from a trace replay). A new policy is one module and one line here.
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

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (LruPolicy, LfuPolicy, FifoPolicy, S3FifoPolicy, LengthAwarePolicy, TinyLfuPolicy, QuillHdPolicy,
                BeladyPolicy)
}


def make_policy(name: str, **options) -> EvictionPolicy:
    """A new policy of a registered kind; ``options`` go to its constructor.

    ValueError names an unknown policy and lists the registered ones; TypeError names an option
    the policy does not take."""
    if not isinstance(name, str):
        raise TypeError(f"policy name must be str, got {type(name).__name__} {name!r}")
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction policy {name!r}; registered: {sorted(POLICIES)}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise TypeError(f"policy {name!r} rejected options {sorted(options)}: {exc}") from None


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
