"""The DRAM store benchmark's quick profile (run once per session) writes a well-formed summary
whose comparisons are wired to the right baseline rows (no timing asserts)."""

from experiments import store_bench_dram

LABELS = ("64KiB", "2MiB", "32MiB")


def test_store_bench_dram_quick_writes_summary(quick_run, read_summary):
    run = quick_run("experiments.store_bench_dram")
    read_summary(run.root / "store_dram" / "summary.csv", run.rows)
    by = {r.metric: r for r in run.rows}
    for label in LABELS:
        assert {f"memcpy_GBps_{label}", f"put+get_GBps_{label}", f"put_GBps_{label}"} <= set(by)
    for row in run.rows:
        assert row.value > 0 and row.unit == "GB/s" and row.n == store_bench_dram.QUICK["reps"], row.metric
        label = row.metric.rsplit("_", 1)[1]
        memcpy = by[f"memcpy_GBps_{label}"]
        if row is memcpy:
            assert not row.baseline  # the memcpy row IS the baseline
        else:  # every store figure is compared with the memcpy of the SAME block size, from the same run
            assert (row.baseline, row.baseline_value) == (memcpy.subject, memcpy.value), row.metric
    assert (run.root / "store_dram" / "raw.csv").stat().st_size > 0
