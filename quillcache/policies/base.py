"""The ``EvictionPolicy`` seam: which tracked key to evict next, and whether to admit a new one.

A policy only orders keys; it owns no bytes and knows nothing of tiers. The caller (a tier of
the data plane, or a trace-replay harness) drives it with these calls:

- ``admit(key, size_bytes) -> bool`` before storing a new key (default: always True; admission
  filters such as TinyLFU refuse here);
- ``insert(key, size_bytes)`` once the key is stored; ``touch(key)`` on every hit;
- ``victim(is_evictable) -> key | None``: the key the policy would evict next, skipping keys the
  predicate refuses (pinned, leased, already chosen...). It does NOT remove the key: the caller
  evicts it and then calls ``evict(key)``; if the caller changes its mind it just does nothing.
  ``victim`` may reorganize the policy's own queues on the way (S3-FIFO's lazy promotion, CLOCK
  hands), never its membership;
- ``evict(key)`` after the caller evicted a key under pressure (policies with history, e.g.
  S3-FIFO's ghost queue, remember it); ``remove(key)`` when a key leaves for any other reason
  (explicit delete, moved to another tier) and must leave no history.

Invariants every policy keeps (checked by tests/test_policies.py against plain-Python models):
- membership is exactly the set of keys inserted and not yet removed/evicted; ``len`` counts them
  and ``tracked_bytes`` sums their sizes;
- ``victim`` returns a tracked key for which the predicate is True, or None when there is none
  (it calls the predicate at most a bounded number of times per tracked key);
- the eviction order (the sequence of victims under a fixed sequence of calls) is deterministic:
  it is part of each policy's contract and tested exactly.

Errors: ``insert`` of a tracked key raises ``PolicyKeyError`` (a ValueError); ``touch``,
``remove`` and ``evict`` of an untracked key raise ``UnknownKeyError`` (a KeyError); a size that
is not a positive integer raises TypeError/ValueError naming it.

To add a policy: subclass ``EvictionPolicy``, give it a unique ``name``, take its options as
keyword arguments with defaults, and register it in ``quillcache.policies.POLICIES``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Hashable, Iterator
from typing import ClassVar

from quillcache._checks import check_int

Key = Hashable
Predicate = Callable[[Key], bool]

# the largest KV block (tokens) a policy's ``block_tokens`` option may name: the trace schema's and
# KvLayout's limit (quillcache.traces.schemas.MAX_BLOCK_TOKENS, tested equal); it keeps every
# product of a block size with a token or reference count inside the hit-rate kernels' int64
MAX_BLOCK_TOKENS = 65_536


class PolicyKeyError(ValueError):
    """A key inserted twice."""


class UnknownKeyError(KeyError):
    """A key the policy does not track."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown key"


def always(_key: Key) -> bool:
    """The predicate that refuses nothing."""
    return True


def check_size(size_bytes: object) -> int:
    """``size_bytes`` as a positive int, or TypeError/ValueError naming it."""
    return check_int("size_bytes", size_bytes, 1)


class EvictionPolicy(abc.ABC):
    """Orders tracked keys for eviction (see the module docstring for the calling protocol)."""

    name: ClassVar[str] = "abstract"

    def __init__(self) -> None:
        self._sizes: dict[Key, int] = {}
        self._tracked_bytes = 0

    # ---- bookkeeping shared by every policy -----------------------------------------------
    def _add(self, key: Key, size_bytes: object) -> int:
        size = check_size(size_bytes)
        if key in self._sizes:
            raise PolicyKeyError(f"{self.name}: key {key!r} is already tracked")
        self._sizes[key] = size
        self._tracked_bytes += size
        return size

    def _drop(self, key: Key) -> int:
        size = self._sizes.pop(key, None)
        if size is None:
            raise UnknownKeyError(f"{self.name}: key {key!r} is not tracked")
        self._tracked_bytes -= size
        return size

    def _require(self, key: Key) -> None:
        if key not in self._sizes:
            raise UnknownKeyError(f"{self.name}: key {key!r} is not tracked")

    # ---- the protocol ---------------------------------------------------------------------
    def admit(self, key: Key, size_bytes: int) -> bool:
        """Whether a new key should be stored at all (default: always)."""
        check_size(size_bytes)
        return True

    @abc.abstractmethod
    def insert(self, key: Key, size_bytes: int) -> None:
        """Start tracking a newly stored key."""

    @abc.abstractmethod
    def touch(self, key: Key) -> None:
        """Record a hit on a tracked key."""

    @abc.abstractmethod
    def remove(self, key: Key) -> None:
        """Stop tracking a key that left for a reason other than eviction (no history kept)."""

    def evict(self, key: Key) -> None:
        """Stop tracking a key the caller evicted under pressure (default: same as remove)."""
        self.remove(key)

    @abc.abstractmethod
    def victim(self, is_evictable: Predicate = always) -> Key | None:
        """The next key to evict among those ``is_evictable`` accepts, without removing it."""

    # ---- introspection --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._sizes))

    @property
    def tracked_bytes(self) -> int:
        return self._tracked_bytes

    def size_of(self, key: Key) -> int:
        self._require(key)
        return self._sizes[key]

    def eviction_order(self, is_evictable: Predicate = always) -> list[Key]:
        """Evict every evictable key in victim order and return that order. It evicts for real
        (``victim`` + ``evict`` until None): for tests and throwaway copies of a policy."""
        out: list[Key] = []
        while (k := self.victim(is_evictable)) is not None:
            self.evict(k)
            out.append(k)
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} keys, {self._tracked_bytes} bytes)"
