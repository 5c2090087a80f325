"""Durability: one write-ahead log over one file-system interface, used by the index and the store.

``fs.py`` is the FileSystem interface and ``RealFs``; ``crashfs.py`` the crash-simulating
FileSystem; ``wal.py`` the write-ahead log (crc32c, per-file epoch, group commit, recovery modes),
which does all its I/O through a FileSystem.
"""

from quillcache.durability.fs import (
    CREATE_EXCL,
    FileStat,
    FileSystem,
    MODES,
    READ,
    READ_WRITE,
    RealFs,
)
from quillcache.durability.crashfs import (
    CrashFs,
    CrashStats,
    SimulatedCrash,
)
from quillcache.durability.wal import (
    RECOVERY_MODES,
    RecoveryMode,
    RecoveryReport,
    WalCorruptionError,
    WalError,
    WalFailedError,
    WalIOError,
    WalWriteError,
    WalWriter,
    scan,
    scan_bytes,
)

__all__ = [
    "CREATE_EXCL",
    "CrashFs",
    "CrashStats",
    "FileStat",
    "FileSystem",
    "MODES",
    "READ",
    "READ_WRITE",
    "RECOVERY_MODES",
    "RealFs",
    "RecoveryMode",
    "RecoveryReport",
    "SimulatedCrash",
    "WalCorruptionError",
    "WalError",
    "WalFailedError",
    "WalIOError",
    "WalWriteError",
    "WalWriter",
    "scan",
    "scan_bytes",
]
