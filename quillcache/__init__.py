"""QuillCache: a KV-cache pool and cache-aware control plane for LLM serving.

Public entry points live in small modules, one concept each:
``quillcache.types`` (identities and ids), ``quillcache.hashing.blocks`` (block hashes),
``quillcache.alloc`` (offset allocator), ``quillcache.sketch.countmin`` (count-min sketch),
``quillcache.results`` (the results convention).
"""

from quillcache.types import BlockHash, CacheTier, Identity, KvLayout, NodeId, SegmentId

__version__ = "0.1.0"

__all__ = ["BlockHash", "CacheTier", "Identity", "KvLayout", "NodeId", "SegmentId", "__version__"]
