"""The SSD crash study and SSD benchmark run in quick mode and write well-formed summaries.

Nothing here asserts speed. The crash study's correctness figures are asserted (they are
counts, not timings): no acknowledged block lost, no corrupt bytes served, no dangling index
entry, every bit flip detected.
"""

import csv

import pytest

from quillcache.results import SUMMARY_COLUMNS


def _summary(path):
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    assert rows and tuple(rows[0].keys()) == SUMMARY_COLUMNS
    return rows


def test_crash_study_quick(tmp_path, monkeypatch):
    from experiments import crash_study

    monkeypatch.setattr(crash_study, "QUICK", dict(kills=3, powerloss=25, bitflips=10))
    rows = crash_study.run(quick=True, results_root=str(tmp_path))
    by = {(r.metric, r.subject): r.value for r in rows}
    assert by[("crashes", "all")] >= 100
    for (metric, subject), value in by.items():
        if metric in ("acknowledged_blocks_lost", "corrupt_bytes_served", "dangling_index_entries"):
            assert value == 0, (metric, subject)
        if metric == "bitflips_detected":
            assert value == by[("bitflips_injected", subject)], subject
    assert by[("acknowledged_blocks_checked", "powerloss_slab")] > 0
    _summary(tmp_path / "crash" / "summary.csv")
    assert (tmp_path / "crash" / "crash.png").stat().st_size > 0


def test_store_bench_ssd_quick(tmp_path, monkeypatch):
    from experiments import store_bench_ssd

    monkeypatch.setattr(store_bench_ssd, "QUICK", dict(reps=1, sizes=(64 << 10,), batched_bytes=2 << 20,
                                                       single_bytes=1 << 20))
    rows = store_bench_ssd.run(quick=True, results_root=str(tmp_path))
    assert {r.subject for r in rows} == set(store_bench_ssd.SUBJECTS)
    for row in _summary(tmp_path / "store_ssd" / "summary.csv"):
        if row["baseline"]:
            assert float(row["ratio"]) == pytest.approx(float(row["value"]) / float(row["baseline_value"]))
