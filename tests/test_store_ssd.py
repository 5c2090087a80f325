"""SsdTier on the real file system and on CrashFs: API, bad input, recovery, reconcile, and a
stateful Hypothesis test against a dict model (with close/reopen)."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quillcache.index import open_index
from quillcache.durability.crashfs import CrashFs
from quillcache.store.errors import (
    BlockExistsError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    ForeignFileError,
    StoreClosedError,
    StoreFullError,
)
from quillcache.store.keys import StoreKey
from quillcache.store.reconcile import reconcile_index
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

LAYOUTS = ("slab", "files")
SMALL = dict(slab_bytes=256 << 10, log_rotate_bytes=8 << 10)


def key(i: int, ident: int = 7) -> StoreKey:
    return StoreKey(i, bytes([ident]) * 16)


def content(k: StoreKey, n: int) -> bytes:
    return random.Random(k.to_bytes()).randbytes(n)


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


def test_put_get_delete_reopen(tmp_path, layout):
    d = tmp_path / "tier"
    with SsdTier(d, capacity_bytes=4 << 20, layout=layout, **SMALL) as t:
        assert t.recovery.created and t.layout == layout
        t.put(key(1), content(key(1), 5000))
        t.put_many([(key(i), content(key(i), 100 * i)) for i in range(2, 10)])
        fired = []
        t.put_async(key(10), memoryview(content(key(10), 777)), lambda k, e: fired.append((k, e)))
        assert key(10) in t and fired == []
        t.flush()
        assert fired == [(key(10), None)]
        t.delete(key(3))
        assert key(3) not in t and len(t) == 9
        assert t.get(key(1)) == content(key(1), 5000)
        out = bytearray(6000)
        assert t.get_into(key(1), memoryview(out)) == 5000 and bytes(out[:5000]) == content(key(1), 5000)
        assert t.size_of(key(2)) == 200
        seg, off, size = t.location_of(key(2))
        assert size == 200 and off >= 0 and seg >= 0
        assert t.used_bytes + t.free_bytes == t.capacity_bytes
        t.put_async(key(11), b"x" * 10)  # pending at close: close commits it
    t = SsdTier(d, capacity_bytes=4 << 20)
    assert not t.recovery.created and t.recovery.layout == layout and t.recovery.clean, t.recovery
    assert sorted(k.block_hash for k in t.keys()) == [1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    for i in (1, 2, 4, 5, 6, 7, 8, 9, 10):
        assert t.get(key(i)) == content(key(i), t.size_of(key(i)))
    assert t.get(key(11)) == b"x" * 10
    t.close()
    with pytest.raises(StoreClosedError):
        t.get(key(1))
    t.close()  # idempotent


def test_bad_input(tmp_path, layout):
    t = SsdTier(tmp_path / "t", capacity_bytes=1 << 20, layout=layout, **SMALL)
    with pytest.raises(BlockTooLargeError, match="exceeds"):
        t.put(key(1), bytes((1 << 20) + 1))
    with pytest.raises(ValueError, match="empty"):
        t.put(key(1), b"")
    with pytest.raises(TypeError, match="StoreKey"):
        t.put((1, b"x" * 16), b"data")
    with pytest.raises(TypeError, match="bytes"):
        t.put(key(1), "a string")
    with pytest.raises(TypeError, match="pairs"):
        t.put_many([key(1)])
    with pytest.raises(BlockNotFoundError, match=key(99).hex()):
        t.get(key(99))
    with pytest.raises(KeyError):
        t.delete(key(99))
    t.put(key(1), b"abc")
    with pytest.raises(BlockExistsError, match=key(1).hex()):
        t.put(key(1), b"abc")
    with pytest.raises(BlockExistsError, match="twice"):
        t.put_many([(key(2), b"a"), (key(2), b"b")])
    assert key(2) not in t  # nothing of a refused batch is stored
    with pytest.raises(ValueError, match="needs 3"):
        t.get_into(key(1), memoryview(bytearray(2)))
    with pytest.raises(ValueError, match="writable"):
        t.get_into(key(1), memoryview(b"readonly"))
    with pytest.raises(TypeError, match="callable"):
        t.put_async(key(3), b"x", callback=5)
    t.close()
    with pytest.raises(TypeError, match="unknown SsdTier tuning"):
        SsdTier(tmp_path / "u", capacity_bytes=1 << 20, bogus=1)
    with pytest.raises(ValueError, match="capacity_bytes=10"):
        SsdTier(tmp_path / "u", capacity_bytes=10)
    with pytest.raises(TypeError, match="capacity_bytes"):
        SsdTier(tmp_path / "u", capacity_bytes=1.5e6)
    with pytest.raises(ValueError, match="layout="):
        SsdTier(tmp_path / "u", capacity_bytes=1 << 20, layout="btree")
    other = "files" if layout == "slab" else "slab"
    with pytest.raises(ValueError, match=f"holds a '{layout}'"):
        SsdTier(tmp_path / "t", capacity_bytes=1 << 20, layout=other)


def test_full_tier_keeps_serving(tmp_path, layout):
    t = SsdTier(tmp_path / "t", capacity_bytes=256 << 10, layout=layout, **SMALL)
    stored = []
    with pytest.raises(StoreFullError, match="no room"):
        for i in range(1000):
            t.put(key(i), content(key(i), 20000))
            stored.append(i)
    assert stored and all(t.get(key(i)) == content(key(i), 20000) for i in stored)
    with pytest.raises(StoreFullError):
        t.put_many([(key(5000 + i), content(key(i), 20000)) for i in range(5)])
    assert all(key(5000 + i) not in t for i in range(5))
    t.delete(key(stored[0]))
    t.put(key(4000), content(key(4000), 20000))  # the delete's space is reusable
    assert t.healthy
    t.close()


def test_foreign_directory_refused_and_foreign_files_reported(tmp_path, layout):
    d = tmp_path / "notours"
    d.mkdir()
    (d / "precious.txt").write_text("do not touch")
    with pytest.raises(ForeignFileError, match="precious.txt"):
        SsdTier(d, capacity_bytes=1 << 20)
    assert (d / "precious.txt").read_text() == "do not touch"
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ForeignFileError, match="not a directory"):
        SsdTier(f, capacity_bytes=1 << 20)
    t = SsdTier(tmp_path / "t", capacity_bytes=1 << 20, layout=layout, **SMALL)
    t.put(key(1), b"one")
    t.close()
    (tmp_path / "t" / "notes.md").write_text("mine")
    (tmp_path / "t" / "slab-1.qcs").write_text("looks like ours but is not")
    t = SsdTier(tmp_path / "t", capacity_bytes=1 << 20)
    assert set(t.recovery.foreign_files) == {"notes.md", "slab-1.qcs"}
    assert t.get(key(1)) == b"one"
    t.close()
    assert (tmp_path / "t" / "notes.md").read_text() == "mine"


def _stored_files(d, layout):
    names = sorted(os.listdir(d))
    return [d / n for n in names if n.endswith(".qcs" if layout == "slab" else ".qco")]


def test_corrupt_object_detected_on_read_and_at_recovery(tmp_path, layout):
    d = tmp_path / "t"
    t = SsdTier(d, capacity_bytes=1 << 20, layout=layout, **SMALL)
    t.put(key(1), content(key(1), 3000))
    t.put(key(2), content(key(2), 3000))
    seg, off, size = t.location_of(key(1))
    path = d / (f"slab-{seg:05d}.qcs" if layout == "slab" else f"o-{seg:08x}.qco")
    with open(path, "r+b") as fh:  # bit rot under a running tier
        fh.seek(off + 100)
        b = fh.read(1)
        fh.seek(off + 100)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptBlockError, match=key(1).hex()):
        t.get(key(1))
    with pytest.raises(BlockNotFoundError):
        t.get(key(1))  # dropped
    out = bytearray(3000)
    assert t.get_into(key(2), memoryview(out)) == 3000 and bytes(out) == content(key(2), 3000)
    t.close()
    t = SsdTier(d, capacity_bytes=1 << 20)
    assert key(1) not in t and t.get(key(2)) == content(key(2), 3000)
    t.close()
    # corrupt key 2 while closed: recovery drops it and says why
    seg, off, _ = SsdTier(d, capacity_bytes=1 << 20).location_of(key(2))
    path = d / (f"slab-{seg:05d}.qcs" if layout == "slab" else f"o-{seg:08x}.qco")
    with open(path, "r+b") as fh:
        fh.seek(off + 5)
        b = fh.read(1)
        fh.seek(off + 5)
        fh.write(bytes([b[0] ^ 0x80]))
    t = SsdTier(d, capacity_bytes=1 << 20)
    assert key(2) not in t and any("crc32c" in why for _, why in t.recovery.dropped), t.recovery
    t.close()


def test_temp_files_swept(tmp_path):
    fs = CrashFs()
    fs.mkdir("/x")
    t = SsdTier("/x/t", capacity_bytes=1 << 20, fs=fs, layout="files")
    t.put_async(key(1), b"pending")  # a temp object file exists until the commit
    disk = fs.snapshot()
    t2 = SsdTier("/x/t", capacity_bytes=1 << 20, fs=disk)
    assert key(1) not in t2 and t2.recovery.swept_temp_files == ("o-00000001.tmp",)
    assert disk.listdir("/x/t") == ["quillcache-ssd.meta"]


@pytest.mark.parametrize("kind", ["flat", "art"])
def test_reconcile_index(tmp_path, kind):
    idx = open_index(kind, tmp_path / "idx" if kind == "art" else None)
    t = SsdTier(tmp_path / "t", capacity_bytes=1 << 20, **SMALL)
    for i in range(1, 6):
        t.put(key(i), content(key(i), 1000 + i))
    locs = t.locations()
    from quillcache.index import ResidencyEntry

    stale = ResidencyEntry(99, "n0", CacheTier.SSD, key(99).identity, 0, 0, 10)  # tier lost it
    moved = ResidencyEntry(1, "n0", CacheTier.SSD, key(1).identity, 7, 7, 7)  # wrong location
    other_tier = ResidencyEntry(98, "n0", CacheTier.DRAM, key(98).identity, 0, 0, 10)
    other_node = ResidencyEntry(97, "n1", CacheTier.SSD, key(97).identity, 0, 0, 10)
    s, o, z = locs[key(2)]
    good = ResidencyEntry(2, "n0", CacheTier.SSD, key(2).identity, s, o, z)
    idx.put([stale, moved, other_tier, other_node, good])
    rep = reconcile_index(idx, "n0", CacheTier.SSD, locs)
    assert (rep.kept, rep.removed, rep.added, rep.updated) == (1, 1, 3, 1)
    got = {(e.block_hash, e.tier): (e.segment_id, e.offset_bytes, e.size_bytes) for e in idx.entries_on_node("n0")}
    assert got == {**{(k.block_hash, CacheTier.SSD): v for k, v in locs.items()}, (98, CacheTier.DRAM): (0, 0, 10)}
    assert [e.block_hash for e in idx.entries_on_node("n1")] == [97]
    again = reconcile_index(idx, "n0", CacheTier.SSD, locs)
    assert again.changed == 0 and again.kept == 5
    with pytest.raises(ValueError, match="node"):
        reconcile_index(idx, "", CacheTier.SSD, locs)
    with pytest.raises(TypeError, match="IndexBackend"):
        reconcile_index({}, "n0", CacheTier.SSD, locs)
    idx.close()
    t.close()


# ------------------------------------------------------------------ stateful model test
class TierMachine(RuleBasedStateMachine):
    """SsdTier (on CrashFs, clean close/reopen) against a dict model."""

    layout = "slab"

    def __init__(self) -> None:
        super().__init__()
        self.fs = CrashFs()
        self.fs.mkdir("/m")
        self.tier = SsdTier("/m/t", capacity_bytes=512 << 10, fs=self.fs, layout=self.layout,
                            slab_bytes=128 << 10, log_rotate_bytes=4 << 10, group_commit_blocks=3)
        self.model: dict[StoreKey, bytes] = {}
        self.used = 0

    keys_ = st.builds(key, st.integers(0, 40), st.sampled_from([1, 2]))
    sizes = st.integers(1, 40_000)

    def _data(self, k: StoreKey, n: int) -> bytes:
        return content(k, n)

    @rule(k=keys_, n=sizes)
    def put(self, k, n):
        data = self._data(k, n)
        if k in self.model:
            with pytest.raises(BlockExistsError):
                self.tier.put(k, data)
            return
        try:
            self.tier.put(k, data)
        except StoreFullError:
            assert k not in self.tier
            return
        self.model[k] = data

    @rule(ks=st.lists(keys_, min_size=1, max_size=4, unique=True), n=st.integers(1, 9000))
    def put_many(self, ks, n):
        if any(k in self.model for k in ks):
            with pytest.raises(BlockExistsError):
                self.tier.put_many([(k, self._data(k, n)) for k in ks])
            return
        try:
            self.tier.put_many([(k, self._data(k, n)) for k in ks])
        except StoreFullError:
            assert all(k not in self.tier for k in ks)
            return
        self.model.update({k: self._data(k, n) for k in ks})

    @rule(k=keys_, n=sizes)
    def put_async(self, k, n):
        if k in self.model:
            return
        fired = []
        try:
            self.tier.put_async(k, self._data(k, n), lambda kk, e: fired.append(e))
        except StoreFullError:
            return
        self.model[k] = self._data(k, n)

    @rule()
    def flush(self):
        self.tier.flush()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        k = data.draw(st.sampled_from(sorted(self.model, key=lambda k: k.to_bytes())))
        self.tier.delete(k)
        del self.model[k]

    @rule(k=keys_)
    def get(self, k):
        if k in self.model:
            assert self.tier.get(k) == self.model[k]
        else:
            with pytest.raises(BlockNotFoundError):
                self.tier.get(k)

    @rule()
    def reopen(self):
        self.tier.close()
        self.tier = SsdTier("/m/t", capacity_bytes=512 << 10, fs=self.fs, log_rotate_bytes=4 << 10,
                            group_commit_blocks=3)
        assert self.tier.recovery.clean, self.tier.recovery

    @invariant()
    def agrees(self):
        assert set(self.tier.keys()) == set(self.model)
        assert len(self.tier) == len(self.model)
        assert 0 <= self.tier.used_bytes <= self.tier.capacity_bytes

    def teardown(self):
        self.tier.close()


class FilesTierMachine(TierMachine):
    layout = "files"


TestSlabTierModel = TierMachine.TestCase
TestSlabTierModel.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestFilesTierModel = FilesTierMachine.TestCase
TestFilesTierModel.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


@given(st.lists(st.integers(1, 70_000), min_size=1, max_size=30), st.sampled_from(LAYOUTS))
@settings(max_examples=30, deadline=None)
def test_random_sizes_roundtrip(sizes, layout):
    fs = CrashFs()
    fs.mkdir("/r")
    t = SsdTier("/r/t", capacity_bytes=1 << 20, fs=fs, layout=layout, slab_bytes=256 << 10)
    kept = {}
    for i, n in enumerate(sizes):
        try:
            t.put(key(i), content(key(i), n))
            kept[i] = n
        except StoreFullError:
            pass
    t.close()
    t = SsdTier("/r/t", capacity_bytes=1 << 20, fs=fs)
    assert {k.block_hash for k in t.keys()} == set(kept)
    assert all(t.get(key(i)) == content(key(i), n) for i, n in kept.items())
    t.close()


def test_account_only_tier_bookkeeping_grows_with_use_not_with_declared_capacity():
    from quillcache.store.keys import StoreKey
    from quillcache.store.ssd import SsdTier

    tier = SsdTier(None, capacity_bytes=1 << 52, account_only=True)  # 4 PiB declared
    for i in range(32):
        tier.put(StoreKey(i + 1, b"\x04" * 16), b"q" * 4096)
    assert len(tier._layout.slabs) == 1
    assert tier.free_bytes == (1 << 52) - 32 * 4096
    tier.close()
