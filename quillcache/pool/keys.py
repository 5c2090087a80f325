"""Pool object keys (``str``, the master's keys) mapped to the SSD tier's ``StoreKey`` and back.

An SSD block of the pool is a self-describing record: ``u32 key length | key UTF-8 | framed object``
(:mod:`quillcache.pool.frame`), so recovery learns each block's pool key from the block itself. The
``StoreKey`` is a 24-byte BLAKE2b of the key: a fixed-size name the tier can index; the record's own key
is what counts (a record whose key does not hash to its ``StoreKey`` is ignored).
"""

from __future__ import annotations

import hashlib
import struct

from quillcache.store.keys import StoreKey

__all__ = ["decode_record", "record_header", "store_key"]

_LEN = struct.Struct(">I")


def store_key(key: str) -> StoreKey:
    d = hashlib.blake2b(key.encode("utf-8"), digest_size=24).digest()
    return StoreKey(int.from_bytes(d[:8], "big"), d[8:])


def record_header(key: str) -> bytes:
    kb = key.encode("utf-8")
    return _LEN.pack(len(kb)) + kb


def decode_record(raw) -> tuple[str, memoryview]:
    """``(key, framed object view)`` of an SSD record; ``ValueError`` if it is malformed."""
    mv = memoryview(raw)
    if mv.nbytes < 4:
        raise ValueError("SSD record shorter than its key length")
    (n,) = _LEN.unpack_from(mv, 0)
    if 4 + n > mv.nbytes:
        raise ValueError(f"SSD record key length {n} past its end ({mv.nbytes} bytes)")
    key = bytes(mv[4:4 + n]).decode("utf-8")
    return key, mv[4 + n:]
