"""Every registered microbenchmark runs in quick mode and writes a well-formed summary.

This checks that benchmarks keep working; it asserts nothing about speed (timings live in
``results/``, never in unit tests).
"""

import csv
import importlib

import pytest

from experiments.microbench.run_all import BENCHMARKS
from quillcache.results import SUMMARY_COLUMNS


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_quick_writes_summary(name, tmp_path):
    mod = importlib.import_module(BENCHMARKS[name])
    rows = mod.run(quick=True, results_root=str(tmp_path))
    assert rows, f"{name} produced no rows"
    path = tmp_path / f"microbench_{name}" / "summary.csv"
    with open(path) as fh:
        got = list(csv.DictReader(fh))
    assert got and tuple(got[0].keys()) == SUMMARY_COLUMNS
    # every row with a baseline has its ratio computed from the two measured values
    for row in got:
        if row["baseline"]:
            assert float(row["baseline_value"]) > 0
            assert float(row["ratio"]) == pytest.approx(float(row["value"]) / float(row["baseline_value"]))


def test_figures_and_report_from_results(tmp_path):
    from experiments import figures, report
    from quillcache.results import SummaryRow, write_summary

    write_summary(
        "demo",
        [SummaryRow(metric="rate", subject="fast", value=100.0, unit="ops/s", baseline="slow", baseline_value=4.0, n=5)],
        root=tmp_path,
    )
    figures.main(["--results-root", str(tmp_path), "--out", str(tmp_path / "paper" / "figures")])
    assert (tmp_path / "paper" / "figures" / "demo.png").stat().st_size > 0
    report.main(["--results-root", str(tmp_path), "--out", str(tmp_path / "paper" / "report.md")])
    text = (tmp_path / "paper" / "report.md").read_text()
    assert "| rate | fast | 100 | ops/s | slow | 4 | 25 | 5 |" in text
