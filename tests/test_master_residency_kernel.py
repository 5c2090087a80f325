"""The compiled residency keys (``quillcache.master._residency``) against ``residency_key`` (the reference),
and ``IndexProjection.add_columns`` built on them.

- The C BLAKE2b (RFC 7693, ``include/qc_blake2b.h``) equals ``hashlib.blake2b`` for every digest size
  and for messages around the 128-byte block boundaries (0, 127, 128, 129, 256 bytes...).
- ``residency_keys`` / ``residency_key1`` equal ``residency_key`` on arbitrary text, lone surrogates
  included (UTF-8 with ``surrogatepass``), on kv: keys (lower, upper and mixed case hex: only lowercase is
  parsed, the rest hashed) and on
  almost-valid ones (a non-hex or non-ASCII digit, a sign, whitespace, ``0x``, an underscore, a wrong
  length or separator, an upper-case prefix); the reference never yields a negative block hash or a
  short identity; consecutive repeats of one key object reuse its result; a non-str key is refused
  with its position, nothing returned.
- ``add_columns`` with lists, with NumPy columns and ``add`` per key write the same index; queued
  ``add``/``add_columns`` keep their order (the last write of a replica wins); mismatched or
  out-of-range columns are refused before anything is queued (a bad tier by the index, nothing written);
  ``publish_missing`` over column chunks writes once, then skips.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, strategies as st

from quillcache.index import IndexKeyError, open_index
from quillcache.master._residency import blake2b, residency_key1, residency_keys
from quillcache.master.residency import IndexProjection, kv_object_key, residency_key
from quillcache.types import CacheTier

HEX = "0123456789abcdefABCDEF"
# every code point, lone surrogates (category Cs) included
ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
SURROGATE = st.integers(0xD800, 0xDFFF).map(chr)


def _c(keys: list[str]) -> list[tuple[int, bytes]]:
    hashes, idents = residency_keys(keys)
    assert hashes.dtype == np.uint64 and len(idents) == 16 * len(keys)
    return [(h, idents[16 * i:16 * i + 16]) for i, h in enumerate(hashes.tolist())]


def _agree(keys: list[str]) -> None:
    want = [residency_key(k) for k in keys]
    for h, ident in want:
        assert 0 <= h < 1 << 64 and len(ident) == 16
    assert _c(keys) == want
    assert [residency_key1(k) for k in keys] == want


@given(st.binary(max_size=300), st.integers(1, 64))
def test_c_blake2b_equals_hashlib(data, digest_size):
    assert blake2b(data, digest_size) == hashlib.blake2b(data, digest_size=digest_size).digest()


@pytest.mark.parametrize("n", [0, 1, 63, 64, 127, 128, 129, 255, 256, 257, 1000])
def test_c_blake2b_block_boundaries(n):
    data = bytes((i * 131 + 7) % 256 for i in range(n))
    for size in (1, 24, 32, 64):
        assert blake2b(data, size) == hashlib.blake2b(data, digest_size=size).digest(), (n, size)
    with pytest.raises(ValueError, match="digest_size"):
        blake2b(data, 65)


@given(st.lists(st.text(ANY_CHAR | SURROGATE, max_size=80), max_size=30))
def test_arbitrary_text_agrees(keys):
    _agree(keys)


def test_surrogates_and_wide_characters_agree():
    keys = ["\ud800", "\udfff", "a\ud83d\ude00b", "\U0001f600", "é" * 3, "\x00", "\u07ff\u0800\uffff\U00010000",
            "x" * 4096, "\ud800" * 500 + "y", ""]
    _agree(keys)
    # a surrogate pair written as two code points is not the astral character: 6 bytes, not 4
    assert residency_key("\ud83d\ude00") != residency_key("\U0001f600")


@st.composite
def kv_like(draw):
    """kv: keys, valid (any case) or with one defect."""
    h = draw(st.text(st.sampled_from(HEX), min_size=16, max_size=16))
    ident = draw(st.text(st.sampled_from(HEX), min_size=32, max_size=32))
    key = f"kv:{h}:{ident}"
    defect = draw(st.sampled_from(["none", "char", "drop", "add", "sep", "prefix"]))
    pos = draw(st.integers(0, len(key) - 1))
    if defect == "char":
        bad = draw(st.sampled_from(["g", "G", " ", "_", "-", "+", "x", "\t", "\u0663", "\uff41", "\ud800", "\x00"]))
        key = key[:pos] + bad + key[pos + 1:]
    elif defect == "drop":
        key = key[:pos] + key[pos + 1:]
    elif defect == "add":
        key = key[:pos] + draw(st.sampled_from(HEX)) + key[pos:]
    elif defect == "sep":
        key = key[:19] + draw(st.sampled_from(["-", ";", "0", "\u0703"])) + key[20:]
    elif defect == "prefix":
        key = draw(st.sampled_from(["KV:", "kV:", "kv;", "kw:"])) + key[3:]
    return key


@given(st.lists(kv_like(), max_size=20))
def test_kv_shaped_keys_agree(keys):
    _agree(keys)


def test_kv_parse_and_almost_valid_forms():
    ident = bytes(range(16))
    good = kv_object_key(0xDEADBEEF, ident)
    upper = good.upper().replace("KV:", "kv:")  # another object to the master: hashed, not parsed
    d = hashlib.blake2b(upper.encode(), digest_size=24).digest()
    assert _c([good, upper]) == [(0xDEADBEEF, ident), (int.from_bytes(d[:8], "big"), d[8:])]
    # forms int()/bytes.fromhex would accept (sign, 0x, underscore, whitespace, Arabic-Indic digit) are hashed
    odd = ["kv:-000000000000001:" + "00" * 16, "kv:0x00000000000001:" + "00" * 16, "kv:0000_00000000001:" + "00" * 16,
           "kv: 000000000000001:" + "00" * 16, "kv:000000000000000\u0663:" + "00" * 16,
           "kv:0000000000000001:" + "00" * 15 + " 0", "kv:+000000000000001:" + "00" * 16]
    _agree(odd)
    for k in odd:
        assert residency_key(k) == (int.from_bytes(hashlib.blake2b(k.encode("utf-8", "surrogatepass"),
                                                                   digest_size=24).digest()[:8], "big"),
                                    hashlib.blake2b(k.encode("utf-8", "surrogatepass"), digest_size=24).digest()[8:])


def test_repeats_iterables_and_bad_keys():
    a, b = "alpha", "kv:" + "0" * 16 + ":" + "f" * 32
    keys = [a, a, a, b, b, a]  # one per replica, consecutively
    assert _c(keys) == [residency_key(k) for k in keys]
    assert _c(tuple(keys)) == _c(list(k for k in keys))
    h, ident = residency_keys([])
    assert h.shape == (0,) and ident == b""
    with pytest.raises(TypeError, match=r"keys\[1\] must be str, got int"):
        residency_keys(["ok", 7])
    with pytest.raises(TypeError, match="key must be str, got bytes"):
        residency_key1(b"k")


def _contents(index, keys):
    return [sorted(map(repr, rows)) for rows in index.locate([residency_key(k)[0] for k in keys])]


def _columns(n_keys: int, replicas: int):
    keys, nodes, tiers, segs, offs, sizes = [], [], [], [], [], []
    for i in range(n_keys):
        key = f"obj-{i}" if i % 3 else kv_object_key(i * 7919, i.to_bytes(16, "big"))
        for r in range(replicas):
            keys.append(key)
            nodes.append(f"node-{r}")
            tiers.append(CacheTier.DRAM if r == 0 else CacheTier.SSD)
            segs.append(r)
            offs.append(i * 4096)
            sizes.append(4096)
    return keys, nodes, tiers, segs, offs, sizes


@pytest.mark.parametrize("replicas", [1, 2])
def test_add_columns_lists_arrays_and_add_write_the_same(replicas):
    keys, nodes, tiers, segs, offs, sizes = _columns(200, replicas)
    written = []
    for how in ("lists", "arrays", "add"):
        index = open_index("art", None)
        try:
            proj = IndexProjection(index)
            if how == "lists":
                proj.add_columns(keys, nodes, tiers, segs, offs, sizes)
            elif how == "arrays":
                proj.add_columns(keys, nodes, np.array(tiers, np.uint8), np.array(segs, np.int64),
                                 np.array(offs, np.uint64), np.array(sizes, np.int32))
            else:
                for i in range(0, len(keys), replicas):
                    proj.add(keys[i], zip(nodes[i:i + replicas], tiers[i:i + replicas], segs[i:i + replicas],
                                          offs[i:i + replicas], sizes[i:i + replicas]))
            proj.publish()
            written.append(_contents(index, keys))
        finally:
            index.close()
    assert written[0] == written[1] == written[2]
    assert sum(len(r) for r in written[0]) == len(keys) * replicas  # each key's rows, once per lookup of it


def test_queued_order_is_kept_across_add_and_add_columns():
    index = open_index("art", None)
    try:
        proj = IndexProjection(index)
        proj.add("k", [("n", CacheTier.DRAM, 0, 0, 64)])
        proj.add_columns(["k", "j"], ["n", "n"], [CacheTier.DRAM] * 2, [0, 0], [128, 256], [64, 64])
        proj.add("j", [("n", CacheTier.DRAM, 0, 512, 64)])
        proj.drop("k", [("n", CacheTier.DRAM)])
        proj.add_columns(["k"], ["n"], np.array([1], np.uint8), np.array([0]), np.array([1024]), np.array([32]))
        proj.publish()
        [[k_row], [j_row]] = index.locate([residency_key("k")[0], residency_key("j")[0]])
        assert (k_row.offset_bytes, k_row.size_bytes, j_row.offset_bytes) == (1024, 32, 512)
    finally:
        index.close()


def test_bad_columns_are_refused_and_nothing_is_lost():
    index = open_index("art", None)
    try:
        proj = IndexProjection(index)
        proj.add_columns(["a"], ["n"], [1], [0], [0], [64])
        with pytest.raises(ValueError, match="2 keys but 1 node names"):
            proj.add_columns(["b", "c"], ["n"], [1, 1], [0, 0], [0, 0], [64, 64])
        with pytest.raises(ValueError, match=r"segments is a uint32 array of shape \(3,\), expected"):
            proj.add_columns(["b", "c"], ["n", "n"], [1, 1], np.zeros(3, np.uint32), [0, 0], [64, 64])
        with pytest.raises(ValueError, match="segments is a float64 array"):
            proj.add_columns(["b", "c"], ["n", "n"], [1, 1], np.zeros(2), [0, 0], [64, 64])
        with pytest.raises(ValueError, match="offsets has 1 values, expected 2"):
            proj.add_columns(["b", "c"], ["n", "n"], [1, 1], [0, 0], [0], [64, 64])
        with pytest.raises(ValueError, match=r"segments has a value out of range \[0, 4294967295\] \(min -1"):
            proj.add_columns(["d"], ["n"], [1], np.array([-1], np.int64), [0], [64])
        with pytest.raises(ValueError, match="sizes has a value out of range"):
            proj.add_columns(["d"], ["n"], [1], [0], [0], np.array([1 << 40]))
        proj.publish()
        assert [len(r) for r in index.locate([residency_key(k)[0] for k in "abcd"])] == [1, 0, 0, 0]
        proj.add_columns(["e"], ["n"], np.array([9], np.uint8), [0], [0], [64])  # no such tier: the index refuses
        with pytest.raises(IndexKeyError, match="tiers has a value out of range"):
            proj.publish()
        assert [len(r) for r in index.locate([residency_key(k)[0] for k in "ae"])] == [1, 0]
    finally:
        index.close()


def test_publish_missing_over_column_chunks():
    keys, nodes, tiers, segs, offs, sizes = _columns(50, 2)
    index = open_index("art", None)
    try:
        for expect in ((100, 0), (0, 100)):
            proj = IndexProjection(index)
            proj.add_columns(keys[:40], nodes[:40], tiers[:40], segs[:40], offs[:40], sizes[:40])
            proj.add(keys[40], zip(nodes[40:42], tiers[40:42], segs[40:42], offs[40:42], sizes[40:42]))
            proj.add_columns(keys[42:], nodes[42:], np.array(tiers[42:], np.uint8), np.array(segs[42:]),
                             np.array(offs[42:]), np.array(sizes[42:]))
            assert proj.publish_missing() == expect
        assert sum(len(r) for r in index.locate([residency_key(k)[0] for k in keys[::2]])) == 100
    finally:
        index.close()
