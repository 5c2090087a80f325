"""The distributed byte pool: ``quillcache node`` processes pooling DRAM (and SSD behind it), and the
``PooledStore`` client moving real bytes to and from them over the transfer engine.

Modules: ``frame`` (the stored object: payload + crc32c trailer), ``cache`` (the client's registered
buffer), ``node`` (``PoolNode``), ``store`` (``PooledStore``), ``embedded`` (a pool in one process),
``cluster`` (``LocalCluster``: real processes on loopback), ``errors``.
"""

from quillcache.pool.errors import (CorruptObjectError, MasterUnavailableError, NodeIdInUseError, PersistFailedError,
                                    PoolClosedError, PoolError, PutFailedError)
from quillcache.pool.embedded import EmbeddedPool, embedded_store
from quillcache.pool.store import PoolStats, PooledStore, PutOutcome

__all__ = ["CorruptObjectError", "EmbeddedPool", "MasterUnavailableError", "NodeIdInUseError", "PersistFailedError",
           "PoolClosedError", "PoolError", "PoolStats", "PooledStore", "PutFailedError", "PutOutcome", "embedded_store"]
