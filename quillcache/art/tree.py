"""Ordered byte-key index: an adaptive radix tree (ART) in one offset-addressed arena.

``ArtTree`` is the public API: a thin Python subclass of the Cython core
``quillcache.art._art.ArtCore`` that validates every argument before any work (batch arrays,
meta and buffers here; single keys and prefixes in the core's own methods, which raise the same
messages, so the hot single-key calls pay no extra Python frame). ``ArtReference`` is a
plain-Python implementation (dict + sorted key list) with identical semantics. The reference is
the specification: the tests drive both with the same operations and compare results and errors.

Invariants (both implementations)
- Keys are ``bytes`` of 1..255 bytes and the key set is prefix-free: inserting a key that is a
  proper prefix of a stored key, or that has a stored key as a proper prefix, raises ValueError
  naming both lengths (the conflicting stored key is the smallest one involved).
- Every value is ``bytes`` of exactly ``value_size`` bytes (0..255; 0 = key-only index).
- Scans and iteration are in ascending unsigned-byte key order. ``items(start)`` is a cursor: it
  yields keys >= start in chunks, re-seeking after the last yielded key, so the tree may be
  mutated between steps (later chunks see the mutation; keys still come out strictly ascending).
- Batch calls take C-contiguous ``uint8`` matrices, one key (or prefix) per row, and are not
  atomic: rows before a failing row stay applied and the error names the failing row.

Arena (``ArtTree`` only)
- All nodes and leaves live in ONE contiguous byte arena and point at each other by uint64
  offsets (0 = null), so ``arena_view()`` bytes plus ``root_offset`` and ``export_meta()``
  re-create the tree anywhere via ``ArtTree.attach`` in O(1), without walking it.
- ``attach`` checks the header, the meta and the root in O(1); every later offset dereference is
  bounds-checked against the used arena size, so a damaged arena raises ``ValueError("corrupt
  arena ...")`` instead of reading outside it; ``verify()`` is the full O(n) check.
- An attached read-only buffer is copied into owned memory on the first mutation; an attached
  writable buffer is mutated in place until it must grow, then copied. While an ``arena_view()``
  is alive the arena cannot move: a mutation that needs to grow or copy raises BufferError.

Lazy checksums (``attach(..., chunk_crcs=table, chunk_bytes=cb)``, RocksDB-style block checks)
- ``table`` holds one CRC-32C (Castagnoli, as ``crc32c.crc32c``) per ``cb``-byte chunk of the used
  arena (``ArtTree.chunk_crcs(cb)`` computes it). Attach then reads NO arena byte: it keeps the
  table and an all-clear "verified" bitmap; attach stays O(1) in the arena size.
- Before any operation uses an arena object (the header, before the first operation; a node's
  header and body; a leaf; a free block the allocator pops) every chunk the object overlaps is
  verified: checksummed once on first use, never again (so later writes of our own do not trip it).
  Bytes allocated beyond the attached used size need no check; the table stays valid when the arena
  is copied or grown (same offsets); ``remove_prefix(b"")`` discards the arena and the table.
- A mismatch makes the tree permanently corrupt: that operation and every later one raise
  ``ValueError("corrupt arena: chunk N (bytes A..B) checksum mismatch")`` (A..B inclusive), and the
  failing operation changes nothing (a mutation verifies what it will read, and the free blocks it
  will pop, before its first write). ``verify_all_chunks()`` checks the rest eagerly; an export
  (``arena_view()``, ``chunk_crcs()``) verifies everything first, so it never passes on bad bytes.
- Cost once verified: one compare and a bit test per dereference; none at all (a single compare)
  once every chunk is verified, or without a table. ``stats()`` reports ``chunks_total`` and
  ``chunks_verified`` (0 and 0 without a table).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

import numpy as np

from quillcache._checks import check_int
from quillcache.art import _art
from quillcache.art.meta import ArenaMeta

__all__ = ["ArenaMeta", "ArtTree", "ArtReference", "MAX_KEY_BYTES", "MAX_VALUE_BYTES", "DEFAULT_CHUNK_BYTES"]

MAX_KEY_BYTES = 255
MAX_VALUE_BYTES = 255
# Lazy-checksum chunk sizes (powers of two): an object (<= 2080 bytes) spans at most two chunks.
DEFAULT_CHUNK_BYTES = 65536
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 16 << 20
# Entries fetched per cursor step of ``items()``.
_ITEMS_CHUNK = 256


# -- validation shared by both implementations ------------------------------------------------

def _bad_bytes(name: str, value: object, lo: int) -> None:
    if type(value) is not bytes:
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    raise ValueError(f"{name} length must be in {lo}..{MAX_KEY_BYTES} bytes, got {len(value)}")


def _check_value(value: object, value_size: int) -> None:
    if type(value) is not bytes:
        raise TypeError(f"value must be bytes, got {type(value).__name__}")
    if len(value) != value_size:
        raise ValueError(f"value must be exactly {value_size} bytes, got {len(value)}")


def _check_limit(limit: object) -> int:
    """-1 for no limit, else the validated limit."""
    return -1 if limit is None else check_int("limit", limit, 0, 2**62)


def _check_matrix(name: str, arr: object, lo_width: int, hi_width: int, rows: int | None = None) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of uint8, got {type(arr).__name__}")
    if arr.dtype != np.uint8:
        raise ValueError(f"{name} must have dtype uint8, got {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D (rows, bytes), got {arr.ndim}-D shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray), got strides {arr.strides}")
    if not lo_width <= arr.shape[1] <= hi_width:
        raise ValueError(f"{name} rows must be {lo_width}..{hi_width} bytes wide, got {arr.shape[1]}")
    if rows is not None and arr.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows (one per key), got {arr.shape[0]}")
    return arr


def _conflict_message(key_len: int, existing_len: int) -> str:
    return (f"key of length {key_len} conflicts with an existing key of length {existing_len}: "
            "one is a proper prefix of the other (keys must be prefix-free)")


def _iter_chunks(scan_from: Any, start: bytes | None) -> Iterator[tuple[bytes, bytes]]:
    """Cursor over ``scan_from(start, exclusive, limit)`` chunks. Keys must strictly ascend (a
    damaged arena that breaks the order raises instead of looping)."""
    last = b""
    chunk = scan_from(start, False, _ITEMS_CHUNK)
    while chunk:
        for item in chunk:
            if item[0] <= last:
                raise ValueError("corrupt arena: items() keys stopped ascending")
            last = item[0]
            yield item
        if len(chunk) < _ITEMS_CHUNK:
            return
        chunk = scan_from(last, True, _ITEMS_CHUNK)


def _check_chunk_bytes(chunk_bytes: object) -> int:
    """A chunk size: an int that is a power of two in 4 KiB..16 MiB."""
    v = check_int("chunk_bytes", chunk_bytes, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    if v & (v - 1):
        raise ValueError(f"chunk_bytes must be a power of two in {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES}, got {v}")
    return v


def _check_chunk_table(table: object, used_bytes: int, chunk_bytes: int) -> None:
    """A chunk checksum table: 1-D contiguous uint32 with one entry per chunk of used_bytes."""
    if not isinstance(table, np.ndarray):
        raise TypeError(f"chunk_crcs must be a numpy.ndarray of uint32, got {type(table).__name__}")
    if table.dtype != np.uint32:
        raise ValueError(f"chunk_crcs must have dtype uint32 (native byte order), got {table.dtype}")
    if table.ndim != 1:
        raise ValueError(f"chunk_crcs must be 1-D, got {table.ndim}-D shape {table.shape}")
    if not table.flags.c_contiguous:
        raise ValueError(f"chunk_crcs must be contiguous (use np.ascontiguousarray), got strides {table.strides}")
    need = -(-used_bytes // chunk_bytes)
    if table.shape[0] != need:
        raise ValueError(f"chunk_crcs has {table.shape[0]} entries but arena_used_bytes {used_bytes} "
                         f"in chunks of {chunk_bytes} bytes needs {need}")


def _u64_overflow(head: object, number: object) -> OverflowError:
    return OverflowError(f"head={head} or number={number} out of range for u8/u64")


def _check_u64_scan(head: object, numbers: object, key_len: object) -> np.ndarray:
    """``scan_u64_prefix_batch``'s arguments: key_len an int in 9..255 (ValueError), head an int in
    0..255 (OverflowError), numbers a 1-D array (or sequence) of non-negative integers that fit u64
    (ValueError otherwise), returned as contiguous uint64."""
    if not 9 <= check_int("key_len", key_len) <= 255:
        raise ValueError(f"key_len must be in 9..255, got {key_len}")
    check_int("head", head, 0, 0xFF, error=OverflowError)
    arr = numbers if isinstance(numbers, np.ndarray) else np.asarray(numbers)
    if arr.ndim != 1 or (arr.dtype.kind not in "ui" and arr.size):
        raise ValueError(f"numbers must be a 1-D array of integers, got {arr.dtype} {arr.shape}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        raise ValueError(f"numbers must be non-negative, got {int(arr.min())}")
    return np.ascontiguousarray(arr, dtype=np.uint64)


def _check_start(start: object) -> None:
    if start is not None and (type(start) is not bytes or len(start) > MAX_KEY_BYTES):
        _bad_bytes("start", start, 0)


class ArtTree(_art.ArtCore):
    """Adaptive radix tree over an offset-addressed arena; see the module docstring.

    The single-key hot paths (``insert``, ``get``, ``remove``, ``in``, ``len``) and the prefix
    calls (``scan_prefix``, ``count_prefix``, ``remove_prefix``) are the compiled core's own
    methods: they validate their arguments first, in C, with exactly the messages the reference
    uses (a Python frame here would be a large share of a point lookup). Everything else is
    validated below before reaching the core.

    - ``insert(key: bytes, value: bytes) -> bool``: True if new, False if replaced.
    - ``get(key: bytes) -> bytes | None``, ``remove(key: bytes) -> bool``, ``key in tree``, ``len(tree)``.
    - ``scan_prefix(prefix: bytes, limit: int | None = None) -> list[tuple[bytes, bytes]]``.
    - ``count_prefix(prefix: bytes) -> int``, ``remove_prefix(prefix: bytes) -> int``.
    - ``stats()``, ``verify()`` -> ``dict[str, int]``; ``export_meta() -> ArenaMeta``; ``arena_used_bytes``,
      ``root_offset``, ``value_size`` properties.
    - ``chunk_crcs(chunk_bytes: int = 65536) -> np.ndarray`` (uint32 per chunk of the used arena),
      ``verify_all_chunks() -> int`` (chunks checksummed now); see "Lazy checksums" above.
    """

    __slots__ = ()

    def __init__(self, value_size: int, *, initial_arena_bytes: int = 1 << 20) -> None:
        vs = check_int("value_size", value_size, 0, MAX_VALUE_BYTES)
        cap = check_int("initial_arena_bytes", initial_arena_bytes, _art.HEADER_BYTES, 2**48)
        super().__init__(vs, cap)

    def items(self, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Ascending (key, value) pairs with key >= start (lower-bound seek); a cursor."""
        _check_start(start)
        return _iter_chunks(self._scan_from, start)

    # -- batches -----------------------------------------------------------------------

    def insert_batch(self, keys: np.ndarray, values: np.ndarray) -> int:
        """Insert keys[i] -> values[i] for every row in order; returns how many keys were new."""
        _check_matrix("keys", keys, 1, MAX_KEY_BYTES)
        vs = self.value_size
        _check_matrix("values", values, vs, vs, rows=keys.shape[0])
        return super().insert_batch(keys, values)

    def get_batch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found: bool[n], values: uint8[n, value_size]); rows of missing keys are zero."""
        _check_matrix("keys", keys, 1, MAX_KEY_BYTES)
        return super().get_batch(keys)

    def scan_prefix_batch(self, prefixes: np.ndarray, key_len: int | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """CSR prefix scan: (keys uint8[m, L], values uint8[m, value_size], offsets int64[n+1]).

        Matches of prefixes[i] are rows offsets[i]:offsets[i+1], ascending. All matched keys
        must have one length L (``key_len``, or the first match's length; ValueError otherwise).
        """
        _check_matrix("prefixes", prefixes, 0, MAX_KEY_BYTES)
        kl = -1 if key_len is None else check_int("key_len", key_len, 1, MAX_KEY_BYTES)
        return super().scan_prefix_batch(prefixes, kl)

    def scan_u64_prefix_packed(self, head: int, number: int) -> bytes:
        """Every record under ``bytes([head]) + number.to_bytes(8, "big")``, key then value, in key
        order, concatenated (built in C); OverflowError naming both out-of-range arguments."""
        try:
            return super().scan_u64_prefix_packed(head, number)
        except OverflowError:
            raise _u64_overflow(head, number) from None

    def scan_u64_prefix_batch(self, head: int, numbers: np.ndarray, key_len: int
                              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``scan_prefix_batch`` over ``bytes([head]) + n.to_bytes(8, "big")`` for n in numbers (any
        1-D integer array or sequence of values in u64; prefixes built in C)."""
        return super().scan_u64_prefix_batch(head, _check_u64_scan(head, numbers, key_len), key_len)

    # -- arena and persistence ---------------------------------------------------------

    def arena_view(self) -> memoryview:
        """Read-only, zero-copy view of the used arena bytes. While it is alive the arena
        cannot move, so a mutation that needs to grow raises BufferError: release it first."""
        return memoryview(self)

    def chunk_crcs(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> np.ndarray:
        """uint32[ceil(arena_used_bytes / chunk_bytes)]: CRC-32C of each chunk of the used arena
        (the last one may be short), the table ``attach(..., chunk_crcs=)`` verifies against.
        A lazily attached tree verifies all its chunks first (ValueError if one fails)."""
        _check_chunk_bytes(chunk_bytes)
        return super().chunk_crcs(chunk_bytes)

    def verify_all_chunks(self) -> int:
        """Checksum every chunk not verified yet; returns how many it checked (0 without a table).
        Raises the corrupt-arena ValueError on a mismatch."""
        return super().verify_all_chunks()

    @classmethod
    def attach(cls, buffer: Any, root_offset: int, meta: ArenaMeta, *,
               chunk_crcs: np.ndarray | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ArtTree:
        """Re-create a tree over existing arena bytes in O(1) (no walk, no rebuild).

        ``meta`` is the ``ArenaMeta`` that ``export_meta()`` gave for those bytes; a field that
        does not fit them (e.g. a free-list head beyond ``arena_used_bytes``) raises ValueError
        naming it. Without ``chunk_crcs`` the arena header and root are checked now; with it
        (uint32, one CRC-32C per ``chunk_bytes`` chunk of ``meta.arena_used_bytes``) no arena byte
        is read here, and each chunk is verified when an operation first uses it (module docstring).
        """
        root = check_int("root_offset", root_offset, 0, 2**64 - 1)
        _check_chunk_bytes(chunk_bytes)
        if not isinstance(meta, ArenaMeta):
            raise TypeError(f"meta must be an ArenaMeta (from export_meta() or ArenaMeta.from_bytes), "
                            f"got {type(meta).__name__}")
        if meta.format_version != _art.FORMAT_VERSION:
            raise ValueError(f"meta format_version {meta.format_version} is not {_art.FORMAT_VERSION}")
        if meta.value_size > MAX_VALUE_BYTES:
            raise ValueError(f"meta value_size must be in 0..{MAX_VALUE_BYTES}, got {meta.value_size}")
        try:
            view = memoryview(buffer)
        except TypeError:
            raise TypeError(f"buffer must support the buffer protocol, got {type(buffer).__name__}") from None
        with view:
            if not view.c_contiguous:
                raise ValueError("buffer must be C-contiguous")
            if view.nbytes < meta.arena_used_bytes:
                raise ValueError(f"buffer of {view.nbytes} bytes is smaller than arena_used_bytes "
                                 f"{meta.arena_used_bytes}")
        if chunk_crcs is not None:
            _check_chunk_table(chunk_crcs, meta.arena_used_bytes, chunk_bytes)
        tree = cls.__new__(cls)  # the core's __cinit__ leaves a valid empty tree
        tree._attach(buffer, root, meta, chunk_crcs, chunk_bytes)
        return tree

    def __repr__(self) -> str:
        return f"ArtTree(value_size={self.value_size}, keys={len(self)}, arena_used_bytes={self.arena_used_bytes})"


class ArtReference:
    """Plain-Python specification of ``ArtTree`` (dict + sorted key list + bisect)."""

    __slots__ = ("_data", "_keys", "value_size")

    def __init__(self, value_size: int) -> None:
        self.value_size = check_int("value_size", value_size, 0, MAX_VALUE_BYTES)
        self._data: dict[bytes, bytes] = {}
        self._keys: list[bytes] = []

    def _conflict(self, key: bytes) -> int | None:
        """Length of the smallest stored key that conflicts (prefix relation) with key."""
        for i in range(1, len(key)):
            if key[:i] in self._data:
                return i
        j = bisect.bisect_left(self._keys, key)
        if j < len(self._keys) and self._keys[j].startswith(key):
            return len(self._keys[j])
        return None

    def insert(self, key: bytes, value: bytes) -> bool:
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            _bad_bytes("key", key, 1)
        _check_value(value, self.value_size)
        if key in self._data:
            self._data[key] = value
            return False
        other = self._conflict(key)
        if other is not None:
            raise ValueError(_conflict_message(len(key), other))
        bisect.insort(self._keys, key)
        self._data[key] = value
        return True

    def get(self, key: bytes) -> bytes | None:
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            _bad_bytes("key", key, 1)
        return self._data.get(key)

    def remove(self, key: bytes) -> bool:
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            _bad_bytes("key", key, 1)
        if key not in self._data:
            return False
        del self._data[key]
        del self._keys[bisect.bisect_left(self._keys, key)]
        return True

    def __contains__(self, key: object) -> bool:
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            _bad_bytes("key", key, 1)
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def _prefix_range(self, prefix: bytes) -> tuple[int, int]:
        if type(prefix) is not bytes or len(prefix) > MAX_KEY_BYTES:
            _bad_bytes("prefix", prefix, 0)
        lo = bisect.bisect_left(self._keys, prefix)
        hi = lo
        while hi < len(self._keys) and self._keys[hi].startswith(prefix):
            hi += 1
        return lo, hi

    def scan_prefix(self, prefix: bytes, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        lo, hi = self._prefix_range(prefix)
        lim = _check_limit(limit)
        if lim >= 0:
            hi = min(hi, lo + lim)
        return [(k, self._data[k]) for k in self._keys[lo:hi]]

    def scan_u64_prefix_packed(self, head: int, number: int) -> bytes:
        """Every record under ``bytes([head]) + number.to_bytes(8, "big")``, key then value, in key
        order, concatenated; OverflowError out of range."""
        if not (0 <= head <= 0xFF and 0 <= number <= 0xFFFFFFFFFFFFFFFF):
            raise _u64_overflow(head, number)
        return b"".join(k + v for k, v in self.scan_prefix(bytes([head]) + number.to_bytes(8, "big")))

    def scan_u64_prefix_batch(self, head: int, numbers: np.ndarray, key_len: int
                              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``scan_prefix_batch`` over ``bytes([head]) + n.to_bytes(8, "big")`` for n in numbers."""
        nums = _check_u64_scan(head, numbers, key_len)
        prefixes = np.empty((len(nums), 9), dtype=np.uint8)
        prefixes[:, 0] = head
        prefixes[:, 1:] = nums.astype(">u8").view(np.uint8).reshape(-1, 8)
        return self.scan_prefix_batch(prefixes, key_len)

    def count_prefix(self, prefix: bytes) -> int:
        lo, hi = self._prefix_range(prefix)
        return hi - lo

    def remove_prefix(self, prefix: bytes) -> int:
        lo, hi = self._prefix_range(prefix)
        for k in self._keys[lo:hi]:
            del self._data[k]
        del self._keys[lo:hi]
        return hi - lo

    def _scan_from(self, start: bytes | None, exclusive: bool, limit: int) -> list[tuple[bytes, bytes]]:
        if start is None:
            j = 0
        elif exclusive:
            j = bisect.bisect_right(self._keys, start)
        else:
            j = bisect.bisect_left(self._keys, start)
        return [(k, self._data[k]) for k in self._keys[j:j + limit]]

    def items(self, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        _check_start(start)
        return _iter_chunks(self._scan_from, start)

    def insert_batch(self, keys: np.ndarray, values: np.ndarray) -> int:
        _check_matrix("keys", keys, 1, MAX_KEY_BYTES)
        _check_matrix("values", values, self.value_size, self.value_size, rows=keys.shape[0])
        new = 0
        for i in range(keys.shape[0]):
            try:
                new += self.insert(keys[i].tobytes(), values[i].tobytes())
            except ValueError as exc:
                raise ValueError(f"row {i}: {exc}") from None
        return new

    def get_batch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        _check_matrix("keys", keys, 1, MAX_KEY_BYTES)
        found = np.zeros(keys.shape[0], dtype=np.bool_)
        values = np.zeros((keys.shape[0], self.value_size), dtype=np.uint8)
        for i in range(keys.shape[0]):
            v = self._data.get(keys[i].tobytes())
            if v is not None:
                found[i] = True
                values[i] = np.frombuffer(v, dtype=np.uint8)
        return found, values

    def scan_prefix_batch(self, prefixes: np.ndarray, key_len: int | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        _check_matrix("prefixes", prefixes, 0, MAX_KEY_BYTES)
        kl = None if key_len is None else check_int("key_len", key_len, 1, MAX_KEY_BYTES)
        offsets = np.zeros(prefixes.shape[0] + 1, dtype=np.int64)
        found: list[tuple[bytes, bytes]] = []
        for i in range(prefixes.shape[0]):
            found.extend(self.scan_prefix(prefixes[i].tobytes()))
            offsets[i + 1] = len(found)
        width = kl if kl is not None else (len(found[0][0]) if found else prefixes.shape[1])
        for k, _ in found:
            if len(k) != width:
                raise ValueError(f"scan_prefix_batch needs matched keys of one length: found {len(k)} "
                                 f"and {width}; pass key_len or use scan_prefix")
        keys = np.array([np.frombuffer(k, dtype=np.uint8) for k, _ in found], dtype=np.uint8).reshape(len(found), width)
        values = np.array([np.frombuffer(v, dtype=np.uint8) for _, v in found],
                          dtype=np.uint8).reshape(len(found), self.value_size)
        return keys, values, offsets
