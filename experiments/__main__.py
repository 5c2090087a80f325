"""``python -m experiments``: run every registered study, then draw the figures and write the report.

``--profile quick`` (the default: every study in reduced form, results marked ``quick``) or
``--profile full`` (the report's numbers); ``--only a,b`` runs a subset; ``--no-report`` skips the
figures and report. Progress is printed per study with its wall time. With the default results
root the figures, report, README block and notebook of the repository are regenerated; with
``--results-root DIR`` they are written under ``DIR/_paper/`` instead.
"""

from __future__ import annotations

import argparse
import sys
import time

from experiments.studies import STUDIES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=("quick", "full"), default="quick")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(STUDIES.names())}")
    ap.add_argument("--results-root", default=None, help="results directory (default: results/)")
    ap.add_argument("--no-report", action="store_true", help="run the studies only")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(STUDIES.names())
    for n in names:
        STUDIES.check(n)  # one line listing the studies for a wrong name
    t_all = time.monotonic()
    for i, name in enumerate(names, 1):
        study = STUDIES[name]
        print(f"[experiments] ({i}/{len(names)}) {name}: {args.profile} profile ...", flush=True)
        t0 = time.monotonic()
        study.load().run(quick=args.profile == "quick", results_root=args.results_root)
        print(f"[experiments] ({i}/{len(names)}) {name} done in {time.monotonic() - t0:.0f} s", flush=True)
    print(f"[experiments] {len(names)} studies in {time.monotonic() - t_all:.0f} s", flush=True)
    if not args.no_report:
        import subprocess
        from pathlib import Path

        from experiments import figures, report

        if args.results_root is None:  # the repository's own results: regenerate the paper and README
            figures.main([])
            report.main([])
            subprocess.run([sys.executable, "notebooks/make_notebook.py", "--execute"], check=True)
        else:  # results elsewhere: their figures and report go beside them, the README is left alone
            paper = Path(args.results_root) / "_paper"
            figures.main(["--results-root", args.results_root, "--out", str(paper / "figures")])
            report.main(["--results-root", args.results_root, "--out", str(paper / "report.md"), "--readme", ""])
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as exc:  # an unknown study name
        print(f"python -m experiments: {exc}", file=sys.stderr)
        sys.exit(2)
