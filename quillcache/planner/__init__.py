"""The control plane: per request, locate its blocks, guard, route, and emit per-block actions.

``Planner(index, workers, router="dynamo", registry=IdentityRegistry(policy), config=PlannerConfig())``;
``planner.plan(planner.request(identity, tokens)) -> Plan``. Plain-Python specification:
:class:`ReferencePlanner`. Costs: :class:`CostModel` over the cited profiles of :mod:`.profiles`.
"""

from quillcache.planner.cost_model import SOURCE_NAMES, CostModel
from quillcache.planner.plan import BlockAction, Plan, PlanRequest, TimingClass
from quillcache.planner.planner import Planner, PlannerConfig
from quillcache.planner.profiles import (
    GPUS,
    LINKS,
    MODELS,
    GpuProfile,
    LinkProfile,
    ModelProfile,
)
from quillcache.planner.reference import ReferencePlanner
from quillcache.routing.base import EngineRole, WorkerSpec

__all__ = [
    "GPUS",
    "LINKS",
    "MODELS",
    "SOURCE_NAMES",
    "BlockAction",
    "CostModel",
    "EngineRole",
    "GpuProfile",
    "LinkProfile",
    "ModelProfile",
    "Plan",
    "PlanRequest",
    "Planner",
    "PlannerConfig",
    "ReferencePlanner",
    "TimingClass",
    "WorkerSpec",
]
