"""Every registered microbenchmark runs its quick profile ONCE per session (``quick_run``) and
writes a summary that follows the results convention and holds exactly the rows it returned.

Nothing here asserts speed (timings live in ``results/``, never in unit tests).
"""

import math

import pytest

from experiments.studies import STUDIES

MICROBENCHES = [name for name in STUDIES.names() if name.startswith("microbench_")]


def test_every_study_module_has_run_and_plot():
    for name in STUDIES.names():
        mod = STUDIES[name].load()
        assert callable(getattr(mod, "run", None)) and callable(getattr(mod, "plot", None)), name


@pytest.mark.parametrize("name", MICROBENCHES)
def test_bench_quick_writes_summary(name, quick_run, read_summary):
    run = quick_run(STUDIES[name].module)
    assert run.rows, f"{name} produced no rows"
    read_summary(run.root / name / "summary.csv", run.rows)
    # a benchmark measures something: every figure is a positive rate or time, and every
    # comparison names a baseline measured in the same run with a real value
    for row in run.rows:
        assert row.value > 0 and math.isfinite(row.value), (name, row.metric, row.subject)
        if row.baseline:
            assert row.baseline != row.subject, (name, row.metric)  # nothing is its own baseline
        if not math.isnan(row.p10):  # repeated: the spread comes with the median
            assert row.p10 <= row.value <= row.p90, (name, row.metric, row.subject)
    assert (run.root / name / "meta.json").is_file()
    assert STUDIES[name].load().plot(str(run.root), run.root / "figures").stat().st_size > 0
