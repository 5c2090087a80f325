"""QuillCache: a KV-cache pool and cache-aware control plane for LLM serving.

The names a researcher reaches for first are importable from here; each is loaded on first
access (PEP 562), so ``import quillcache`` stays cheap and pulls in no compiled core, and no
subpackage imports this module's namespace (the package has no import cycle; a test checks it).

- identities and ids: ``Identity``, ``KvLayout``, ``CacheTier``, ``make_identity``
- block hashing: ``hash_blocks``, ``hash_blocks_batch``
- traces: ``load_trace``, ``default_trace_path``
- components by registered name: ``make_policy``, ``make_router``, ``open_index``
- the store: ``LocalKvStore``, ``SsdTier``, ``StoreDataPlane``
- the control plane: ``Planner``, ``PlanRequest``
- the harness: ``replay``, ``ReplayConfig``
- hit rates: ``simulate``, ``sweep`` (a policy x capacity DataFrame)
- results: ``list_studies``, ``read_summary``, ``read_raw``, ``read_anchors`` (tidy DataFrames)

Subpackages, one concept each: ``hashing``, ``alloc``, ``sketch``, ``art``, ``durability`` (one WAL
over one file-system interface), ``index``, ``store``, ``policies``, ``routing``, ``planner``,
``identity``, ``traces``, ``hitrate``, ``harness``, ``cli``.
"""

from __future__ import annotations

import importlib

from quillcache.types import BlockHash, CacheTier, Identity, KvLayout, NodeId, SegmentId

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "make_identity": "quillcache.identity.scope",
    "hash_blocks": "quillcache.hashing.blocks",
    "hash_blocks_batch": "quillcache.hashing.blocks",
    "load_trace": "quillcache.traces.loader",
    "default_trace_path": "quillcache.traces.loader",
    "make_policy": "quillcache.policies",
    "make_router": "quillcache.routing",
    "open_index": "quillcache.index",
    "LocalKvStore": "quillcache.store.dram",
    "SsdTier": "quillcache.store.ssd",
    "StoreDataPlane": "quillcache.store.dataplane",
    "Planner": "quillcache.planner.planner",
    "PlanRequest": "quillcache.planner.plan",
    "replay": "quillcache.harness.replay",
    "ReplayConfig": "quillcache.harness.config",
    "simulate": "quillcache.hitrate",
    "sweep": "quillcache.hitrate.sweep",
    "list_studies": "quillcache.results.reader",
    "read_summary": "quillcache.results.reader",
    "read_raw": "quillcache.results.reader",
    "read_anchors": "quillcache.results.reader",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'quillcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["BlockHash", "CacheTier", "Identity", "KvLayout", "NodeId", "SegmentId", "__version__", *_LAZY]
