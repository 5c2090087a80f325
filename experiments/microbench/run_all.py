"""Run every microbenchmark (``make bench``) and print where the results went.

Benchmarks are registered by name in ``BENCHMARKS``; each module exposes
``run(quick=False, results_root=None) -> list[SummaryRow]``. ``--quick`` runs the small
configuration (used by the smoke test); ``--only a,b`` selects benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import time

BENCHMARKS: dict[str, str] = {
    "hashing": "experiments.microbench.bench_hashing",
    "alloc": "experiments.microbench.bench_alloc",
    "sketch": "experiments.microbench.bench_sketch",
    "planner": "experiments.microbench.bench_planner",
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small, fast configuration")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {sorted(BENCHMARKS)}")
    ap.add_argument("--results-root", default=None, help="results directory (default: results/)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; registered: {sorted(BENCHMARKS)}")
    for name in names:
        mod = importlib.import_module(BENCHMARKS[name])
        t0 = time.perf_counter()
        rows = mod.run(quick=args.quick, results_root=args.results_root)
        print(f"[{name}] {len(rows)} rows in {time.perf_counter() - t0:.1f} s -> results/microbench_{name}/summary.csv")


if __name__ == "__main__":
    main()
