"""The stored form of a pool object: payload + a fixed 24-byte trailer.

Layout (big-endian): ``payload | magic "QCPF" (4) | version u16 | flags u16 (0) | payload length u64 |
crc32c u32 | 4 reserved zero bytes``. The crc32c covers the key's UTF-8 bytes, then the payload, then
the trailer's first 16 bytes (magic, version, flags, length), in that order.

Invariants:
- :func:`check` returns the payload only when every field agrees: the view is exactly
  ``payload length + TRAILER_BYTES`` long, magic, version, flags and reserved bytes are the known values,
  and the crc32c over (key, payload, trailer head) matches. Anything else raises
  :class:`~quillcache.pool.errors.CorruptObjectError` naming the first disagreement.
- Because the crc covers the key, a replica whose range was reused by another object (the lease
  ended, the object was evicted and the range re-allocated) never verifies as this key, even when the
  other object is the same size; a truncated, extended or bit-flipped copy never verifies either
  (up to crc32c's 2**-32 chance for a random corruption).
- The size a pool object occupies (what the master allocates) is ``len(payload) + TRAILER_BYTES``.
"""

from __future__ import annotations

import struct

import crc32c as _crc

from quillcache.pool.errors import CorruptObjectError

__all__ = ["MAGIC", "TRAILER_BYTES", "VERSION", "check", "encode_trailer", "frame", "digest_of", "framed_size", "trailer_crc"]

MAGIC = b"QCPF"
VERSION = 1
_HEAD = struct.Struct(">4sHHQ")  # magic, version, flags, payload length
_TAIL = struct.Struct(">I4x")  # crc32c, reserved
TRAILER_BYTES = _HEAD.size + _TAIL.size  # 24
_MAX_PAYLOAD = (1 << 64) - 1


def _key_bytes(key: str) -> bytes:
    if not isinstance(key, str) or not key:
        raise TypeError(f"a pool key is a non-empty str, got {key!r:.80}")
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"a pool key must be UTF-8 text, got {key!r:.80}") from None


def encode_trailer(key: str, payload) -> bytes:
    """The 24-byte trailer to store right after ``payload`` (any C-contiguous buffer)."""
    n = memoryview(payload).nbytes
    head = _HEAD.pack(MAGIC, VERSION, 0, n)
    c = _crc.crc32c(_key_bytes(key))
    c = _crc.crc32c(payload, c)
    c = _crc.crc32c(head, c)
    return head + _TAIL.pack(c)


def frame(key: str, payload) -> bytes:
    """``payload + encode_trailer(key, payload)`` as one new bytes object (tests, small objects)."""
    return bytes(payload) + encode_trailer(key, payload)


def trailer_crc(trailer: bytes) -> int:
    """The crc32c a trailer carries (its bytes 16..20)."""
    return _TAIL.unpack_from(trailer, _HEAD.size)[0]


def digest_of(trailer) -> bytes:
    """The content digest the master is given for an object: its trailer's payload length and crc32c
    (12 bytes). Two puts of one key with the same digest are the same content (up to crc32c)."""
    return bytes(memoryview(trailer)[8:20])


def framed_size(payload_bytes: int) -> int:
    return int(payload_bytes) + TRAILER_BYTES


def check(view, key: str) -> memoryview:
    """The payload of the framed object ``view`` if it verifies as ``key``'s; else ``CorruptObjectError``.

    ``view`` is any C-contiguous buffer (any format or shape: its bytes are checked); a non-contiguous one
    raises ``TypeError`` naming the key. The returned memoryview is a 1-D unsigned-byte slice of ``view``
    (no copy)."""
    mv = memoryview(view)
    if not mv.c_contiguous:
        raise TypeError(f"object {key!r:.120}: the view to check must be C-contiguous "
                        f"(got shape {mv.shape}, strides {mv.strides})")
    if mv.ndim != 1 or mv.format != "B":  # 'c' and 'b' too: 'c' items are 1-byte bytes, not ints
        mv = mv.cast("B")
    n = mv.nbytes
    if n < TRAILER_BYTES:
        raise CorruptObjectError(f"object {key!r:.120}: {n} bytes, shorter than the {TRAILER_BYTES}-byte trailer")
    body = n - TRAILER_BYTES
    magic, version, flags, length = _HEAD.unpack_from(mv, body)
    if magic != MAGIC:
        raise CorruptObjectError(f"object {key!r:.120}: bad trailer magic {bytes(magic)!r} (want {MAGIC!r})")
    if version != VERSION or flags != 0:
        raise CorruptObjectError(f"object {key!r:.120}: trailer version {version} flags {flags} "
                                 f"(want {VERSION}, 0)")
    if length != body:
        raise CorruptObjectError(f"object {key!r:.120}: trailer says {length} payload bytes, "
                                 f"the object holds {body}")
    stored, = _TAIL.unpack_from(mv, body + _HEAD.size)
    if bytes(mv[n - 4:n]) != b"\0\0\0\0":
        raise CorruptObjectError(f"object {key!r:.120}: reserved trailer bytes are not zero")
    payload = mv[:body]
    c = _crc.crc32c(_key_bytes(key))
    c = _crc.crc32c(payload, c)
    c = _crc.crc32c(mv[body:body + _HEAD.size], c)
    if c != stored:
        raise CorruptObjectError(f"object {key!r:.120}: crc32c {c:#010x} != stored {stored:#010x} "
                                 f"(corrupt, or another object's bytes)")
    return payload
