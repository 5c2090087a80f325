"""The crash study's quick profile (run by ``make test``): SSD tier and ART index on one CrashFs.

Asserted are counts, never timings: no acknowledged block lost, no wrong bytes served, no
acknowledged index entry lost, no dangling index entry after reconcile, every bit flip detected.
The checks themselves are shown to fail on a planted loss, so the zeros mean something.
"""

from __future__ import annotations

import csv
import random

import pytest

from experiments import crash_study
from experiments.crash_workload import (
    NODE,
    TEST_SHAPE,
    IndexModel,
    block_key,
    check_tier_index,
    tier_index_workload,
)
from quillcache.durability.crashfs import CrashFs
from quillcache.index import ResidencyEntry
from quillcache.types import CacheTier

MUST_BE_ZERO = ("acknowledged_blocks_lost", "corrupt_bytes_served", "dangling_index_entries",
                "acknowledged_index_entries_lost", "unindexed_blocks_after_reconcile")


def test_quick_profile_loses_nothing_with_the_index_on_the_same_crashfs(tmp_path):
    rows = crash_study.run(quick=True, results_root=str(tmp_path))
    by = {(r.metric, r.subject): r.value for r in rows}
    for (metric, subject), value in by.items():
        if metric in MUST_BE_ZERO:
            assert value == 0, (metric, subject)
        if metric == "bitflips_detected":
            assert value == by[("bitflips_injected", subject)], subject
    for layout in ("slab", "files"):
        sub = f"powerloss_index_{layout}"
        assert by[("trials", sub)] == crash_study.QUICK["powerloss_index"]
        # two power losses per trial: those that interrupted the workload are the crashes
        assert by[("crashes", sub)] + by[("power_losses_after_clean_close", sub)] == 2 * crash_study.QUICK["powerloss_index"]
        assert by[("crashes", sub)] > 0
        assert by[("acknowledged_blocks_checked", sub)] > 0
        assert by[("acknowledged_index_entries_checked", sub)] > 0
    with open(tmp_path / "crash" / "raw.csv") as fh:
        raw = list(csv.DictReader(fh))
    index_rows = [r for r in raw if r["scenario"].startswith("powerloss_index_")]
    assert len(index_rows) == 4 * crash_study.QUICK["powerloss_index"]
    assert all(r["index_acked_lost"] == "0" and r["dangling_after"] == "0" for r in index_rows)
    assert (tmp_path / "crash" / "summary.csv").stat().st_size > 0


def _clean_run() -> tuple[CrashFs, IndexModel]:
    fs = CrashFs()
    model = IndexModel()
    tier_index_workload(fs, "slab", random.Random(5), model, 40, TEST_SHAPE, root="/q")
    assert model.index_acked and model.acked
    return fs, model


def test_index_check_counts_a_lost_acknowledged_entry():
    fs, model = _clean_run()
    model.index_acked[10**9] = (0, 0, 4096)  # an entry the index never held
    *_, check = check_tier_index(fs.snapshot(), "slab", model, TEST_SHAPE, root="/q")
    assert check.index_acked_lost == 1 and check.acked_lost == 0


def test_index_check_counts_dangling_entries_and_reconcile_removes_them():
    fs, model = _clean_run()
    disk = fs.snapshot()
    ix = TEST_SHAPE.open_index(disk, "/q/ix")
    ghost = block_key(10**9)
    ix.put([ResidencyEntry(ghost.block_hash, NODE, CacheTier.SSD, ghost.identity, 0, 0, 4096)])
    ix.close()
    *_, check = check_tier_index(disk, "slab", model, TEST_SHAPE, root="/q")
    assert check.dangling_before == 1 and check.dangling_after == 0 and check.reconcile_changes >= 1


def test_a_child_that_dies_on_its_own_fails_the_study():
    """A kill trial whose child exited before its N acknowledgements tested nothing: refuse it."""
    import subprocess
    import sys

    from experiments.crash_study import _kill_after_acks

    proc = subprocess.Popen([sys.executable, "-c", "print('A 1 10', flush=True); raise SystemExit(3)"],
                            stdout=subprocess.PIPE)
    with pytest.raises(RuntimeError, match="exited with status 3 after 1 of 5"):
        _kill_after_acks(proc, 5, deadline_s=30.0)
