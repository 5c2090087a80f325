"""Review fixes in the crash study's checks: each test fails when its fix is reverted.

- A block served cut short (or grown) is counted as a wrong read even when it is not on the
  acknowledged list: :func:`block_content` depends on the size, not only on the key.
- An acknowledged block served with wrong bytes is one wrong read, not two.
- A power loss whose drawn sync point the workload never reached (it closed cleanly first) is not
  counted as a crash; it is counted apart and still checked.
"""

from __future__ import annotations

import random

from experiments import crash_study
from experiments.crash_workload import block_content, block_key, count_tier
from quillcache.store.errors import BlockNotFoundError


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


def test_power_losses_after_a_clean_close_are_counted_apart_from_crashes():
    raw: list = []
    tot = crash_study.run_powerloss("slab", 12, random.Random(crash_study.SEED), raw)
    assert len(raw) == 24
    mid = [r for r in raw if r[-1].startswith("mid-workload:")]
    after = [r for r in raw if r[-1].startswith("after clean close:")]
    assert len(mid) + len(after) == 24
    assert tot["crashes"] == len(mid) and tot["after_close"] == len(after)
    assert tot["crashes"] > 0 and tot["after_close"] > 0  # this seed draws both kinds
    assert tot["lost"] == 0 and tot["corrupt"] == 0


def test_index_power_losses_after_a_clean_close_are_counted_apart_too():
    raw: list = []
    tot = crash_study.run_powerloss_index("files", 10, random.Random(crash_study.SEED), raw)
    after = sum(1 for r in raw if r[-1].startswith("after clean close:"))
    assert tot["crashes"] + tot["after_close"] == 20 and tot["after_close"] == after
    assert tot["crashes"] == 20 - after
