"""Review fixes in the crash study's checks: each test fails when its fix is reverted.

- A block served cut short (or grown) is counted as a wrong read even when it is not on the
  acknowledged list: :func:`block_content` depends on the size, not only on the key.
- An acknowledged block served with wrong bytes is one wrong read, not two.
- A power loss whose drawn sync point the workload never reached (it closed cleanly first) is not
  counted as a crash; it is counted apart and still checked. The classification is checked against
  each trial's own record (the sync calls made vs the sync point drawn), not against itself.
- A block a check found lost or wrong is counted once over a trial's rounds: it leaves the
  acknowledged set, so the next round neither deletes it (BlockNotFoundError aborted the study) nor
  counts it again.
"""

from __future__ import annotations

import random
import re

from experiments import crash_study
from experiments.crash_workload import TEST_SHAPE, block_content, block_key, check_tier, count_tier, tier_workload
from quillcache.durability.crashfs import CrashFs
from quillcache.store.errors import BlockNotFoundError
from quillcache.store.ssd import SsdTier


class ServedBytes:
    """A tier stand-in that serves given bytes per key: what a damaged tier would serve."""

    def __init__(self, blobs: dict) -> None:
        self.blobs = blobs

    def keys(self):
        return list(self.blobs)

    def get(self, key):
        if key not in self.blobs:
            raise BlockNotFoundError(key)
        return self.blobs[key]


def test_content_depends_on_the_size_so_a_truncated_block_is_not_its_own_content():
    k = block_key(7)
    for full_n, cut_n in ((8192, 4096), (60_000, 4096), (9, 8), (4097, 4096)):
        assert block_content(k, cut_n) != block_content(k, full_n)[:cut_n], (full_n, cut_n)
    assert block_content(k, 4096) == block_content(k, 4096)  # still a pure function of (key, size)


def test_an_unacknowledged_block_served_truncated_is_a_wrong_read():
    k = block_key(7)
    tier = ServedBytes({k: block_content(k, 8192)[:4096]})  # asked to be deleted, came back cut to 4 KiB
    assert count_tier(tier, {}) == (0, 1)
    assert count_tier(ServedBytes({k: block_content(k, 8192)}), {}) == (0, 0)  # whole: fine


def test_an_acknowledged_wrong_block_is_counted_once():
    k = block_key(7)
    bad = bytearray(block_content(k, 8192))
    bad[100] ^= 1
    assert count_tier(ServedBytes({k: bytes(bad)}), {7: 8192}) == (0, 1)
    assert count_tier(ServedBytes({k: block_content(block_key(8), 8192)}), {7: 8192}) == (0, 1)
    assert count_tier(ServedBytes({}), {7: 8192}) == (1, 0)
    assert count_tier(ServedBytes({k: block_content(k, 8192)}), {7: 8192}) == (0, 0)


def _reached_the_drawn_sync_point(note: str) -> bool:
    """From a trial's own record: did the workload make the sync call its power loss was drawn at
    (``sync == crash_at``), or did it close cleanly short of it (``sync < crash_at``)?"""
    m = re.search(r"\bsync=(\d+) crash_at=(\d+)\b", note)
    assert m, note
    sync, crash_at = int(m[1]), int(m[2])
    assert 0 < sync <= crash_at, note  # CrashFs stops every workload at its drawn sync point
    return sync == crash_at


def _assert_classified_by_the_record(raw: list, tot: dict) -> None:
    reached = [_reached_the_drawn_sync_point(r[-1]) for r in raw]
    for r, hit in zip(raw, reached):
        assert r[-1].startswith("mid-workload:" if hit else "after clean close:"), r[-1]
    assert tot["crashes"] == sum(reached) and tot["after_close"] == len(raw) - sum(reached)
    assert 0 < sum(reached) < len(raw)  # this seed draws both kinds


def test_power_losses_after_a_clean_close_are_counted_apart_from_crashes():
    raw: list = []
    tot = crash_study.run_powerloss("slab", 12, random.Random(crash_study.SEED), raw)
    assert len(raw) == 24
    _assert_classified_by_the_record(raw, tot)
    assert tot["lost"] == 0 and tot["corrupt"] == 0


