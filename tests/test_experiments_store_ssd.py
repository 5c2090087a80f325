"""The SSD benchmark's quick profile (run once per session) writes a well-formed summary whose
comparisons are wired to the right baseline rows. Nothing here asserts speed.

(The crash study's quick profile is run and checked once, by tests/test_crash_study.py.)
"""

from experiments import store_bench_ssd

# Which raw-file baseline each tier write path is compared with: one fsync per block vs one per batch.
WANT_BASELINE = {
    "raw_fsync_each": "", "tier_slab_put": "raw_fsync_each", "tier_files_put": "raw_fsync_each",
    "raw_batched": "", "tier_slab_put_many": "raw_batched", "tier_files_put_many": "raw_batched",
}


def test_store_bench_ssd_quick(quick_run, read_summary):
    run = quick_run("experiments.store_bench_ssd")
    read_summary(run.root / "store_ssd" / "summary.csv", run.rows)
    sizes = store_bench_ssd.QUICK["sizes"]
    assert {r.metric for r in run.rows} == {"put_throughput"}
    assert sorted((r.params["block_bytes"], r.subject) for r in run.rows) == sorted(
        (size, s) for size in sizes for s in WANT_BASELINE)
    by = {(r.params["block_bytes"], r.subject): r for r in run.rows}
    for row in run.rows:
        assert row.unit == "MB/s" and row.value > 0 and row.p10 <= row.value <= row.p90, row
        assert row.baseline == WANT_BASELINE[row.subject], row
        if row.baseline:  # the baseline figure is the baseline row of the same block size, same run
            assert row.baseline_value == by[(row.params["block_bytes"], row.baseline)].value, row
