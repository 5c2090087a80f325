"""LocalKvStore: round trips, zero-copy reads, typed errors, checksums, all-or-nothing batches,
and a stateful Hypothesis test against a dict reference."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from quillcache.store.dram import LocalKvStore, Location, as_byte_view
from quillcache.store.errors import (
    BlockExistsError,
    BlockNotFoundError,
    BlockTooLargeError,
    CorruptBlockError,
    StoreClosedError,
    StoreFullError,
)
from quillcache.store.keys import StoreKey

IDENT = bytes(range(16))


def K(h: int) -> StoreKey:
    return StoreKey(h, IDENT)


def test_round_trip_of_every_buffer_kind():
    s = LocalKvStore(1 << 20, segment_bytes=1 << 18)
    arr = np.arange(24, dtype=np.float16).reshape(4, 6)
    cases = {
        K(1): b"hello world",
        K(2): bytearray(b"\x00\xff" * 100),
        K(3): memoryview(b"abcdef")[1:4],
        K(4): arr,
        K(5): np.arange(1000, dtype=np.uint8),
    }
    for k, data in cases.items():
        loc = s.put(k, data)
        assert isinstance(loc, Location) and loc == s.location_of(k)
        assert loc.size_bytes == memoryview(data).nbytes
    for k, data in cases.items():
        view = s.get(k)
        assert view.readonly and view.format == "B"
        assert bytes(view) == memoryview(data).tobytes()
    assert len(s) == 5 and set(s.keys()) == set(cases) and K(4) in s and K(9) not in s
    assert s.stored_bytes == sum(memoryview(d).nbytes for d in cases.values())
    assert s.used_bytes + s.free_bytes == s.capacity_bytes
    out = bytearray(100)
    assert s.get_into(K(4), out) == 48 and bytes(out[:48]) == arr.tobytes()
    assert [bytes(v) for v in s.get_many([K(1), K(3)])] == [b"hello world", b"bcd"]


def test_get_is_a_zero_copy_view_and_put_copies():
    s = LocalKvStore(1 << 16, segment_bytes=1 << 15)
    src = np.arange(4096, dtype=np.uint8)
    loc = s.put(K(7), src)
    src[:] = 0  # the store holds its own copy
    view = s.get(K(7))
    seg = s._segment_array(loc.segment_id)
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), seg)
    assert bytes(view) == np.arange(4096, dtype=np.uint8).tobytes()
    with pytest.raises(TypeError):
        view[0] = 1  # read-only


def test_ranges_are_aligned_and_disjoint():
    s = LocalKvStore(1 << 16, alignment_bytes=256)
    locs = [s.put(K(i), b"x" * (100 + i)) for i in range(20)]
    assert all(loc.offset_bytes % 256 == 0 for loc in locs)
    spans = sorted((loc.offset_bytes, loc.offset_bytes + loc.size_bytes) for loc in locs)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    assert s.used_bytes == 20 * 256


def test_typed_errors_name_key_and_sizes():
    s = LocalKvStore(4096, segment_bytes=2048)
    s.put(K(1), b"a" * 1000)
    with pytest.raises(BlockExistsError, match=K(1).hex()):
        s.put(K(1), b"b")
    with pytest.raises(BlockTooLargeError, match=r"2049 bytes.*2048 bytes"):
        s.put(K(2), b"z" * 2049)
    s.put(K(2), b"b" * 2048)
    s.put(K(3), b"c" * 1000)
    with pytest.raises(StoreFullError, match=r"no room for block .* 1000 bytes in DRAM: 0 of 4096 bytes free"):
        s.put(K(4), b"d" * 1000)
    with pytest.raises(BlockNotFoundError, match=K(9).hex()):
        s.get(K(9))
    with pytest.raises(KeyError):  # BlockNotFoundError is also a KeyError
        s.delete(K(9))
    with pytest.raises(TypeError, match="key must be a StoreKey, got int"):
        s.get(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got str"):
        s.put(K(5), "text")
    with pytest.raises(TypeError, match="bytes-like buffer, got list"):
        s.put(K(5), [1, 2, 3])
    with pytest.raises(ValueError, match="non-contiguous"):
        s.put(K(5), np.arange(10, dtype=np.uint8)[::2])
    with pytest.raises(ValueError, match="empty"):
        s.put(K(5), b"")
    with pytest.raises(ValueError, match="out holds 10 bytes"):
        s.get_into(K(1), bytearray(10))
    with pytest.raises(ValueError, match="read-only"):
        s.get_into(K(1), bytes(2000))
    # nothing above changed the store
    assert len(s) == 3 and bytes(s.get(K(1))) == b"a" * 1000 and s.used_bytes == 4096  # 1000 rounds up to 1024
    s.delete(K(2))
    s.put(K(4), b"d" * 1000)  # room again after a delete
    assert bytes(s.get(K(4))) == b"d" * 1000


@pytest.mark.parametrize("kwargs, match", [
    ({"capacity_bytes": 0}, "capacity_bytes=0 must be >= 1"),
    ({"capacity_bytes": 1000}, "not a multiple of alignment_bytes=64"),
    ({"capacity_bytes": 4096, "alignment_bytes": 48}, "alignment_bytes=48 must be a power of two"),
    ({"capacity_bytes": 4096, "segment_bytes": 8192}, "segment_bytes=8192 exceeds capacity_bytes=4096"),
    ({"capacity_bytes": 4096, "max_blocks_per_segment": 0}, "max_blocks_per_segment=0"),
    ({"capacity_bytes": 4096.0}, "capacity_bytes must be an integer, got float"),
    ({"capacity_bytes": 4096, "checksum": 1}, "must be bool"),
])
def test_constructor_validation(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        LocalKvStore(**kwargs)


def test_uneven_last_segment_and_first_fit():
    s = LocalKvStore(5 * 1024, segment_bytes=2048)
    assert s.num_segments == 3 and s.capacity_bytes == 5 * 1024
    a = s.put(K(1), b"x" * 2048)
    b = s.put(K(2), b"y" * 1024)
    c = s.put(K(3), b"z" * 1024)
    assert (a.segment_id, b.segment_id, c.segment_id) == (0, 1, 1)
    with pytest.raises(BlockTooLargeError):
        s.put(K(4), b"w" * 2049)


def test_checksum_detects_corruption_and_drops_block():
    s = LocalKvStore(1 << 16, checksum=True)
    loc = s.put(K(1), b"q" * 500)
    s.put(K(2), b"r" * 500)
    assert bytes(s.get(K(1), verify=True)) == b"q" * 500
    s._segment_array(loc.segment_id)[loc.offset_bytes + 17] ^= 0x40
    with pytest.raises(CorruptBlockError, match=rf"{K(1).hex()} failed its crc32c check"):
        s.get(K(1), verify=True)
    assert K(1) not in s and len(s) == 1  # never served again
    assert s.get_into(K(2), bytearray(500), verify=True) == 500
    plain = LocalKvStore(4096)
    plain.put(K(1), b"x")
    with pytest.raises(ValueError, match="checksum=True"):
        plain.get(K(1), verify=True)


def test_put_many_is_all_or_nothing():
    s = LocalKvStore(4096, segment_bytes=4096)
    s.put(K(0), b"0" * 1024)
    used = s.used_bytes
    with pytest.raises(StoreFullError):
        s.put_many([(K(1), b"1" * 1024), (K(2), b"2" * 1024), (K(3), b"3" * 1025)])
    assert len(s) == 1 and s.used_bytes == used
    with pytest.raises(BlockExistsError, match="repeated"):
        s.put_many([(K(1), b"1"), (K(1), b"1")])
    with pytest.raises(TypeError, match="item 0"):
        s.put_many([K(1)])  # type: ignore[list-item]
    locs = s.put_many([(K(1), b"1" * 1024), (K(2), b"2" * 1024)])
    assert [loc.size_bytes for loc in locs] == [1024, 1024] and len(s) == 3


def test_close_and_clear():
    s = LocalKvStore(4096)
    s.put(K(1), b"x")
    s.clear()
    assert len(s) == 0 and s.used_bytes == 0
    s.put(K(1), b"y")
    s.close()
    s.close()
    with pytest.raises(StoreClosedError):
        s.get(K(1))
    with pytest.raises(StoreClosedError):
        s.put(K(2), b"z")


def test_as_byte_view_casts_without_copy():
    a = np.ones((3, 5), dtype=np.float32)
    v = as_byte_view(a)
    assert v.format == "B" and v.nbytes == 60 and np.shares_memory(np.frombuffer(v, np.uint8), a)


class DramMachine(RuleBasedStateMachine):
    """Puts, deletes and reads against a dict; checks contents and range disjointness each step."""

    def __init__(self):
        super().__init__()
        self.store = LocalKvStore(8192, segment_bytes=4096, alignment_bytes=64, max_blocks_per_segment=16,
                                  checksum=True)
        self.ref: dict[StoreKey, bytes] = {}

    @rule(h=st.integers(0, 30), size=st.integers(1, 2000), fill=st.integers(0, 255))
    def put(self, h, size, fill):
        data = bytes([fill]) * (size - 1) + bytes([h])
        k = K(h)
        try:
            self.store.put(k, data)
        except BlockExistsError:
            assert k in self.ref
        except StoreFullError:
            assert k not in self.ref
        else:
            assert k not in self.ref
            self.ref[k] = data

    @rule(batch=st.lists(st.tuples(st.integers(31, 40), st.integers(1, 1500)), max_size=4, unique_by=lambda t: t[0]))
    def put_many(self, batch):
        items = [(K(h), bytes([h]) * n) for h, n in batch]
        try:
            self.store.put_many(items)
        except (BlockExistsError, StoreFullError):
            pass
        else:
            self.ref.update((k, bytes(d)) for k, d in items)

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def delete(self, data):
        k = data.draw(st.sampled_from(sorted(self.ref, key=lambda k: k.block_hash)))
        self.store.delete(k)
        del self.ref[k]

    @rule(h=st.integers(0, 40))
    def get_missing_or_present(self, h):
        k = K(h)
        if k in self.ref:
            assert bytes(self.store.get(k, verify=True)) == self.ref[k]
        else:
            with pytest.raises(BlockNotFoundError):
                self.store.get(k)

    @invariant()
    def agrees(self):
        s = self.store
        assert len(s) == len(self.ref) and set(s.keys()) == set(self.ref)
        spans = []
        for k, data in self.ref.items():
            assert bytes(s.get(k)) == data
            loc = s.location_of(k)
            spans.append((loc.segment_id, loc.offset_bytes, loc.offset_bytes + loc.size_bytes))
        spans.sort()
        assert all(a[0] != b[0] or a[2] <= b[1] for a, b in itertools.pairwise(spans))
        assert s.stored_bytes == sum(map(len, self.ref.values()))
        assert s.used_bytes + s.free_bytes == s.capacity_bytes


TestDramMachine = DramMachine.TestCase


def test_a_numpy_object_array_is_refused_not_stored_as_pointers():
    import numpy as np

    from quillcache.store.dram import LocalKvStore
    from quillcache.store.keys import StoreKey

    store = LocalKvStore(1 << 20)
    key = StoreKey(1, b"\x01" * 16)
    for bad in (np.array([object(), object()], dtype=object), np.zeros(2, dtype=[("a", "O"), ("b", "i4")])):
        with pytest.raises(TypeError, match=r"dtype .*Python object pointers"):
            store.put(key, bad)
        with pytest.raises(TypeError, match="Python object pointers"):
            store.put_many([(key, bad)])
    assert key not in store and store.used_bytes == 0
    store.put(key, np.arange(4, dtype=np.float64))  # numeric arrays are bytes: accepted
    assert bytes(store.get(key)) == np.arange(4, dtype=np.float64).tobytes()
    store.close()


def test_account_only_bookkeeping_grows_with_use_not_with_declared_capacity():
    from quillcache.store.dram import LocalKvStore
    from quillcache.store.keys import StoreKey

    store = LocalKvStore(1 << 50, account_only=True)  # 1 PiB declared: 2**20 segments of 1 GiB
    assert store.num_segments == 1 << 20 and len(store._allocators) == 0  # nothing built yet
    keys = [StoreKey(i + 1, b"\x02" * 16) for i in range(64)]
    for k in keys:
        store.put(k, b"x" * (64 << 10))
    assert len(store._allocators) == 1  # one segment in use: one allocator, not a million
    assert store.free_bytes == (1 << 50) - store.used_bytes
    assert store.largest_free_region_bytes() == (1 << 30) - store.used_bytes or \
        store.largest_free_region_bytes() == 1 << 30
    store.close()


def test_segments_open_in_order_as_blocks_need_them():
    from quillcache.store.dram import LocalKvStore
    from quillcache.store.errors import StoreFullError
    from quillcache.store.keys import StoreKey

    store = LocalKvStore(3 << 20, segment_bytes=1 << 20, alignment_bytes=4096)
    locs = [store.put(StoreKey(i + 1, b"\x03" * 16), b"y" * (512 << 10)) for i in range(6)]
    assert [loc.segment_id for loc in locs] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(StoreFullError):
        store.put(StoreKey(99, b"\x03" * 16), b"z")
    store.close()


def test_the_store_is_a_context_manager():
    from quillcache.store.dram import LocalKvStore
    from quillcache.store.errors import StoreClosedError
    from quillcache.store.keys import StoreKey

    with LocalKvStore(1 << 20) as store:
        store.put(StoreKey(1, b"\x05" * 16), b"abc")
    with pytest.raises(StoreClosedError):
        store.get(StoreKey(1, b"\x05" * 16))
