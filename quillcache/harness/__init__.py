"""Trace harness: replay a request trace through the real router, planner, store tiers and index.

``replay(requests, ReplayConfig(...)) -> ReplayResult`` (:mod:`.replay`) drives
:class:`quillcache.planner.Planner`, one :class:`quillcache.store.StoreDataPlane` per engine node
and a shared residency index, with an :class:`.engine_model.EngineModel` standing in for the GPU
engines' compute (a model of the engine, not the engine). Metrics: :mod:`.metrics`.
"""

from quillcache.harness.config import ReplayConfig
from quillcache.harness.engine_model import GPU_MEMORY, EngineModel
from quillcache.harness.metrics import ReplaySummary, RequestRow, summarize
from quillcache.harness.replay import ReplayResult, replay

__all__ = ["GPU_MEMORY", "EngineModel", "ReplayConfig", "ReplayResult", "ReplaySummary", "RequestRow",
           "replay", "summarize"]
