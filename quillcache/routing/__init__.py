"""Routers, registered by name: ``make_router(name, **opts)``.

``ROUTERS``: ``dynamo`` (:class:`DynamoCostRouter`, the default), and the baselines
``round_robin``, ``least_loaded`` and ``prefix_affinity``. An unknown name, or an option the
router does not take, raises an error naming what was wrong and what is registered.
"""

from __future__ import annotations

from quillcache.registry import Registry
from quillcache.routing.base import (
    EngineRole,
    Lease,
    LoadTracker,
    Router,
    RouteRequest,
    WorkerSpec,
)
from quillcache.routing.baselines import (
    LeastLoadedRouter,
    PrefixAffinityRouter,
    RoundRobinRouter,
)
from quillcache.routing.cache_aware import CacheAwareRouter
from quillcache.routing.dynamo import DynamoCostRouter

ROUTERS: Registry[type[Router]] = Registry("router")
ROUTERS.register("cache_aware", CacheAwareRouter)
ROUTERS.register("dynamo", DynamoCostRouter)
ROUTERS.register("least_loaded", LeastLoadedRouter)
ROUTERS.register("prefix_affinity", PrefixAffinityRouter)
ROUTERS.register("round_robin", RoundRobinRouter)


def make_router(name: str, **opts) -> Router:
    """A router of a registered kind; ``opts`` go to its constructor (e.g. ``temperature``, ``seed``)."""
    return ROUTERS.create(name, **opts)  # type: ignore[return-value]


__all__ = [
    "ROUTERS",
    "CacheAwareRouter",
    "DynamoCostRouter",
    "EngineRole",
    "Lease",
    "LeastLoadedRouter",
    "LoadTracker",
    "PrefixAffinityRouter",
    "RoundRobinRouter",
    "RouteRequest",
    "Router",
    "WorkerSpec",
    "make_router",
]
