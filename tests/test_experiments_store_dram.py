"""The DRAM store benchmark runs in quick mode and writes a well-formed summary (no timing asserts)."""

import csv

import pytest

from experiments import store_bench_dram
from quillcache.results import SUMMARY_COLUMNS


def test_store_bench_dram_quick_writes_summary(tmp_path):
    rows = store_bench_dram.run(quick=True, results_root=str(tmp_path))
    metrics = {r.metric for r in rows}
    for label in ("64KiB", "2MiB", "32MiB"):
        assert {f"memcpy_GBps_{label}", f"put+get_GBps_{label}", f"put_GBps_{label}"} <= metrics
    with open(tmp_path / "store_dram" / "summary.csv") as fh:
        got = list(csv.DictReader(fh))
    assert tuple(got[0].keys()) == SUMMARY_COLUMNS and len(got) == len(rows)
    for row in got:
        assert float(row["value"]) > 0
        if row["baseline"]:
            assert float(row["ratio"]) == pytest.approx(float(row["value"]) / float(row["baseline_value"]))
    assert (tmp_path / "store_dram" / "raw.csv").stat().st_size > 0
