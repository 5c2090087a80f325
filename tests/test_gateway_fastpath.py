"""The gateway's per-request fast paths keep behaviour: ``ResidencyTracker.speculate`` writes its new entries in
one ``put_columns`` batch (from ``_COLUMNS_MIN`` entries), which must leave the index exactly as the per-entry
``put`` (the reference) does, and refuse a bad hash or digest as ``put`` does."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from quillcache.gateway import residency
from quillcache.gateway.residency import ResidencyTracker
from quillcache.index import open_index
from quillcache.index.keys import IndexKeyError

ENGINES = {"e0": "events", "a0": "approximate"}


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _entries(index, engine: str) -> list[tuple]:
    return sorted((e.block_hash, e.node, int(e.tier), e.identity, e.segment_id, e.offset_bytes, e.size_bytes)
                  for e in index.entries_on_node(engine))


class _Spy:
    """Counts an index's ``put`` and ``put_columns`` calls (and the entries each wrote)."""

    def __init__(self, index) -> None:
        self.calls: list[tuple[str, int]] = []
        put, cols = index.put, index.put_columns

        def spy_put(entries):
            entries = list(entries)
            self.calls.append(("put", len(entries)))
            return put(entries)

        def spy_cols(block_hashes, *rest):
            self.calls.append(("put_columns", len(block_hashes)))
            return cols(block_hashes, *rest)

        index.put, index.put_columns = spy_put, spy_cols


@pytest.mark.parametrize("mode", ["events", "approximate"])
def test_speculate_writes_new_entries_in_one_columnar_batch(mode):
    index = open_index("art")
    spy = _Spy(index)
    tr = ResidencyTracker(index, {"e0": mode}, clock=_Clock())
    digest = os.urandom(16)
    hashes = np.arange(1, 21, dtype=np.uint64)
    recs = tr.speculate("e0", hashes, [digest] * 20, reused_blocks=2)
    assert len(recs) == 18
    assert spy.calls == [("put_columns", 18)]  # one batch, no per-entry ResidencyEntry objects
    assert {e[0] for e in _entries(index, "e0")} == set(range(3, 21))
    tr.check()
    # a few entries (under _COLUMNS_MIN) still go through put
    spy.calls.clear()
    tr.speculate("e0", np.arange(100, 103, dtype=np.uint64), [digest] * 3)
    assert spy.calls == [("put", 3)]
    tr.check()


@pytest.mark.parametrize("kind", ["art", "flat"])
def test_columnar_writes_match_the_per_entry_reference_on_random_batches(kind, monkeypatch):
    """The same random speculations (repeats, partly reused prefixes, two scopes in one batch, numpy and list
    hashes, a nonzero block size) through the fast path and through ``put`` alone: same index, same entries."""
    rng = random.Random(7)
    digests = [os.urandom(16) for _ in range(3)]
    ops = []
    for _ in range(60):
        n = rng.choice([1, 5, 7, 8, 9, 30, 200])
        hashes = [rng.randrange(1 << 64) if rng.random() < 0.7 else rng.randrange(50) for _ in range(n)]
        ds = [rng.choice(digests[:2]) for _ in range(n)] if rng.random() < 0.3 else [rng.choice(digests)] * n
        ops.append((rng.choice(list(ENGINES)), hashes, ds, rng.randrange(n + 1), rng.random() < 0.5))

    def run(columns_min: int):
        monkeypatch.setattr(residency, "_COLUMNS_MIN", columns_min, raising=False)
        index = open_index(kind)
        clock = _Clock()
        tr = ResidencyTracker(index, ENGINES, clock=clock, block_bytes=4096, approx_capacity_blocks={"a0": 500})
        for engine, hashes, ds, reused, as_array in ops:
            clock.t += 0.5  # some speculations expire between batches
            tr.expire()
            tr.speculate(engine, np.array(hashes, dtype=np.uint64) if as_array else hashes, ds, reused_blocks=reused)
        tr.check()
        return {e: _entries(index, e) for e in ENGINES}, tr.stats.counts()

    fast = run(8)
    reference = run(1 << 30)  # every write through put
    assert fast == reference
    assert sum(len(v) for v in fast[0].values()) > 500


@pytest.mark.parametrize("bad", [-1, 1 << 64])
def test_a_bad_hash_in_a_large_batch_is_refused_naming_it(bad):
    tr = ResidencyTracker(open_index("art"), {"e0": "events"}, clock=_Clock())
    with pytest.raises(IndexKeyError, match="block hash"):
        tr.speculate("e0", list(range(1, 12)) + [bad], [os.urandom(16)] * 12)


def test_a_bad_digest_in_a_large_batch_is_refused_naming_it():
    tr = ResidencyTracker(open_index("art"), {"e0": "events"}, clock=_Clock())
    digests = [os.urandom(16)] * 11 + [b"short"]
    with pytest.raises(IndexKeyError, match="identity must be a 16-byte digest"):
        tr.speculate("e0", np.arange(1, 13, dtype=np.uint64), digests)
