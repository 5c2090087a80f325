"""The DRAM store benchmark's quick profile (run once per session) writes a well-formed summary
whose comparisons are wired to the right baseline rows (no timing asserts)."""

from experiments import store_bench_dram

def test_store_bench_dram_quick_writes_summary(quick_run, read_summary):
    run = quick_run("experiments.store_bench_dram")
    read_summary(run.root / "store_dram" / "summary.csv", run.rows)
    by = {(r.params["operation"], r.params["block_bytes"]): r for r in run.rows}
    for size in store_bench_dram.SIZES:
        assert {("memcpy", size), ("put+get", size), ("put", size), ("get", size)} <= set(by)
    for row in run.rows:
        assert row.metric == "throughput" and row.value > 0 and row.unit == "GB/s", row
        assert row.n == store_bench_dram.QUICK["reps"] and row.p10 <= row.value <= row.p90, row
        op, size = row.params["operation"], row.params["block_bytes"]
        memcpy = by[("memcpy", size)]
        if row is memcpy or op in store_bench_dram.NO_BASELINE:
            # the memcpy row IS the baseline; a zero-copy view moves no bytes, so no memcpy ratio
            assert not row.baseline, row
        else:  # every copying figure is compared with the memcpy of the SAME block size, from the same run
            assert (row.baseline, row.baseline_value) == (memcpy.subject, memcpy.value), row
    assert (run.root / "store_dram" / "raw.csv").stat().st_size > 0
