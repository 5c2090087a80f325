"""Residency index: where does each block live?

``open_index(kind, path=None, **options)`` opens a backend registered by name in
``INDEX_BACKENDS``: ``flat`` (dict baseline), ``sorted`` (SortedDict baseline), ``rocksdb`` (LSM via rocksdict) and, once built,
``art`` (persistent adaptive radix tree). All share the seam of :class:`IndexBackend` and the key
layout of :mod:`quillcache.index.keys`.
"""

from __future__ import annotations

from pathlib import Path

from quillcache.index.base import IndexBackend, IndexClosedError, NotAnIndexError
from quillcache.index.keys import IndexKeyError, ReplicaKey, ResidencyEntry
from quillcache.registry import Registry

# name -> backend class, imported on first use so a missing optional dependency only hurts its backend.
INDEX_BACKENDS: Registry[type[IndexBackend]] = Registry("index backend")
INDEX_BACKENDS.register_lazy("art", "quillcache.index.art_index:ArtIndex")
INDEX_BACKENDS.register_lazy("flat", "quillcache.index.flat:FlatIndex")
INDEX_BACKENDS.register_lazy("rocksdb", "quillcache.index.rocksdb:RocksDbIndex")
INDEX_BACKENDS.register_lazy("sorted", "quillcache.index.sorted_map:SortedIndex")


def open_index(kind: str, path: str | Path | None = None, **options) -> IndexBackend:
    """Open (or create) an index of a registered kind at ``path`` (None = in memory where supported)."""
    return INDEX_BACKENDS[kind](path, **options)


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
