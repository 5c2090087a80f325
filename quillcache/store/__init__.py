"""The KV byte store: DRAM segments, the crash-consistent SSD tier and the tiered data plane."""

from quillcache.store.errors import (
    BlockExistsError,
    BlockInUseError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    ForeignFileError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    TierUnhealthyError,
)
from quillcache.store.keys import StoreKey

__all__ = [
    "BlockExistsError",
    "BlockInUseError",
    "BlockNotFoundError",
    "BlockTooLargeError",
    "CorruptBlockError",
    "ForeignFileError",
    "StoreClosedError",
    "StoreError",
    "StoreFullError",
    "StoreKey",
    "TierUnhealthyError",
]
