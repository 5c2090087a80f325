"""``EmbeddedPool``: the whole pool in one process (the design's default deployment).

An in-process ``MasterService`` (no data dir; reached through ``MasterClient.embedded``, so every call
and error still passes through the RPC codec), ``nodes`` :class:`~quillcache.pool.node.PoolNode` s and a
timer thread running the master's ``tick`` (client expiry, reclaim, eviction). The nodes serve their
DRAM over the ``tcp`` transfer backend on 127.0.0.1 by default: the same code paths (sockets,
authentication, one-sided READ/WRITE, control RPC) as separate processes, only the processes are one.
``backend="local"`` swaps in the in-process memcpy backend.

One ``MasterClient`` is shared by every node and store here: the embedded client serialises calls on
its own lock, which is what makes an in-process service safe to call from several threads.
"""

from __future__ import annotations

import logging
import secrets
import threading

from quillcache.master.client import MasterClient
from quillcache.master.errors import MasterError
from quillcache.master.service import MasterService
from quillcache.master.types import MasterConfig
from quillcache.pool.node import PoolNode
from quillcache.pool.store import PooledStore

__all__ = ["EmbeddedPool", "embedded_store"]

log = logging.getLogger(__name__)


class EmbeddedPool:
    """See the module docstring. ``nodes[i]`` are live ``PoolNode`` s (None once closed by ``close_node``)."""

    def __init__(self, nodes: int = 3, dram_bytes: int = 64 << 20, *, ssd_dirs=None, backend: str = "tcp",
                 config: MasterConfig | None = None, tick_s: float = 0.2, heartbeat_s: float = 0.5,
                 clock=None) -> None:
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be an int >= 1, got {nodes!r}")
        self.config = config if config is not None else MasterConfig()
        self.backend = backend
        self.dram_bytes = dram_bytes
        self.heartbeat_s = heartbeat_s
        self.secret = secrets.token_hex(16)
        self.ssd_dirs = list(ssd_dirs) if ssd_dirs is not None else [None] * nodes
        if len(self.ssd_dirs) != nodes:
            raise ValueError(f"{nodes} nodes but {len(self.ssd_dirs)} ssd_dirs")
        kw = {"clock": clock} if clock is not None else {}
        self.service = MasterService(self.config, **kw)
        self.master = MasterClient.embedded(self.service)
        self.nodes: list[PoolNode | None] = []
        self._node_ids = [f"embedded-{secrets.token_hex(3)}-{i}" for i in range(nodes)]
        self._stop = threading.Event()
        self._ticker = None
        try:
            for i in range(nodes):
                self.nodes.append(self._start_node(i))
            self._ticker = threading.Thread(target=self._tick_loop, args=(tick_s,), name="pool-master-tick",
                                            daemon=True)
            self._ticker.start()
        except BaseException:
            self.close()
            raise

    def _start_node(self, i: int) -> PoolNode:
        return PoolNode(self.master, dram_bytes=self.dram_bytes, ssd_dir=self.ssd_dirs[i], node_id=self._node_ids[i],
                        secret=self.secret, backend=self.backend, heartbeat_s=self.heartbeat_s)

    def _tick_loop(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            try:
                self.master.tick()
            except MasterError as e:
                log.warning("tick: %s", e)
            except Exception:
                log.exception("tick failed")

    def store(self, **kwargs) -> PooledStore:
        """A ``PooledStore`` on this pool (the caller closes it)."""
        kwargs.setdefault("lease_ttl_s", self.config.lease_ttl_s)
        return PooledStore(self.master, secret=self.secret, backend=self.backend, **kwargs)

    def close_node(self, i: int) -> None:
        """Stop node ``i`` cleanly (it unmounts: its replicas leave the pool at once)."""
        node = self.nodes[i]
        if node is not None:
            self.nodes[i] = None
            node.close()

    def restart_node(self, i: int) -> PoolNode:
        """Close node ``i`` if live and start it again with the same node id and SSD directory."""
        self.close_node(i)
        self.nodes[i] = self._start_node(i)
        return self.nodes[i]

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        for i in range(len(self.nodes)):
            try:
                self.close_node(i)
            except Exception as e:
                log.warning("closing node %d: %s", i, e)
        self.service.close()

    def __enter__(self) -> EmbeddedPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def embedded_store(nodes: int = 3, dram_bytes: int = 64 << 20, *, ssd_dirs=None, backend: str = "tcp",
                   config: MasterConfig | None = None, tick_s: float = 0.2, heartbeat_s: float = 0.5,
                   **store_kwargs) -> PooledStore:
    """A ``PooledStore`` that owns a whole :class:`EmbeddedPool` (``store.pool``), closed with the store."""
    pool = EmbeddedPool(nodes, dram_bytes, ssd_dirs=ssd_dirs, backend=backend, config=config, tick_s=tick_s,
                        heartbeat_s=heartbeat_s)
    try:
        store = pool.store(**store_kwargs)
    except BaseException:
        pool.close()
        raise
    store._owned.append(pool)
    store.pool = pool
    return store
