"""LFU with LRU tie-break: evict the key with the fewest hits; among equals, the least recent.

A key's frequency is 1 at insert and +1 per ``touch``; it is forgotten when the key leaves (in-cache
LFU, no aging). "Least recent" means the key that reached its current frequency first, i.e. whose
last insert/touch is oldest.

Structure (O(1) insert/touch/remove, the constant-time LFU of Shah, Mitra and Matani 2010): a
doubly linked list of frequency buckets in increasing frequency order; each bucket holds its keys
in an ``OrderedDict`` from least to most recently arrived. ``touch`` moves a key from bucket f to
bucket f+1 (created right after f if absent; empty buckets are unlinked at once). ``victim`` walks
buckets from the lowest frequency and, within one, from the least recent key, returning the first
key the predicate accepts.

Invariants: every bucket in the list is non-empty; bucket frequencies strictly increase along the
list; ``_bucket_of[key]`` is the bucket holding ``key``.
"""

from __future__ import annotations

from collections import OrderedDict

from quillcache.policies.base import EvictionPolicy, Key, Predicate, always


class _Bucket:
    __slots__ = ("freq", "keys", "next", "prev")

    def __init__(self, freq: int) -> None:
        self.freq = freq
        self.keys: OrderedDict[Key, None] = OrderedDict()
        self.prev: _Bucket | None = None
        self.next: _Bucket | None = None


class LfuPolicy(EvictionPolicy):
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._head: _Bucket | None = None  # lowest frequency
        self._bucket_of: dict[Key, _Bucket] = {}

    # ---- bucket list ----------------------------------------------------------------------
    def _link_after(self, prev: _Bucket | None, freq: int) -> _Bucket:
        b = _Bucket(freq)
        if prev is None:
            b.next = self._head
            if self._head is not None:
                self._head.prev = b
            self._head = b
        else:
            b.prev, b.next = prev, prev.next
            if prev.next is not None:
                prev.next.prev = b
            prev.next = b
        return b

    def _unlink_if_empty(self, b: _Bucket) -> None:
        if b.keys:
            return
        if b.prev is None:
            self._head = b.next
        else:
            b.prev.next = b.next
        if b.next is not None:
            b.next.prev = b.prev

    # ---- protocol -------------------------------------------------------------------------
    def insert(self, key: Key, size_bytes: int) -> None:
        self._add(key, size_bytes)
        b = self._head if self._head is not None and self._head.freq == 1 else self._link_after(None, 1)
        b.keys[key] = None
        self._bucket_of[key] = b

    def touch(self, key: Key) -> None:
        self._require(key)
        b = self._bucket_of[key]
        nxt = b.next
        if nxt is None or nxt.freq != b.freq + 1:
            nxt = self._link_after(b, b.freq + 1)
        del b.keys[key]
        nxt.keys[key] = None
        self._bucket_of[key] = nxt
        self._unlink_if_empty(b)

    def remove(self, key: Key) -> None:
        self._drop(key)
        b = self._bucket_of.pop(key)
        del b.keys[key]
        self._unlink_if_empty(b)

    def victim(self, is_evictable: Predicate = always) -> Key | None:
        b = self._head
        while b is not None:
            for key in b.keys:
                if is_evictable(key):
                    return key
            b = b.next
        return None

    def frequency(self, key: Key) -> int:
        self._require(key)
        return self._bucket_of[key].freq
