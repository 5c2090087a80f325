"""The storage study runs end to end on a small workload and writes a well-formed summary."""

import csv

import pytest

from quillcache.traces.loader import default_trace_path


@pytest.mark.skipif(not default_trace_path().exists(), reason="shared Mooncake trace not present")
def test_storage_study_quick(tmp_path):
    from experiments import storage_study

    storage_study.main(["--quick", "--results-root", str(tmp_path), "--workdir", str(tmp_path / "work")])
    with open(tmp_path / "storage" / "summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    subjects = {r["subject"] for r in rows}
    assert {"art", "rocksdb", "flat", "sorted"} <= subjects
    by = {(r["metric"], r["subject"], r["baseline"]): r for r in rows}
    flat_vs_art = by[("prefix_scan_p50@10000", "flat", "art")]
    assert float(flat_vs_art["ratio"]) > 1  # O(N) scan is slower than the tree at any size
    assert (tmp_path / "storage" / "cells.csv").exists()


@pytest.mark.skipif(not default_trace_path().exists(), reason="shared Mooncake trace not present")
def test_churn_batches_replay_to_the_live_set():
    from experiments.storage_workload import residency_churn
    from quillcache.traces.loader import load_trace

    # tiny tiers: a long request overflows DRAM and SSD within itself, touching keys twice
    w = residency_churn(load_trace(limit=2000), 300, num_nodes=2, num_tenants=2)
    state = {}
    for b in w.batches:  # the contract every backend relies on: puts first, then removes
        for e in b.puts:
            state[e.key] = e
        for k in b.removes:
            del state[k]
    assert state == w.live
    assert w.num_removes > 0
