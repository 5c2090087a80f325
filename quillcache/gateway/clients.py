"""``UPSTREAM_CLIENTS``: the gateway's upstream client implementations by name (``upstream_client`` in
the gateway config). Each entry takes ``(timeouts, limits)`` and has ``target``, ``start``, ``close``,
``open``, ``probe`` and ``get_json`` (the interface of :class:`quillcache.gateway.upstream.Upstream`);
entries are lazy, so the config validates a name without importing a client.
"""

from __future__ import annotations

from quillcache.registry import Registry

__all__ = ["UPSTREAM_CLIENTS"]

UPSTREAM_CLIENTS: Registry[type] = Registry("upstream client")
UPSTREAM_CLIENTS.register_lazy("native", "quillcache.gateway.native_upstream:NativeUpstream")
UPSTREAM_CLIENTS.register_lazy("aiohttp", "quillcache.gateway.upstream:Upstream")
