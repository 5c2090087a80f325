"""Every registered microbenchmark runs its quick profile ONCE per session (``quick_run``) and
writes a summary that follows the results convention and holds exactly the rows it returned.

Nothing here asserts speed (timings live in ``results/``, never in unit tests).
"""

import math

import pytest

from experiments.microbench.run_all import BENCHMARKS


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_quick_writes_summary(name, quick_run, read_summary):
    run = quick_run(BENCHMARKS[name])
    assert run.rows, f"{name} produced no rows"
    read_summary(run.root / f"microbench_{name}" / "summary.csv", run.rows)
    # a benchmark measures something: every figure is a positive rate or time, and every
    # comparison names a baseline measured in the same run with a real value
    for row in run.rows:
        assert row.value > 0 and math.isfinite(row.value), (name, row.metric, row.subject)
        if row.baseline:
            assert row.baseline != row.subject, (name, row.metric)  # nothing is its own baseline


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
    assert "| rate | fast | 100 | ops/s | slow | 4 | 25 | 5 |" in text  # 100 / 4 = 25, written by hand
