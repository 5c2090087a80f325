"""The ART index's WAL payload: one ``put``/``remove`` batch as its logical operations, compressed.

Format (leading byte ``WAL_FORMAT``): ``counts u32 u32 | klen vlen key value ... | klen key ...``
(:func:`encode_batch`) compressed with zlib level 1, holding the primary and node-name operations
only: every secondary (``N``) key is a permutation of a primary key's fields and is derived again
by :func:`decode_wal_batch`. :func:`encode_wal_columns` writes the same bytes from packed columns.
:func:`split_batch` checks a raw batch against the key layout (before it is logged) and sorts it
by family for the trees.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np

from quillcache.index import keys as K

WAL_FORMAT = b"\x02"  # leading byte of a WAL payload: zlib-compressed logical batch (primary + names)
_BATCH_COUNTS = struct.Struct("<II")
_WAL_PUT_DTYPE = np.dtype([("klen", "u1"), ("vlen", "u1"), ("key", f"V{K.KEY_BYTES}"), ("value", f"V{K.VALUE_BYTES}")])


def encode_batch(puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> bytes:
    """WAL payload of one batch: counts, then ``klen vlen key value`` puts, then ``klen key`` deletes."""
    parts = [_BATCH_COUNTS.pack(len(puts), len(deletes))]
    for k, v in puts:
        parts.append(bytes((len(k), len(v))))
        parts.append(k)
        parts.append(v)
    for k in deletes:
        parts.append(bytes((len(k),)))
        parts.append(k)
    return b"".join(parts)


def _secondary_of(primary_key: bytes) -> bytes:
    h, no, tier, ident = K.unpack_primary(primary_key)
    return K.secondary_key(h, no, tier, ident)


def encode_wal_batch(puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> bytes:
    """The WAL payload of a batch: its primary and node-name operations, compressed. Secondary
    keys are left out: :func:`decode_wal_batch` derives them from the primary keys."""
    return WAL_FORMAT + zlib.compress(
        encode_batch([(k, v) for k, v in puts if k[:1] != K.SECONDARY], [k for k in deletes if k[:1] != K.SECONDARY]),
        1,
    )


def decode_wal_batch(payload: bytes) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """Inverse of :func:`encode_wal_batch`: the full batch, secondary keys derived again."""
    if payload[:1] != WAL_FORMAT:
        raise ValueError(f"unknown WAL payload format {payload[:1]!r} (expected {WAL_FORMAT!r})")
    puts, dels = decode_batch(zlib.decompress(payload[1:]))
    puts += [(_secondary_of(k), b"") for k, _ in puts if k[:1] == K.PRIMARY]
    dels += [_secondary_of(k) for k in dels if k[:1] == K.PRIMARY]
    return puts, dels


def decode_batch(payload: bytes) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    n_put, n_del = _BATCH_COUNTS.unpack_from(payload, 0)
    pos, puts, dels = _BATCH_COUNTS.size, [], []
    for _ in range(n_put):
        kl, vl = payload[pos], payload[pos + 1]
        pos += 2
        puts.append((payload[pos : pos + kl], payload[pos + kl : pos + kl + vl]))
        pos += kl + vl
    for _ in range(n_del):
        kl = payload[pos]
        dels.append(payload[pos + 1 : pos + 1 + kl])
        pos += 1 + kl
    if pos != len(payload):
        raise ValueError(f"batch payload has {len(payload) - pos} trailing bytes")
    return puts, dels


# a checked batch: node-name (key, value or None to delete), primary keys, primary values, secondary keys, deletes
Batch = tuple[list[tuple[bytes, bytes | None]], list[bytes], list[bytes], list[bytes], list[bytes]]


def split_batch(puts: Sequence[tuple[bytes, bytes]], deletes: Sequence[bytes]) -> Batch:
    """Check a raw batch against the key layout (IndexKeyError naming the first bad key or value;
    nothing is changed) and sort it by family for ``ArtIndex._apply``."""
    names: list[tuple[bytes, bytes | None]] = []
    prim_k, prim_v, sec_k, dels = [], [], [], []
    for k, v in puts:
        fam = k[:1]
        if fam == K.PRIMARY or fam == K.SECONDARY:
            want = K.VALUE_BYTES if fam == K.PRIMARY else 0
            if len(k) != K.KEY_BYTES or len(v) != want:
                raise K.IndexKeyError(f"a {fam!r} record needs a {K.KEY_BYTES}-byte key and a {want}-byte value, "
                                      f"got {len(k)} and {len(v)}")
            if fam == K.PRIMARY:
                prim_k.append(k)
                prim_v.append(v)
            else:
                sec_k.append(k)
        elif fam == K.NODE_NAME:
            if len(v) != 4 or not 2 < len(k) <= K.MAX_NODE_NAME_BYTES + 2 or k[-1:] != b"\x00":
                raise K.IndexKeyError(f"malformed node-name record {k!r:.80} -> {v!r:.20}")
            names.append((k, v))
        else:
            raise K.IndexKeyError(f"key family {fam!r} is not part of the residency layout")
    for k in deletes:
        fam = k[:1]
        if fam == K.PRIMARY or fam == K.SECONDARY:
            if len(k) != K.KEY_BYTES:
                raise K.IndexKeyError(f"a {fam!r} key is {K.KEY_BYTES} bytes, got {len(k)}")
            dels.append(k)
        elif fam == K.NODE_NAME:
            names.append((k, None))
        else:
            raise K.IndexKeyError(f"key family {fam!r} is not part of the residency layout")
    return names, prim_k, prim_v, sec_k, dels


def encode_wal_columns(name_puts: Sequence[tuple[bytes, bytes]], primary: np.ndarray, values: np.ndarray) -> bytes:
    """:func:`encode_wal_batch` of the node-name puts then ``n`` primary puts given as packed
    arrays (``n`` 30-byte keys and 16-byte values; the secondary keys are left out as there),
    without a Python loop per replica."""
    rows = np.empty(len(primary), dtype=_WAL_PUT_DTYPE)
    rows["klen"], rows["vlen"] = K.KEY_BYTES, K.VALUE_BYTES
    rows["key"] = primary.view(f"V{K.KEY_BYTES}")
    rows["value"] = values.view(f"V{K.VALUE_BYTES}")
    head = [_BATCH_COUNTS.pack(len(name_puts) + len(primary), 0)]
    for k, v in name_puts:
        head.append(bytes((len(k), len(v))))
        head.append(k)
        head.append(v)
    return WAL_FORMAT + zlib.compress(b"".join(head) + rows.tobytes(), 1)
