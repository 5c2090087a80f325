"""The storage study runs end to end (once) on a small workload and writes a well-formed summary;
the churn workload it replays keeps its puts-then-removes contract."""


def test_storage_study_quick(tmp_path, trace_path, read_summary):
    from experiments import storage_study

    storage_study.main(["--quick", "--trace", str(trace_path), "--results-root", str(tmp_path),
                        "--workdir", str(tmp_path / "work")])
    rows = read_summary(tmp_path / "storage" / "summary.csv")
    subjects = {r["subject"] for r in rows}
    assert {"art", "rocksdb", "flat", "sorted"} <= subjects
    assert {r["entries"] for r in rows} == {"10000"}  # the entry count is a column, not part of the metric
    by = {(r["metric"], r["subject"], r["baseline"]): r for r in rows}
    flat_vs_art = by[("prefix_scan_p50", "flat", "art")]
    # the baseline figure is the tree's own row of the same metric, from the same run
    assert float(flat_vs_art["baseline_value"]) == float(by[("prefix_scan_p50", "art", "rocksdb")]["value"])
    assert float(flat_vs_art["ratio"]) > 1  # O(N) scan is slower than the tree at any size
    assert (tmp_path / "storage" / "cells.csv").exists()


def test_churn_batches_replay_to_the_live_set(trace_path):
    from quillcache.traces.churn import residency_churn
    from quillcache.traces.loader import load_trace

    # tiny tiers: a long request overflows DRAM and SSD within itself, touching keys twice
    w = residency_churn(load_trace(trace_path, limit=2000), 300, num_nodes=2, num_tenants=2)
    state = {}
    for b in w.batches:  # the contract every backend relies on: puts first, then removes
        for e in b.puts:
            state[e.key] = e
        for k in b.removes:
            del state[k]
    assert state == w.live
    assert w.num_removes > 0
