"""The OpenAI-compatible gateway: a streaming proxy that routes each request with the real planner.

Modules, one concept each: :mod:`.config` (engines, models, limits, timeouts), :mod:`.tenants` (API key ->
tenant, per-scope cache salt, concurrency), :mod:`.residency` (engine prefix state in the index: speculative
entries confirmed by vLLM KV events, or the gateway's approximate record), :mod:`.decision` (identity scope ->
hashes -> planner -> admitted lease), :mod:`.upstream` (the upstream client interface, its
failure classes, the aiohttp client), :mod:`.native_upstream` (the default client: asyncio + httptools, a
keep-alive pool), :mod:`.clients` (``UPSTREAM_CLIENTS``, the clients by name), :mod:`.metrics`
(prometheus), :mod:`.app` (the Starlette application), :mod:`.server` (``serve`` and ``GatewayProcess``).
Heavy imports (Starlette, aiohttp, httptools) happen in those modules, not here.
"""

from quillcache.gateway.config import (
    ConfigError,
    EngineConfig,
    GatewayConfig,
    LimitsConfig,
    ModelConfig,
    RetryConfig,
    TimeoutsConfig,
    load_config,
)

__all__ = [
    "ConfigError",
    "EngineConfig",
    "GatewayConfig",
    "LimitsConfig",
    "ModelConfig",
    "RetryConfig",
    "TimeoutsConfig",
    "load_config",
]
