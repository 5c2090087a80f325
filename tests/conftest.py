"""Shared test configuration.

- Hypothesis profiles picked by $HYPOTHESIS_PROFILE (ci | dev).
- ``trace_path``: the shared Mooncake conversation trace, found ONLY through
  ``quillcache.traces.loader.default_trace_path()`` (which honours $QUILLCACHE_TRACE); a test that
  takes the fixture is skipped, naming the path it looked at, when the file is absent.
- ``quick_run``: an experiment's quick profile, run at most ONCE per test process (every test that
  checks its output shares the run). ``make test``'s xdist workers keep a file's tests together and
  no study is checked by two files, so it never runs a benchmark twice.
- ``read_summary``: read a ``summary.csv`` and check it against the results convention and against
  the rows the study returned (``quillcache.results``; nothing about speed).
"""

import csv
import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from quillcache.traces.loader import default_trace_path

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=60, deadline=None)
# `make fuzz`: the fuzz targets (tests/fuzz/) with a large budget; everything else unchanged
settings.register_profile("fuzz", max_examples=int(os.environ.get("QUILLCACHE_FUZZ_EXAMPLES", "20000")),
                          deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture(scope="session")
def trace_path() -> Path:
    """The shared Mooncake trace (``default_trace_path()``); skips the test when it is absent."""
    path = default_trace_path()
    if not path.is_file():
        pytest.skip(f"shared Mooncake trace {path} is absent (put it in ../shared/traces or set $QUILLCACHE_TRACE)")
    return path


@dataclass(frozen=True)
class QuickRun:
    """What ``<module>.run(quick=True, results_root=root)`` returned, and the root it wrote under."""

    rows: list
    root: Path


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory) -> Callable[[str], QuickRun]:
    """``quick_run("experiments.store_bench_dram")``: run that module's quick profile on first use
    (results in a fresh temporary root), return the same ``QuickRun`` on every later call."""
    done: dict[str, QuickRun] = {}

    def run(module: str) -> QuickRun:
        if module not in done:
            root = tmp_path_factory.mktemp(module.rsplit(".", 1)[-1])
            rows = importlib.import_module(module).run(quick=True, results_root=str(root))
            done[module] = QuickRun(rows=list(rows), root=root)
        return done[module]

    return run


# The results convention's column order, written out here rather than imported, so a change to it is seen.
SUMMARY_HEADER = ("metric", "subject", "value", "unit", "baseline", "baseline_value", "ratio", "n", "p10", "p90",
                  "notes")


def _read_summary(path: Path, rows: list | None = None) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        fields = tuple(reader.fieldnames or ())
        assert fields[:len(SUMMARY_HEADER)] == SUMMARY_HEADER, reader.fieldnames
        params = fields[len(SUMMARY_HEADER):]  # one typed column per parameter, sorted by name
        assert list(params) == sorted(params), params
        got = list(reader)
    assert got, f"{path} has no rows"
    seen = set()
    for r in got:
        ident = (r["metric"], r["subject"], r["baseline"], *(r[p] for p in params))
        assert ident not in seen, f"{path}: row {ident} written twice"
        seen.add(ident)
        assert r["unit"], f"{path}: {ident} has no unit"
        assert math.isfinite(float(r["value"])), ident
        assert int(r["n"]) >= 1, ident
        if r["baseline"]:  # measured against a baseline in the same run: both figures are real
            assert float(r["baseline_value"]) > 0 and math.isfinite(float(r["baseline_value"])), ident
            assert math.isfinite(float(r["ratio"])), ident
        else:
            assert math.isnan(float(r["ratio"])), ident
    if rows is not None:  # the file holds exactly what the study returned, in order, values unrounded
        assert [(r["metric"], r["subject"], r["unit"], r["baseline"], float(r["value"]), int(r["n"])) for r in got] \
            == [(r.metric, r.subject, r.unit, r.baseline, r.value, r.n) for r in rows]
        assert [{p: r[p] for p in params if r[p] != ""} for r in got] == \
            [{k: str(v) for k, v in r.params.items()} for r in rows]
    return got


@pytest.fixture(scope="session")
def read_summary() -> Callable[..., list[dict[str, str]]]:
    """``read_summary(path, rows=None)``: the summary's rows as dicts of strings, checked (see
    ``_read_summary``); ``rows``: the ``SummaryRow`` list the study returned."""
    return _read_summary
