"""The KV byte store: DRAM segments, the crash-consistent SSD tier and the tiered data plane."""

from quillcache.store.errors import (
    BlockExistsError,
    BlockInUseError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    DiskFullError,
    ForeignFileError,
    StoreClosedError,
    StoreError,
    StoreFullError,
    TierUnhealthyError,
)
from quillcache.durability.crashfs import CrashFs
from quillcache.store.dataplane import DataPlaneStats, StoreDataPlane
from quillcache.store.dram import DramStoreConfig, LocalKvStore, Location
from quillcache.durability.fs import FileSystem, RealFs
from quillcache.store.keys import StoreKey
from quillcache.store.reconcile import ReconcileReport, reconcile_index
from quillcache.store.ssd import SsdTier
from quillcache.store.ssd_format import SsdRecoveryReport, SsdTuning

__all__ = [
    "CrashFs",
    "DataPlaneStats",
    "DramStoreConfig",
    "LocalKvStore",
    "Location",
    "StoreDataPlane",
    "FileSystem",
    "RealFs",
    "ReconcileReport",
    "SsdRecoveryReport",
    "SsdTier",
    "SsdTuning",
    "reconcile_index",
    "BlockExistsError",
    "BlockInUseError",
    "BlockNotFoundError",
    "BlockTooLargeError",
    "CorruptBlockError",
    "DiskFullError",
    "ForeignFileError",
    "StoreClosedError",
    "StoreError",
    "StoreFullError",
    "StoreKey",
    "TierUnhealthyError",
]
