"""Typed errors of the KV byte store (DRAM segments, SSD tier, data plane).

Every error names the key, size or path it is about. A raised error never leaves the store
inconsistent: the operation that failed had no effect on what was already stored.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every store error."""


class BlockNotFoundError(StoreError, KeyError):
    """The key is not stored (in the tier asked, or anywhere)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "block not found"


class BlockTooLargeError(StoreError, ValueError):
    """A block larger than any segment/slab (or the configured per-block maximum) can ever hold."""


class StoreFullError(StoreError):
    """No room, even after evicting everything that may be evicted (pinned/leased blocks stay)."""


class DiskFullError(StoreFullError):
    """The file system under an SSD tier is out of space (ENOSPC/EDQUOT) although the tier's own
    capacity is not used up. Not a capacity shortage: evicting the tier's blocks does not free disk
    space (slabs are preallocated; deletes free nothing until a group commit succeeds), so callers
    that make room by eviction must not evict for it. Nothing already stored was damaged."""


class BlockExistsError(StoreError):
    """A put of a key that is already stored (blocks are immutable until deleted)."""


class BlockInUseError(StoreError):
    """The block is pinned or leased, so it cannot be deleted, demoted or evicted now."""


class CorruptBlockError(StoreError):
    """Stored bytes failed their crc32c check; they are never returned to a caller."""


class TierUnhealthyError(StoreError):
    """A tier saw an I/O error it cannot trust (e.g. a failed fsync) and refuses further writes."""


class StoreClosedError(StoreError):
    """The store (or tier) has been closed."""


class ForeignFileError(StoreError):
    """A directory holds files that are not this store's (reported, never deleted)."""


class SsdLogMissingError(StoreError):
    """The slab layout's log is missing or unusable while slab files exist: the slabs hold no keys or
    checksums of their own, so the blocks cannot be recovered. The message names the directory, what
    was found, and how to force an empty start (``SsdTier(..., on_missing_log="empty")``)."""


class SsdRecoveryError(StoreError):
    """Opening (= recovering) an SSD tier failed on an I/O error or on data it cannot interpret; the
    message names the directory and the cause. The directory is left as it was found."""