def test_index_power_losses_after_a_clean_close_are_counted_apart_too():
    raw: list = []
    tot = crash_study.run_powerloss_index("files", 10, random.Random(crash_study.SEED), raw)
    assert len(raw) == 20
    _assert_classified_by_the_record(raw, tot)


def test_a_block_lost_at_a_check_is_counted_once_and_the_next_round_never_deletes_it(monkeypatch):
    """The reviewer's scenario: round 1's check finds an acknowledged block lost; round 2's workload
    (whose seed picks that block for a delete when it is still listed) runs, and its check does not
    count the loss again."""
    fs = CrashFs()
    acked: dict[int, int] = {}
    tier_workload(fs, "slab", random.Random(1), acked, 40, TEST_SHAPE, directory="/sim/t")
    disk = fs.crash(random.Random(2))
    gone = sorted(acked)[len(acked) // 2]
    t = TEST_SHAPE.open_tier(disk, "/sim/t", "slab")
    t.delete(block_key(gone))  # behind the workload's back: what a recovery that lost it leaves
    t.close()
    t, lost, corrupt = check_tier(disk, "slab", acked, TEST_SHAPE, directory="/sim/t")
    assert (lost, corrupt) == (1, 0)
    del t
    asked: list[int] = []
    real_delete = SsdTier.delete

    def delete(self, key):
        asked.append(key.block_hash)
        return real_delete(self, key)

    monkeypatch.setattr(SsdTier, "delete", delete)
    tier_workload(disk, "slab", random.Random(4), acked, 150, TEST_SHAPE, directory="/sim/t", first=1_000_000)
    assert asked and gone not in asked
    t, lost, corrupt = check_tier(disk.crash(random.Random(5)), "slab", acked, TEST_SHAPE, directory="/sim/t")
    assert (lost, corrupt) == (0, 0)


def test_a_wrong_read_is_counted_once_over_two_checks():
    fs = CrashFs()
    t = TEST_SHAPE.open_tier(fs, "/c/t", "slab")
    t.put(block_key(1), block_content(block_key(1), 100))
    t.put(block_key(2), block_content(block_key(9), 100))  # acknowledged, wrong bytes
    t.put(block_key(3), block_content(block_key(8), 50))  # not acknowledged, wrong bytes
    t.close()
    acked, known = {1: 100, 2: 100}, set()
    for expect in ((0, 2), (0, 0)):  # the second check of the same disk finds nothing new
        _, *counts = check_tier(fs.snapshot(), "slab", acked, TEST_SHAPE, directory="/c/t", known=known)
        assert tuple(counts) == expect
        assert acked == {1: 100}


LOST, WRONG = 10**9, 10**9 + 1  # far from the keys the workload draws


def test_the_power_loss_study_counts_each_fault_once_over_both_rounds(monkeypatch):
    """Each trial gets one acknowledged block the disk never held and one block served with wrong
    bytes, both in round 1: the study counts each once, and round 2 is never asked to delete them."""
    real = crash_study.tier_workload
    round_2_acked: list[set[int]] = []

    def workload(fs, layout, rng, acked, ops, shape, *, directory, first=1):
        if first != 1:
            round_2_acked.append(set(acked))
            return real(fs, layout, rng, acked, ops, shape, directory=directory, first=first)
        drawn, fs.crash_at_sync = fs.crash_at_sync, None  # plant durably, before the drawn power loss
        t = shape.open_tier(fs, directory, layout)
        t.put(block_key(WRONG), block_content(block_key(WRONG + 1), 1000))
        t.close()
        fs.crash_at_sync = fs.sync_calls + drawn
        try:
            real(fs, layout, rng, acked, ops, shape, directory=directory, first=first)
        finally:
            acked[LOST] = 4096

    monkeypatch.setattr(crash_study, "tier_workload", workload)
    tot = crash_study.run_powerloss("slab", 4, random.Random(crash_study.SEED), [])
    assert len(round_2_acked) == 4 and not any(LOST in a for a in round_2_acked)
    assert (tot["lost"], tot["corrupt"]) == (4, 4)
