"""Regenerate every study's figure from ``results/`` (``make figures``).

Plotting reads only ``results/``; it never re-runs an experiment. Every study registered in
``experiments.studies.STUDIES`` whose results are present draws its own figure(s) into
``paper/figures/``; a results folder that is not a registered study (say, the output of
``quillcache replay --out results/mine``) is named and skipped. Importing this module changes no
matplotlib state (the studies draw with the object API, see ``experiments.plotstyle``).

Every drawing records what it drew in the figures folder's manifest (``MANIFEST``: study -> the
figure files its ``plot()`` returned this time, relative to the folder), replacing the previous
manifest, so the report embeds exactly this run's figures and never a file left over from an
earlier run that this run's ``plot()`` did not draw (a study whose rows for a figure are absent).
Invariant: a study is in the manifest only if its ``plot()`` returned in this drawing, and every
file listed was returned by it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from experiments.studies import STUDIES
from quillcache.results import list_studies


MANIFEST = "drawn.json"


def draw_all(results_root: str | None = None, out_dir: str | Path = "paper/figures") -> dict[str, list[Path]]:
    """Draw every registered study that has results; return the figure paths per study and record
    them in ``out_dir/MANIFEST`` (also when a study's ``plot()`` fails: then the manifest holds the
    studies drawn before it, and the error propagates)."""
    present = set(list_studies(results_root))
    drawn: dict[str, list[Path]] = {}
    try:
        for name in STUDIES.names():
            if name not in present:
                continue
            out = STUDIES[name].load().plot(results_root, out_dir)
            drawn[name] = list(out) if isinstance(out, (list, tuple)) else [out]
    finally:
        write_manifest(out_dir, drawn)
    return drawn


def write_manifest(out_dir: str | Path, drawn: dict[str, list[Path]]) -> Path:
    """Replace ``out_dir/MANIFEST`` with ``drawn`` (paths stored relative to ``out_dir``; a figure
    outside it is an error naming the study, since the report could not embed it)."""
    base = Path(out_dir)
    base.mkdir(parents=True, exist_ok=True)
    rel: dict[str, list[str]] = {}
    for name, paths in drawn.items():
        rel[name] = []
        for p in paths:
            try:
                rel[name].append(Path(p).resolve().relative_to(base.resolve()).as_posix())
            except ValueError:
                raise ValueError(f"{name}: plot() returned {str(p)!r}, outside the figures folder {str(base)!r}; "
                                 "the report embeds figures from that folder only") from None
    path = base / MANIFEST
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rel, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(out_dir: str | Path) -> dict[str, list[str]] | None:
    """The figures the last drawing into ``out_dir`` drew, per study (relative file names), or None
    when that folder has no manifest (figures drawn before manifests were recorded)."""
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); run `make figures`") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, list)
                                            and all(isinstance(f, str) for f in v) for k, v in raw.items()):
        raise ValueError(f"{path}: expected {{study: [figure file, ...]}}; run `make figures`")
    return raw


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
