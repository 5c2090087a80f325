"""Regenerate every study's figure from ``results/`` (``make figures``).

Plotting reads only ``results/``; it never re-runs an experiment. Every study registered in
``experiments.studies.STUDIES`` whose results are present draws its own figure(s) into
``paper/figures/``; a results folder that is not a registered study (say, the output of
``quillcache replay --out results/mine``) is named and skipped. Importing this module changes no
matplotlib state (the studies draw with the object API, see ``experiments.plotstyle``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.studies import STUDIES
from quillcache.results import list_studies


def draw_all(results_root: str | None = None, out_dir: str | Path = "paper/figures") -> dict[str, list[Path]]:
    """Draw every registered study that has results; return the figure paths per study."""
    present = set(list_studies(results_root))
    drawn: dict[str, list[Path]] = {}
    for name in STUDIES.names():
        if name not in present:
            continue
        out = STUDIES[name].load().plot(results_root, out_dir)
        drawn[name] = list(out) if isinstance(out, (list, tuple)) else [out]
    return drawn


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-root", default=None, help="results directory (default: results/)")
    ap.add_argument("--out", default="paper/figures")
    args = ap.parse_args(argv)
    present = list_studies(args.results_root)
    if not present:
        raise SystemExit(f"no results/*/summary.csv under {args.results_root or 'results'}; run `make experiments`")
    for name, paths in draw_all(args.results_root, args.out).items():
        print(f"{name}: {', '.join(str(p) for p in paths)}")
    for name in present:
        if name not in STUDIES:
            print(f"{name}: not a registered study (experiments/studies.py); no figure drawn")


if __name__ == "__main__":
    main()
