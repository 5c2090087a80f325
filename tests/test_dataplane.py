"""StoreDataPlane over the real LocalKvStore and SsdTier: placement, promotion/demotion moving
real bytes, eviction under pressure, pins and leases, restarts, typed errors, and a stateful
Hypothesis test against a dict reference that also checks the index after every step."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from quillcache.index import open_index
from quillcache.hitrate import SEMI_ONLINE
from quillcache.policies import POLICIES, LruPolicy

# Every policy that runs online (Belady needs a next-use oracle from a trace replay).
# belady (offline) and the semi-online lookahead need oracles of future requests: a data plane has none
ONLINE_POLICIES = sorted(name for name in POLICIES if name != "belady" and name not in SEMI_ONLINE)
from quillcache.store.dataplane import StoreDataPlane
from quillcache.store.dram import LocalKvStore
from quillcache.store.errors import (
    BlockExistsError,
    BlockInUseError,
    BlockNotFoundError,
    BlockTooLargeError,
    StoreClosedError,
    StoreFullError,
)
from quillcache.store.keys import StoreKey
from quillcache.store.ssd import SsdTier
from quillcache.types import CacheTier

GPU, DRAM, SSD = CacheTier.GPU, CacheTier.DRAM, CacheTier.SSD
NODE = "node-a"
IDENT = b"I" * 16


def K(h: int) -> StoreKey:
    return StoreKey(h, IDENT)


def blob(h: int, size: int, salt: int = 0) -> bytes:
    pattern = bytes([(h * 31 + salt * 7 + i) % 251 for i in range(251)])
    return (pattern * (size // 251 + 1))[:size]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_plane(ssd_dir, *, dram_bytes=8192, ssd_bytes=4 * 4096, gpu=0, index=None, clock=None, policy="lru",
               on_evict=None, with_ssd=True, **kw) -> StoreDataPlane:
    dram = LocalKvStore(dram_bytes, alignment_bytes=64)
    ssd = SsdTier(ssd_dir, capacity_bytes=ssd_bytes, slab_bytes=ssd_bytes) if with_ssd else None
    return StoreDataPlane(NODE, dram=dram, ssd=ssd, gpu_capacity_blocks=gpu, index=index, policy=policy,
                          clock=clock or FakeClock(), on_evict=on_evict, **kw)


def index_view(index) -> list:
    return sorted(index.entries_on_node(NODE), key=lambda e: (e.block_hash, e.tier))


def assert_index_agrees(dp: StoreDataPlane, index) -> None:
    assert index_view(index) == sorted(dp.residency(), key=lambda e: (e.block_hash, e.tier))


@pytest.fixture
def index():
    idx = open_index("flat")
    yield idx
    idx.close()


# ---------------------------------------------------------------- basic behaviour


def test_put_get_demote_promote_move_real_bytes(tmp_path, index):
    dp = make_plane(tmp_path / "ssd", index=index)
    assert dp.put(K(1), blob(1, 3000)) == DRAM
    view = dp.get(K(1))
    assert isinstance(view, memoryview) and view.readonly and bytes(view) == blob(1, 3000)
    assert dp.demote(K(1)) == SSD
    assert K(1) not in dp.dram and K(1) in dp.ssd and dp.tier_of(K(1)) == SSD
    assert dp.ssd.get(K(1)) == blob(1, 3000)  # the real bytes moved
    assert_index_agrees(dp, index)
    (entry,) = index.locate([1])[0]
    assert entry.tier == SSD and (entry.segment_id, entry.offset_bytes, entry.size_bytes) == dp.ssd.location_of(K(1))
    got = dp.get(K(1))  # SSD hit: promoted back
    assert bytes(got) == blob(1, 3000) and dp.tier_of(K(1)) == DRAM and K(1) not in dp.ssd
    assert dp.demote(K(1)) == SSD and dp.promote(K(1)) == DRAM
    assert_index_agrees(dp, index)
    (entry,) = index.locate([1])[0]
    assert entry.tier == DRAM and (entry.segment_id, entry.offset_bytes, entry.size_bytes) == dp.dram.location_of(K(1))
    st_ = dp.stats()
    assert (st_.dram_hits, st_.ssd_hits, st_.promotions_ssd_to_dram, st_.demotions_dram_to_ssd) == (1, 1, 2, 2)
    assert st_.bytes_dram_to_ssd == st_.bytes_ssd_to_dram == 6000
    dp.delete(K(1))
    assert K(1) not in dp and index_view(index) == []
    dp.close()


def test_put_to_ssd_directly_and_lowest_tier(tmp_path, index):
    dp = make_plane(tmp_path / "ssd", index=index)
    assert dp.put(K(2), blob(2, 100), tier=SSD) == SSD
    with pytest.raises(ValueError, match="lowest tier"):
        dp.demote(K(2))
    with pytest.raises(BlockExistsError, match="already stored in SSD"):
        dp.put(K(2), b"x")
    assert dp.promote(K(2)) == DRAM
    with pytest.raises(ValueError, match="highest tier"):
        dp.promote(K(2))  # no GPU tier
    assert_index_agrees(dp, index)


def test_dram_pressure_demotes_lru_victims_to_ssd(tmp_path, index):
    evicted = []
    dp = make_plane(tmp_path / "ssd", index=index, on_evict=lambda k, t: evicted.append((k, t)))
    for h in range(4):
        dp.put(K(h), blob(h, 2048))  # fills 8 KiB of DRAM exactly
    dp.get(K(0))  # K(0) becomes most recent: K(1) is the LRU victim
    dp.put(K(9), blob(9, 2048))
    assert dp.tier_of(K(1)) == SSD and dp.ssd.get(K(1)) == blob(1, 2048)
    assert [dp.tier_of(K(h)) for h in (0, 2, 3, 9)] == [DRAM] * 4
    dp.put(K(10), blob(10, 4096))  # needs two victims: K(2), K(3)
    assert dp.tier_of(K(2)) == dp.tier_of(K(3)) == SSD
    assert evicted == []  # demotions are not evictions from the node
    # SSD holds 4 pages: K(1), K(2), K(3) + one more; the next demotions evict SSD's LRU (K(1))
    dp.put(K(11), blob(11, 4096))  # demotes K(0), K(9): SSD must drop one block
    assert evicted == [(K(1), SSD)] and K(1) not in dp
    assert dp.stats().evictions_ssd == 1
    assert_index_agrees(dp, index)


def test_everything_pinned_and_no_room_is_store_full_and_nothing_changes(tmp_path, index):
    dp = make_plane(tmp_path / "ssd", index=index, with_ssd=False)
    for h in range(4):
        dp.put(K(h), blob(h, 2048))
        dp.pin(K(h))
    before = index_view(index)
    with pytest.raises(StoreFullError, match=r"no room for block .* \(100 bytes\) in DRAM on node 'node-a'.*"
                                             r"4 of 4 blocks there are pinned, leased or being moved.*nothing was changed"):
        dp.put(K(7), blob(7, 100))
    assert K(7) not in dp and index_view(index) == before
    assert all(bytes(dp.get(K(h))) == blob(h, 2048) for h in range(4))  # still serving
    dp.unpin(K(2))
    assert dp.put(K(7), blob(7, 100)) == DRAM and K(2) not in dp  # dropped: no SSD


def test_partially_pinned_not_enough_is_refused_before_any_eviction(tmp_path, index):
    evicted = []
    dp = make_plane(tmp_path / "ssd", index=index, with_ssd=False, on_evict=lambda k, t: evicted.append(k))
    for h in range(4):
        dp.put(K(h), blob(h, 2048))
    dp.pin(K(0))
    dp.lease(K(1), 5.0)
    with pytest.raises(StoreFullError, match="nothing was changed"):
        dp.put(K(8), blob(8, 6000))  # evicting K(2), K(3) frees only 4 KiB
    assert evicted == [] and len(dp) == 4


def test_leases_and_pins_block_delete_demote_and_eviction(tmp_path, index):
    clock = FakeClock()
    dp = make_plane(tmp_path / "ssd", index=index, clock=clock, with_ssd=False)
    dp.put(K(1), blob(1, 4096))
    dp.put(K(2), blob(2, 4096))
    assert dp.lease(K(1), 10.0) == 1010.0
    assert dp.lease(K(1), 2.0) == 1010.0  # lease_end = max(old, now + ttl)
    with pytest.raises(BlockInUseError, match=r"cannot delete block .* leased for 10.000 s more"):
        dp.delete(K(1))
    dp.put(K(3), blob(3, 4096))  # K(1) is leased: K(2) is the victim
    assert K(2) not in dp and K(1) in dp
    clock.now += 10.0
    dp.delete(K(1))  # lease over
    dp.pin(K(3))
    dp.pin(K(3))
    with pytest.raises(BlockInUseError, match="hard-pinned x2"):
        dp.demote(K(3))
    dp.unpin(K(3))
    with pytest.raises(BlockInUseError, match="hard-pinned x1"):
        dp.delete(K(3))
    dp.unpin(K(3))
    with pytest.raises(ValueError, match="not hard-pinned"):
        dp.unpin(K(3))
    dp.delete(K(3))
    dp.put(K(4), b"x")
    with pytest.raises(ValueError, match="ttl_s=-1.0 must be > 0"):
        dp.lease(K(4), -1)
    with pytest.raises(TypeError, match="ttl_s must be a number"):
        dp.lease(K(4), "5")


def test_soft_pins_are_evicted_last_and_expire(tmp_path):
    clock = FakeClock()
    dp = make_plane(tmp_path / "ssd", clock=clock, with_ssd=False, soft_pin_ttl_s=60.0)
    for h in range(4):
        dp.put(K(h), blob(h, 2048))
    dp.pin(K(2), hard=False)
    dp.pin(K(3), hard=False)
    with pytest.raises(BlockInUseError, match="soft-pinned"):
        dp.delete(K(2))
    dp.put(K(5), blob(5, 4096))  # the unpinned K(0), K(1) go first, though K(2) is as old
    assert sorted(k.block_hash for k in dp) == [2, 3, 5]
    dp.pin(K(5))
    dp.put(K(6), blob(6, 2048))  # only soft-pinned blocks are evictable: the LRU one, K(2), goes
    assert sorted(k.block_hash for k in dp) == [3, 5, 6]
    clock.now += 61.0
    dp.delete(K(3))  # soft pin expired


def test_gpu_accounting(tmp_path, index):
    evicted = []
    clock = FakeClock()
    dp = make_plane(tmp_path / "ssd", index=index, gpu=2, clock=clock, on_evict=lambda k, t: evicted.append((k, t)))
    assert dp.put(K(1), 5000, tier=GPU) == GPU
    assert dp.tier_of(K(1)) == GPU and dp.tiers_of(K(1)) == {GPU}
    with pytest.raises(BlockNotFoundError, match="held only in GPU"):
        dp.get(K(1))
    dp.put(K(2), blob(2, 1000))
    assert dp.promote(K(2)) == GPU and dp.tiers_of(K(2)) == {GPU, DRAM}
    assert bytes(dp.get(K(2))) == blob(2, 1000)  # bytes still in DRAM
    dp.pin(K(1))
    dp.put(K(3), b"abc", tier=GPU)  # GPU full: K(2) (unpinned) loses its GPU hold
    assert evicted == [(K(2), GPU)] and dp.tiers_of(K(2)) == {DRAM}
    dp.lease(K(3), 5)
    with pytest.raises(StoreFullError, match="all 2 of 2 GPU blocks are pinned, leased"):
        dp.put(K(4), 10, tier=GPU)
    clock.now += 6  # the lease on K(3) runs out
    assert dp.demote(K(3)) is None and K(3) not in dp  # GPU-only block released
    with pytest.raises(BlockExistsError):
        dp.put(K(1), 10, tier=GPU)
    assert_index_agrees(dp, index)
    (e,) = index.locate([1])[0]
    assert (e.tier, e.size_bytes) == (GPU, 5000)


def test_restart_drops_dram_and_reconciles_ssd(tmp_path, index):
    dp = make_plane(tmp_path / "ssd", index=index, gpu=4)
    dp.put(K(1), blob(1, 1000))
    dp.put(K(2), blob(2, 1000), tier=SSD)
    dp.put(K(3), blob(3, 1000))
    dp.demote(K(3))
    dp.put(K(4), 100, tier=GPU)
    dp.pin(K(2))
    dp.close()
    with pytest.raises(StoreClosedError):
        dp.get(K(1))
    assert len(index_view(index)) == 4  # stale until reopened
    # a crash-like disagreement: an entry for a block the SSD never had
    from quillcache.index import ResidencyEntry

    index.put([ResidencyEntry(99, NODE, SSD, IDENT, 0, 0, 10)])
    dp2 = make_plane(tmp_path / "ssd", index=index, gpu=4)
    assert sorted(k.block_hash for k in dp2) == [2, 3]
    assert dp2.ssd.get(K(2)) == blob(2, 1000) and bytes(dp2.get(K(3))) == blob(3, 1000)
    assert_index_agrees(dp2, index)
    dp2.delete(K(2))  # pins do not survive a restart
    dp2.close()


def test_bad_input_typed_errors(tmp_path, index):
    dp = make_plane(tmp_path / "ssd", index=index, gpu=1)
    for call in (dp.get, dp.delete, dp.demote, dp.promote, dp.pin, dp.unpin, dp.tier_of):
        with pytest.raises(BlockNotFoundError, match=K(5).hex()):
            call(K(5))
    with pytest.raises(BlockNotFoundError):
        dp.lease(K(5), 1.0)
    with pytest.raises(TypeError, match="key must be a StoreKey, got int"):
        dp.get(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got str"):
        dp.put(K(1), "text")
    with pytest.raises(TypeError, match="tier must be a CacheTier, got str"):
        dp.put(K(1), b"x", tier="DRAM")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="REMOTE is not a tier of this node"):
        dp.put(K(1), b"x", tier=CacheTier.REMOTE)
    with pytest.raises(ValueError, match="empty"):
        dp.put(K(1), b"")
    with pytest.raises(BlockTooLargeError, match="8193 bytes"):
        dp.put(K(1), bytes(8193))  # larger than any DRAM segment
    with pytest.raises(BlockTooLargeError):
        dp.put(K(1), bytes(5 * 4096), tier=SSD)  # larger than the SSD tier
    with pytest.raises(ValueError, match="GPU block size -3"):
        dp.put(K(1), -3, tier=GPU)
    assert len(dp) == 0 and index_view(index) == []
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        make_plane(tmp_path / "ssd2", policy="nope")
    with pytest.raises(ValueError, match="non-empty str"):
        StoreDataPlane("", dram=LocalKvStore(4096))
    with pytest.raises(TypeError, match="dram must be a LocalKvStore"):
        StoreDataPlane(NODE, dram=bytearray(10))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no SSD tier"):
        make_plane(tmp_path / "x", with_ssd=False).put(K(1), b"x", tier=SSD)
    with pytest.raises(ValueError, match="no GPU tier"):
        make_plane(tmp_path / "y", with_ssd=False).put(K(1), 10, tier=GPU)


def test_admission_refusal_falls_through_to_ssd(tmp_path, monkeypatch):
    class NoDram(LruPolicy):
        name = "no-big"

        def admit(self, key, size_bytes):
            return size_bytes < 1000

    monkeypatch.setitem(POLICIES, "no-big", NoDram)
    dp = make_plane(tmp_path / "ssd", policy="no-big")
    assert dp.put(K(1), bytes(500)) == DRAM
    assert dp.put(K(2), bytes(2000)) is None  # refused by both tiers' policies
    assert dp.stats().admission_refusals == 1 and K(2) not in dp


@pytest.mark.parametrize("policy", ONLINE_POLICIES)
def test_every_policy_drives_eviction(tmp_path, policy):
    dp = make_plane(tmp_path / "ssd", policy=policy)
    for h in range(12):
        dp.put(K(h), blob(h, 2048))
        if K(h // 2) in dp:
            assert bytes(dp.get(K(h // 2))) == blob(h // 2, 2048)
    on_node = sorted(k.block_hash for k in dp)
    assert len(on_node) == 8  # 4 in DRAM + 4 pages of SSD
    for h in on_node:  # read without promoting (a promotion may evict from a full SSD)
        got = bytes(dp.dram.get(K(h))) if K(h) in dp.dram else dp.ssd.get(K(h))
        assert got == blob(h, 2048)
    assert len(dp.dram) == 4 and len(dp.ssd) == 4


# ---------------------------------------------------------------- stateful test


block_sizes = st.one_of(st.sampled_from([64, 1000, 2048, 3000, 4096]), st.integers(1, 4096))


class DataPlaneMachine(RuleBasedStateMachine):
    """Drive StoreDataPlane with every operation and compare it with a dict after each step."""

    @initialize(policy=st.sampled_from(ONLINE_POLICIES), with_ssd=st.booleans())
    def setup(self, policy, with_ssd):
        self.dir = tempfile.mkdtemp(prefix="qc-dp-")
        self.index = open_index("flat")
        self.clock = FakeClock()
        self.policy, self.with_ssd = policy, with_ssd
        self.ref: dict[StoreKey, bytes] = {}  # blocks with bytes on the node
        self.gpu: set[StoreKey] = set()
        self.hard: dict[StoreKey, int] = {}
        self.soft_end: dict[StoreKey, float] = {}
        self.lease_end: dict[StoreKey, float] = {}
        self.salt = 0
        self._open()

    def _open(self):
        self.dp = make_plane(self.dir, dram_bytes=8192, ssd_bytes=4 * 4096, gpu=3, index=self.index,
                             clock=self.clock, policy=self.policy, on_evict=self._evicted,
                             with_ssd=self.with_ssd, soft_pin_ttl_s=30.0)

    def _events(self):
        for name, value in self.dp.stats().as_dict().items():
            if value and not name.startswith("bytes_"):
                event(f"stats: {name}")

    def teardown(self):
        if hasattr(self, "dp"):
            self._events()
            self.dp.close()
            self.index.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- model helpers
    def _in_use(self, k) -> bool:
        now = self.clock.now
        return self.hard.get(k, 0) > 0 or self.lease_end.get(k, 0) > now or self.soft_end.get(k, 0) > now

    def _evicted(self, key, tier):
        now = self.clock.now
        assert self.hard.get(key, 0) == 0 and self.lease_end.get(key, 0) <= now, f"evicted {key} while in use"
        if tier == GPU:
            self.gpu.discard(key)
        else:
            del self.ref[key]
        self._forget_if_gone(key)

    def _forget_if_gone(self, key):
        if key not in self.ref and key not in self.gpu:
            self.hard.pop(key, None)
            self.soft_end.pop(key, None)
            self.lease_end.pop(key, None)

    def _known(self, data):
        """A key on the node (usually) or any key of the small key space."""
        held = sorted(set(self.ref) | self.gpu, key=lambda k: k.block_hash)
        anything = st.builds(K, st.integers(0, 12))
        return data.draw(st.one_of(st.sampled_from(held), anything) if held else anything)

    # ---- rules
    @rule(blocks=st.lists(st.tuples(st.integers(0, 12), block_sizes), min_size=1, max_size=3), to_ssd=st.booleans())
    def put(self, blocks, to_ssd):
        for h, size in blocks:
            self._put_one(h, size, to_ssd)

    def _put_one(self, h, size, to_ssd):
        k = K(h)
        self.salt += 1
        data = blob(h, size, self.salt)
        tier = SSD if to_ssd and self.with_ssd else DRAM
        if k in self.ref:
            with pytest.raises(BlockExistsError):
                self.dp.put(k, data, tier=tier)
            return
        try:
            placed = self.dp.put(k, data, tier=tier)
        except StoreFullError:
            event("put: StoreFullError")
            assert k not in self.dp.dram and (self.dp.ssd is None or k not in self.dp.ssd)
            return
        assert placed == tier
        self.ref[k] = data

    @rule(h=st.integers(0, 12), size=st.integers(1, 10_000))
    def put_gpu(self, h, size):
        k = K(h)
        if k in self.gpu:
            with pytest.raises(BlockExistsError):
                self.dp.put(k, size, tier=GPU)
            return
        try:
            self.dp.put(k, size, tier=GPU)
        except StoreFullError:
            assert all(self._in_use(g) for g in self.gpu) and len(self.gpu) == 3
            return
        self.gpu.add(k)

    @rule(data=st.data())
    def get(self, data):
        k = self._known(data)
        if k in self.ref:
            assert bytes(self.dp.get(k)) == self.ref[k]
        else:
            with pytest.raises(BlockNotFoundError):
                self.dp.get(k)

    @rule(data=st.data())
    def delete(self, data):
        k = self._known(data)
        if k not in self.ref and k not in self.gpu:
            with pytest.raises(BlockNotFoundError):
                self.dp.delete(k)
        elif self._in_use(k):
            with pytest.raises(BlockInUseError):
                self.dp.delete(k)
        else:
            self.dp.delete(k)
            self.ref.pop(k, None)
            self.gpu.discard(k)
            self._forget_if_gone(k)

    @rule(data=st.data())
    def demote(self, data):
        k = self._known(data)
        if k not in self.ref and k not in self.gpu:
            with pytest.raises(BlockNotFoundError):
                self.dp.demote(k)
            return
        if self._in_use(k):
            with pytest.raises(BlockInUseError):
                self.dp.demote(k)
            return
        before = self.dp.tiers_of(k)
        if GPU in before:
            self.dp.demote(k)
            self.gpu.discard(k)
            self._forget_if_gone(k)
        elif DRAM in before and self.with_ssd:
            try:
                assert self.dp.demote(k) == SSD
            except StoreFullError:
                assert self.dp.tiers_of(k) == before
        else:
            with pytest.raises(ValueError, match="lowest tier"):
                self.dp.demote(k)

    @rule(data=st.data())
    def promote(self, data):
        k = self._known(data)
        if k not in self.ref and k not in self.gpu:
            with pytest.raises(BlockNotFoundError):
                self.dp.promote(k)
            return
        before = self.dp.tiers_of(k)
        try:
            after = self.dp.promote(k)
        except ValueError:
            assert SSD not in before and (GPU in before or DRAM not in before)
            return
        except StoreFullError:
            assert self.dp.tiers_of(k) == before or SSD in before
            return
        if after == GPU:
            self.gpu.add(k)
        else:
            assert SSD in before and after == DRAM

    @rule(data=st.data(), hard=st.booleans())
    def pin(self, data, hard):
        k = self._known(data)
        if k not in self.ref and k not in self.gpu:
            with pytest.raises(BlockNotFoundError):
                self.dp.pin(k, hard=hard)
            return
        self.dp.pin(k, hard=hard)
        if hard:
            self.hard[k] = self.hard.get(k, 0) + 1
        else:
            self.soft_end[k] = self.clock.now + 30.0

    @precondition(lambda self: self.hard or self.soft_end)
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(sorted(set(self.hard) | set(self.soft_end), key=lambda k: k.block_hash)))
        if self.hard.get(k, 0) > 0:
            self.dp.unpin(k, hard=True)
            self.hard[k] -= 1
        elif self.soft_end.get(k, 0) > self.clock.now:
            self.dp.unpin(k, hard=False)
            self.soft_end[k] = 0
        else:
            with pytest.raises(ValueError):
                self.dp.unpin(k, hard=True)

    @rule(data=st.data(), ttl=st.sampled_from([1.0, 5.0, 50.0]))
    def lease(self, data, ttl):
        k = self._known(data)
        if k not in self.ref and k not in self.gpu:
            with pytest.raises(BlockNotFoundError):
                self.dp.lease(k, ttl)
            return
        end = self.dp.lease(k, ttl)
        self.lease_end[k] = max(self.lease_end.get(k, 0), self.clock.now + ttl)
        assert end == self.lease_end[k]

    @rule(dt=st.sampled_from([0.5, 3.0, 40.0]))
    def advance_clock(self, dt):
        self.clock.now += dt

    @rule()
    def restart(self):
        survivors = set(self.dp.ssd.keys()) if self.dp.ssd is not None else set()
        self._events()
        self.dp.close()
        self.ref = {k: v for k, v in self.ref.items() if k in survivors}
        self.gpu.clear()
        self.hard.clear()
        self.soft_end.clear()
        self.lease_end.clear()
        self._open()

    # ---- invariants
    @invariant()
    def contents_and_index_agree(self):
        dp = self.dp
        dram_keys = set(dp.dram.keys())
        ssd_keys = set(dp.ssd.keys()) if dp.ssd is not None else set()
        assert not dram_keys & ssd_keys  # bytes are in exactly one tier
        assert dram_keys | ssd_keys == set(self.ref)
        for k, data in self.ref.items():
            got = bytes(dp.dram.get(k)) if k in dram_keys else dp.ssd.get(k)
            assert got == data
        assert {k for k in dp if GPU in dp.tiers_of(k)} == self.gpu
        assert set(dp.policy(DRAM)) == dram_keys and set(dp.policy(SSD)) == ssd_keys
        assert set(dp.policy(GPU)) == self.gpu
        assert_index_agrees(dp, self.index)
        expected_tiers = sorted([(k.block_hash, DRAM) for k in dram_keys] + [(k.block_hash, SSD) for k in ssd_keys]
                                + [(k.block_hash, GPU) for k in self.gpu])
        assert sorted((e.block_hash, e.tier) for e in self.index.entries_on_node(NODE)) == expected_tiers


TestDataPlaneMachine = DataPlaneMachine.TestCase
TestDataPlaneMachine.settings = settings(TestDataPlaneMachine.settings, stateful_step_count=40)


# ---------------------------------------------------------------- corruption and SSD pressure


def test_corrupt_dram_block_is_dropped_everywhere(tmp_path, index):
    dram = LocalKvStore(8192, checksum=True)
    dp = StoreDataPlane(NODE, dram=dram, index=index, verify_dram_reads=True, clock=FakeClock())
    dp.put(K(1), blob(1, 1000))
    dp.put(K(2), blob(2, 1000))
    loc = dram.location_of(K(1))
    dram._segment_array(loc.segment_id)[loc.offset_bytes + 5] ^= 1
    from quillcache.store.errors import CorruptBlockError

    with pytest.raises(CorruptBlockError, match="failed its crc32c check"):
        dp.get(K(1))
    assert K(1) not in dp and [e.block_hash for e in index_view(index)] == [2]
    assert dp.stats().corrupt_blocks == 1 and K(1) not in dp.policy(DRAM)
    assert bytes(dp.get(K(2))) == blob(2, 1000)


def test_corrupt_ssd_block_is_dropped_everywhere(tmp_path, index):
    from quillcache.store.errors import CorruptBlockError
    from quillcache.store.ssd_slab import _slab_name

    dp = make_plane(tmp_path / "ssd", index=index)
    dp.put(K(1), blob(1, 1000), tier=SSD)
    seg, off, _ = dp.ssd.location_of(K(1))
    with open(tmp_path / "ssd" / _slab_name(seg), "r+b") as fh:
        fh.seek(off + 10)
        byte = fh.read(1)
        fh.seek(off + 10)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptBlockError):
        dp.get(K(1))
    assert K(1) not in dp and index_view(index) == [] and K(1) not in dp.policy(SSD)


def test_ssd_all_pinned_refuses_demotion_and_put(tmp_path, index):
    evicted = []
    dp = make_plane(tmp_path / "ssd", index=index, on_evict=lambda k, t: evicted.append((k, t)))
    for h in range(4):
        dp.put(K(h), blob(h, 100), tier=SSD)
        dp.pin(K(h))
    dp.put(K(9), blob(9, 100))
    before = index_view(index)
    with pytest.raises(StoreFullError, match=r"in SSD on node 'node-a'.*4 of 4 blocks.*nothing was changed"):
        dp.demote(K(9))
    with pytest.raises(StoreFullError, match="in SSD"):
        dp.put(K(10), blob(10, 100), tier=SSD)
    assert index_view(index) == before and dp.tier_of(K(9)) == DRAM and evicted == []
    # DRAM pressure with a full, pinned SSD: the DRAM victim is dropped, not demoted
    dp.put(K(11), blob(11, 8192))
    assert evicted == [(K(9), DRAM)] and dp.stats().evictions_dram == 1
    assert_index_agrees(dp, index)


def test_policy_options_reach_every_tier(tmp_path):
    dp = make_plane(tmp_path / "ssd", policy="s3fifo", policy_options={"small_ratio": 0.25})
    assert all(dp.policy(t).small_ratio == 0.25 for t in (GPU, DRAM, SSD))
    with pytest.raises(TypeError, match="policy 'lru' rejected options"):
        make_plane(tmp_path / "ssd2", policy="lru", policy_options={"small_ratio": 0.25})


def test_get_with_lease_keeps_the_view_valid(tmp_path):
    clock = FakeClock()
    dp = make_plane(tmp_path / "ssd", clock=clock, with_ssd=False)
    dp.put(K(1), blob(1, 4096))
    view = dp.get(K(1), lease_ttl_s=5.0)
    dp.put(K(2), blob(2, 4096))
    with pytest.raises(StoreFullError, match="1 of 2 blocks there are pinned, leased"):
        dp.put(K(3), blob(3, 8192))  # would need K(1)'s range too, and K(1) is leased
    assert bytes(view) == blob(1, 4096) and K(2) in dp  # nothing changed; the view still holds K(1)
    clock.now += 5.0
    dp.put(K(3), blob(3, 8192))
    assert K(1) not in dp and K(2) not in dp


def test_touch_and_request_hints(tmp_path):
    # touch() refreshes a block's place in one tier's policy without moving bytes; begin_request()
    # reaches policies that take hints and is a no-op for the others.
    dram = LocalKvStore(1 << 20)
    dp = StoreDataPlane("n0", dram=dram, gpu_capacity_blocks=4, policy="lru")
    keys = [StoreKey(i, bytes(16)) for i in range(3)]
    for k in keys:
        dp.put(k, 4096, tier=CacheTier.GPU)
    assert dp.policy(CacheTier.GPU).victim() == keys[0]
    assert dp.touch(keys[0]) == CacheTier.GPU
    assert dp.policy(CacheTier.GPU).victim() == keys[1]
    with pytest.raises(BlockNotFoundError, match="not in the DRAM tier"):
        dp.touch(keys[0], CacheTier.DRAM)
    with pytest.raises(BlockNotFoundError):
        dp.touch(StoreKey(99, bytes(16)))
    dp.begin_request(keys, 1)  # LRU takes no hints: nothing changes
    assert dp.policy(CacheTier.GPU).victim() == keys[1]
    hinted = StoreDataPlane("n1", dram=LocalKvStore(1 << 20), gpu_capacity_blocks=4, policy="quillhd")
    hinted.begin_request(keys, 0)
    for k in keys:
        hinted.put(k, 4096, tier=CacheTier.GPU)
    with pytest.raises(ValueError, match="num_hit"):  # the policy's own check: the hint reaches the policy
        hinted.begin_request(keys, 9)


# ---- quantized tiers: a kvquant codec's blocks through DRAM and SSD (quillcache.store.tier_codec) ---------


def _kv(tc, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(tc.shape, dtype=np.float32).astype(np.float16) for _ in range(2))


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3", "int4", "int2"])
def test_quantized_block_round_trips_through_dram_ssd_demotion_and_promotion(tmp_path, codec: str) -> None:
    import numpy as np

    from quillcache.kvquant import KVBlockError
    from quillcache.store.tier_codec import REL_MSE_BOUND, TierCodec

    tc = TierCodec(codec, tokens=16, layers=2, kv_heads=2, head_dim=64)
    foot = -(-tc.block_bytes // 4096) * 4096
    dp = make_plane(str(tmp_path / "ssd"), dram_bytes=4 * foot, ssd_bytes=4 * foot)
    try:
        kv = {h: _kv(tc, h) for h in range(3)}
        for h, (k, v) in kv.items():  # GPU -> DRAM: quantize real 16-bit K/V, store encode_block bytes
            assert dp.put(K(h), tc.encode(k, v), tier=DRAM) == DRAM
        assert dp.demote(K(0)) == SSD and K(0) not in dp.dram  # DRAM -> SSD moves the quantized bytes
        assert dp.stats().bytes_dram_to_ssd == tc.block_bytes
        for h, (k, v) in kv.items():
            data = dp.get(K(h))  # K(0): an SSD read, promoted back to DRAM with the same bytes
            assert len(data) == tc.block_bytes
            k2, v2 = tc.decode(data)  # each half's crc32c checked, then dequantized
            assert k2.dtype == np.float16 and k2.shape == k.shape
            for a, b in ((k2, k), (v2, v)):
                a64, b64 = a.astype(np.float64), b.astype(np.float64)
                assert ((a64 - b64) ** 2).sum() / (b64**2).sum() < REL_MSE_BOUND[codec]
            if codec == "int8":  # symmetric per token x head: every error within half a step (+ fp16 rounding)
                step = np.abs(k.astype(np.float32)).max(axis=2, keepdims=True) / 127
                assert (np.abs(k2.astype(np.float32) - k) <= step / 2 + np.abs(k) * 2**-10 + 1e-6).all()
        assert K(0) in dp.dram and dp.stats().bytes_ssd_to_dram == tc.block_bytes
        bad = bytearray(dp.get(K(1)))
        bad[100] ^= 0x01  # one flipped bit in the key half, then in the value half
        with pytest.raises(KVBlockError, match="crc32c"):
            tc.decode(bad)
        bad[100] ^= 0x01
        bad[tc.key_block_bytes + 100] ^= 0x10
        with pytest.raises(KVBlockError, match="crc32c"):
            tc.decode(bad)
        with pytest.raises(ValueError, match="bytes, got"):
            tc.decode(bytes(bad[:-1]))
    finally:
        dp.close()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_quantized_tier_holds_more_blocks_in_the_same_bytes(tmp_path, codec: str) -> None:
    from quillcache.store.tier_codec import TierCodec

    tc = TierCodec(codec, tokens=16, layers=2, kv_heads=2, head_dim=64)
    assert tc.fp16_block_bytes == 16 << 10 and tc.ratio < 0.6
    budget = 8 * tc.fp16_block_bytes  # eight 16-bit blocks' worth of DRAM
    for stored, want in ((tc.fp16_block_bytes, 8), (tc.block_bytes, tc.blocks_in(budget, 64))):
        dp = make_plane(str(tmp_path / f"ssd{stored}"), dram_bytes=budget, with_ssd=False)
        try:
            for h in range(40):
                dp.put(K(h), blob(h, stored), tier=DRAM)
            assert sum(1 for k in dp if k in dp.dram) == want
        finally:
            dp.close()
    assert tc.blocks_in(budget, 64) >= 14  # ~1.9x: the codes plus float32 scales (and int32 zero points)


def test_tier_codec_refuses_fp16_and_unknown_names_and_wrong_shapes() -> None:
    from quillcache.store.tier_codec import TierCodec, check_tier_codec

    with pytest.raises(ValueError, match="fp16 is no codec"):
        TierCodec("fp16", tokens=16, layers=1, kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="known: fp16, int8, fp8_e4m3, int4, int2"):
        check_tier_codec("int3")
    tc = TierCodec("int8", tokens=16, layers=1, kv_heads=1, head_dim=64)
    k, v = _kv(tc, 0)
    with pytest.raises(ValueError, match="is not the block's"):
        tc.encode(k[:8], v)
    # KIVI groups fit the block: gcd(32, tokens, head_dim)
    assert TierCodec("int4", tokens=48, layers=1, kv_heads=1, head_dim=64).codec.group_size == 16
    assert TierCodec("int4", tokens=512, layers=1, kv_heads=1, head_dim=128).codec.group_size == 32
