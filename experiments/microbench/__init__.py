"""Microbenchmarks: each module exposes ``run(quick=False, results_root=None) -> list[SummaryRow]``
and ``main(argv=None)`` (via :func:`bench_main`), and is registered in ``experiments.studies.STUDIES``."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def bench_main(run: Callable[..., object], doc: str | None, argv: list[str] | None = None) -> None:
    """The shared command line of a microbenchmark: ``--quick`` and ``--results-root``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small, fast configuration (< 20 s; the smoke test)")
    ap.add_argument("--results-root", default=None, help="results directory (default: results/)")
    args = ap.parse_args(argv)
    run(quick=args.quick, results_root=args.results_root)
