"""``IndexBackend.put_columns`` (the residency index's bulk put, used by the master's ``put_end``) against its
reference, ``put`` of one ``ResidencyEntry`` per replica: on every backend the two write exactly the same records
(primary, secondary and node-name keys) and return the same count, for any replicas Hypothesis draws, and a
persistent backend reopened gives them back (ART's columnar write logs its own WAL payload); a bad column
is refused with ``IndexKeyError`` naming it and writes nothing (not even a node name)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.index import INDEX_BACKENDS, IndexKeyError, ResidencyEntry, open_index
from quillcache.types import CacheTier

KINDS = sorted(INDEX_BACKENDS)

entries = st.lists(st.builds(
    ResidencyEntry,
    block_hash=st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**64 - 1]),
    node=st.sampled_from(["n0", "n1", "node-10", "ünï"]),
    tier=st.sampled_from(list(CacheTier)),
    identity=st.binary(min_size=16, max_size=16),
    segment_id=st.integers(0, 2**32 - 1),
    offset_bytes=st.integers(0, 2**64 - 1),
    size_bytes=st.integers(0, 2**32 - 1),
), max_size=40)


def columns(es: list[ResidencyEntry]) -> dict:
    return dict(block_hashes=np.array([e.block_hash for e in es], dtype=np.uint64),
                identities=b"".join(e.identity for e in es), nodes=[e.node for e in es],
                tiers=np.array([int(e.tier) for e in es], dtype=np.uint8),
                segment_ids=np.array([e.segment_id for e in es], dtype=np.uint32),
                offsets_bytes=np.array([e.offset_bytes for e in es], dtype=np.uint64),
                sizes_bytes=np.array([e.size_bytes for e in es], dtype=np.uint32))


def dump(ix) -> list:
    return ix._raw_scan(b"")


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None)
@given(first=entries, second=entries)
def test_put_columns_writes_what_put_writes(kind, tmp_path_factory, first, second):
    base = tmp_path_factory.mktemp(kind)
    ref, bulk = open_index(kind, base / "ref"), open_index(kind, base / "bulk")
    try:
        for batch in (first, second):  # the second batch meets interned names and replaces replicas
            assert bulk.put_columns(**columns(batch)) == ref.put(batch) == len(batch)
            assert dump(bulk) == dump(ref)
        hs = np.array(sorted({e.block_hash for e in first + second}), dtype=np.uint64)
        a, b = bulk.locate_arrays(hs), ref.locate_arrays(hs)
        assert np.array_equal(a.offsets, b.offsets) and a.keys.tobytes() == b.keys.tobytes()
        assert a.values.tobytes() == b.values.tobytes()
        want = dump(ref)  # every backend persists under its path: what put_columns wrote comes back after a reopen
        bulk.close()
        bulk = open_index(kind, base / "bulk")
        assert dump(bulk) == want
    finally:
        ref.close()
        bulk.close()


@pytest.mark.parametrize("field, value, match", [
    ("block_hashes", np.array([1, 2], dtype=np.int64), "block_hashes must be a uint64 array of 2"),
    ("identities", b"\x00" * 31, "identities must be 2 x 16 bytes, got 31"),
    ("tiers", np.array([0, 9], dtype=np.uint8), r"tiers has a value out of range \[0, "),
    ("segment_ids", np.array([0, -1], dtype=np.int64), r"segment_ids has a value out of range"),
    ("sizes_bytes", np.array([0, 2**32], dtype=np.int64), r"sizes_bytes has a value out of range"),
    ("offsets_bytes", np.array([0.5, 1.0]), "offsets_bytes must be an integer array"),
    ("nodes", ["ok-new", ""], "node name must be a non-empty str"),
    ("nodes", ["only-one"], "must be a uint64 array of 1"),
])
def test_bad_columns_are_refused_and_nothing_is_written(tmp_path, field, value, match):
    ix = open_index("art", tmp_path / "ix")
    try:
        good = [ResidencyEntry(1, "n0", CacheTier.DRAM, bytes(16), 0, 0, 64),
                ResidencyEntry(2, "n0", CacheTier.SSD, b"\x01" * 16, 1, 4096, 64)]
        cols = columns(good)
        cols[field] = value
        with pytest.raises(IndexKeyError, match=match):
            ix.put_columns(**cols)
        assert dump(ix) == [] and ix.nodes() == []
        assert ix.put_columns(**columns(good)) == 2 and [len(r) for r in ix.locate([1, 2])] == [1, 1]
    finally:
        ix.close()
