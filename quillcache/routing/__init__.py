"""Routers, registered by name: ``make_router(name, **opts)``.

``ROUTERS``: ``dynamo`` (:class:`DynamoCostRouter`, the default), and the baselines
``round_robin``, ``least_loaded`` and ``prefix_affinity``. An unknown name, or an option the
router does not take, raises an error naming what was wrong and what is registered.
"""

from __future__ import annotations

import inspect

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
from quillcache.routing.dynamo import DynamoCostRouter

ROUTERS: dict[str, type[Router]] = {
    "dynamo": DynamoCostRouter,
    "least_loaded": LeastLoadedRouter,
    "prefix_affinity": PrefixAffinityRouter,
    "round_robin": RoundRobinRouter,
}


def make_router(name: str, **opts) -> Router:
    """A router of a registered kind; ``opts`` go to its constructor (e.g. ``temperature``, ``seed``)."""
    if not isinstance(name, str):
        raise TypeError(f"router name must be a str, got {type(name).__name__}")
    cls = ROUTERS.get(name)
    if cls is None:
        raise ValueError(f"unknown router {name!r}; registered: {sorted(ROUTERS)}")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise TypeError(f"router {name!r} takes no option(s) {unknown}; it accepts {accepted}")
    return cls(**opts)


__all__ = [
    "ROUTERS",
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
