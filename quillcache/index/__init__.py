"""Residency index: where does each block live?

``open_index(kind, path=None, **options)`` opens a backend registered by name in
``INDEX_BACKENDS``: ``flat`` (dict baseline), ``sorted`` (SortedDict baseline), ``rocksdb`` (LSM via rocksdict) and, once built,
``art`` (persistent adaptive radix tree). All share the seam of :class:`IndexBackend` and the key
layout of :mod:`quillcache.index.keys`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from quillcache.index.base import IndexBackend, IndexClosedError, NotAnIndexError
from quillcache.index.keys import IndexKeyError, ReplicaKey, ResidencyEntry

# name -> "module:Class"; imported lazily so a missing optional dependency only hurts its backend.
INDEX_BACKENDS: dict[str, str] = {
    "art": "quillcache.index.art_index:ArtIndex",
    "flat": "quillcache.index.flat:FlatIndex",
    "rocksdb": "quillcache.index.rocksdb:RocksDbIndex",
    "sorted": "quillcache.index.sorted_map:SortedIndex",
}


def open_index(kind: str, path: str | Path | None = None, **options) -> IndexBackend:
    """Open (or create) an index of a registered kind at ``path`` (None = in memory where supported)."""
    target = INDEX_BACKENDS.get(kind)
    if target is None:
        raise ValueError(f"unknown index backend {kind!r}; registered: {sorted(INDEX_BACKENDS)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(path, **options)


__all__ = [
    "INDEX_BACKENDS",
    "IndexBackend",
    "IndexClosedError",
    "IndexKeyError",
    "NotAnIndexError",
    "ReplicaKey",
    "ResidencyEntry",
    "open_index",
]
