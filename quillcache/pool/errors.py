"""Typed errors of the pool client and nodes (one class per failure; all are :class:`PoolError`).

A refused call names the key (or node) and why; nothing a :class:`PoolError` reports leaves a
half-written object readable: a failed put is revoked at the master before the error is raised.
"""

from __future__ import annotations

__all__ = ["CorruptObjectError", "MasterUnavailableError", "NoSsdTierError", "NodeIdInUseError", "PersistFailedError",
           "PoolClosedError", "PoolError", "PutFailedError"]


class PoolError(Exception):
    """Base class of the pool's errors."""


class CorruptObjectError(PoolError):
    """Stored bytes that do not verify as the object they should be (trailer or crc32c mismatch)."""


class PutFailedError(PoolError):
    """A put that did not complete: the master refused it, or a WRITE to a replica failed (then the
    put was revoked: nothing of it is readable)."""


class PoolClosedError(PoolError):
    """The store or node is closed."""


class MasterUnavailableError(PoolError):
    """The master did not answer (down, paused, restarting) within the client's retry window."""


class NodeIdInUseError(PoolError):
    """A node started under the id of a node that is still serving its segment (names the id and where)."""


class PersistFailedError(PoolError):
    """A node's ``flush()``: some write-behind to its SSD tier since the previous flush is not durable (the
    tier refused it or its group commit failed); names the node, how many, and the first cause."""


class PersistRefusedError(PersistFailedError):
    """A node's ``persist`` call refused whole, nothing of it queued: more than the node's items per call, or
    its persist queue's bounds would be passed (names the node, how many items and which bound). Its blocks are
    not durable on that node; the caller may send them again later (in smaller calls)."""


class NoSsdTierError(PersistRefusedError):
    """A ``persist`` sent to a node started without an SSD tier (``--ssd``): nothing can be made durable there.
    A store that gets it stops sending that node persists and reports it in ``flush_persist``."""


class ControlAuthError(PoolError):
    """A state-changing call on a node's control port without a valid proof on the pool secret (the message says
    what is wrong: none, malformed, too old or new, or not matching)."""
