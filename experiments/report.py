"""Regenerate ``paper/report.md``, ``paper/report.html`` and the README's measured block from
``results/`` (``make paper``).

Every number in the report is filled in by a Jinja2 template (``paper/templates/``) from a
study's results through :class:`StudyView`; none is typed by hand (a test extracts every number
of the generated text and finds it in ``results/``). Each registered study has a section template
``sections/<name>.md.j2`` defining two macros: ``section(s)`` (question, setup, anchor, result,
figure, what does not hold) and ``headline(s)`` (the paragraph the README shows). The README
keeps its hand-written prose; only the text between ``<!-- measured:begin -->`` and
``<!-- measured:end -->`` is generated. Regenerating without new results changes only the
generated-at line of the report.

Every registered study (``experiments.studies.STUDIES``) is accounted for: one with results gets its
row and section; one without is listed in the runs table and the README block as having no results
in this root, with the make target that produces them, so a study that never ran or failed cannot
vanish silently. A study's figures are the files the figure step (``experiments.figures.draw_all``)
recorded as drawn for it in the figures folder's manifest; a figure file left there by an earlier
run is not embedded. (Only a figures folder without a manifest, drawn before manifests existed, falls
back to every ``<study>*.png`` in it.) A run whose profile is not ``full`` says so in its section.
"""

from __future__ import annotations

import argparse
import base64
import math
import re
from datetime import datetime, timezone
from pathlib import Path

from experiments.figures import MANIFEST, read_manifest
from experiments.studies import STUDIES, Study
from quillcache.results import list_studies, read_anchors, read_summary

TEMPLATES = Path(__file__).resolve().parents[1] / "paper" / "templates"
README_BEGIN = "<!-- measured:begin -->"
README_END = "<!-- measured:end -->"


class ReportDataError(LookupError):
    """A template asked for a result that is not there (or is there more than once)."""


# ---------------------------------------------------------------- number formats (also used by the tests)


def fmt_num(v, digits: int = 4) -> str:
    """``digits`` significant digits below 1,000; from 1,000 up a whole number with thousands
    separators; integers as integers."""
    v = float(v)
    if not math.isfinite(v):
        return "n/a"
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v):,}"
    if abs(v) >= 1_000:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def fmt_pct(v, decimals: int = 1) -> str:
    """A fraction as a percentage: 0.2374 -> '23.7%' (NaN: 'n/a')."""
    v = float(v)
    return "n/a" if not math.isfinite(v) else f"{100.0 * v:.{decimals}f}%"


def fmt_x(v, digits: int = 3) -> str:
    """A ratio: 24.87 -> '24.9x' (NaN or infinite: 'n/a')."""
    v = float(v)
    return "n/a" if not math.isfinite(v) else f"{v:.{digits}g}x"


def fmt_inv(v, digits: int = 3) -> str:
    """The inverse of a ratio as a ratio: 0.04 -> '25x' (0, NaN or infinite: 'n/a')."""
    v = float(v)
    return "n/a" if v == 0 or not math.isfinite(v) else fmt_x(1.0 / v, digits)


def fmt_fixed(v, decimals: int = 3) -> str:
    """``decimals`` decimals (NaN or infinite: 'n/a')."""
    v = float(v)
    return "n/a" if not math.isfinite(v) else f"{v:.{decimals}f}"


def fmt_bytes(v) -> str:
    """A size in binary units: 65536 -> '64 KiB', 2097152 -> '2 MiB', 1000 -> '1,000 B' (NaN: 'n/a')."""
    v = float(v)
    if not math.isfinite(v):
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= scale:
            return f"{fmt_num(v / scale)} {unit}"
    return f"{fmt_num(v)} B"


FILTERS = {"num": fmt_num, "pct": fmt_pct, "x": fmt_x, "fixed": fmt_fixed, "bytes": fmt_bytes,
           "us": lambda v, d=3: fmt_num(float(v) / 1e3, d), "ms": lambda v, d=3: fmt_num(float(v) * 1e3, d),
           "mib": lambda v, d=3: fmt_num(float(v) / 2**20, d), "inv": fmt_inv}


# ---------------------------------------------------------------- what a template sees


class StudyView:
    """One study's results for a template: ``v(metric, subject=None, **params)`` is the single
    matching value (an error if none or several match), ``row(...)`` that whole row, ``rows(...)``
    every match, ``anchor(metric, **params)`` a figure reported elsewhere, ``meta`` the run.

    The summary, the anchors and ``meta`` are one run's: ``meta`` is the one read with the summary
    (under the study's lock), and the anchors are read again until the metadata read with them is
    the same (a run that finished in between); a study rewritten on every try is a
    ``ReportDataError``."""

    READ_TRIES = 3

    def __init__(self, name: str, results_root: str | None):
        self.name = name
        for _ in range(self.READ_TRIES):
            self.df = read_summary(name, results_root)
            self.meta = self.df.attrs["meta"]
            self.anchors = read_anchors(name, results_root)
            if self.anchors.attrs.get("meta") == self.meta:
                break
        else:
            raise ReportDataError(f"{name}: its results changed while being read, {self.READ_TRIES} times (a run "
                                  f"is writing them); generate the report when it has finished")
        self.study = STUDIES[name]
        self.figures: list[str] = []

    def _select(self, df, metric: str, subject: str | None, params: dict, what: str):
        part = df[df["metric"] == metric]
        if subject is not None:
            part = part[part["subject"] == subject]
        for k, want in params.items():
            if k not in part.columns:
                raise ReportDataError(f"{self.name}: no column {k!r} (asked for {what} {metric!r})")
            part = part.loc[[self._same(v, want) for v in part[k]]]
        return part

    @staticmethod
    def _same(v, want) -> bool:
        """Whether a cell holds the value asked for: missing (None, NaN, NA) matches missing;
        numbers match when numerically equal (0 == 0.0, whatever the column's dtype); text and
        booleans only match their own kind exactly (True is not 1, '7' is not 7)."""
        import numbers

        import numpy as np

        if is_na(want) or is_na(v):
            return is_na(want) and is_na(v)
        if isinstance(want, str) or isinstance(v, str):
            return isinstance(want, str) and isinstance(v, str) and v == want
        if isinstance(want, (bool, np.bool_)) or isinstance(v, (bool, np.bool_)):
            return isinstance(want, (bool, np.bool_)) and isinstance(v, (bool, np.bool_)) and bool(v) == bool(want)
        if isinstance(want, numbers.Number) and isinstance(v, numbers.Number):
            return bool(v == want)
        return False

    def rows(self, metric: str, subject: str | None = None, **params) -> list:
        return [r for _, r in self._select(self.df, metric, subject, params, "rows").iterrows()]

    def row(self, metric: str, subject: str | None = None, **params):
        part = self._select(self.df, metric, subject, params, "row")
        if len(part) != 1:
            raise ReportDataError(f"{self.name}: {len(part)} rows match metric={metric!r} subject={subject!r} "
                                  f"{params}; a template value needs exactly one")
        return part.iloc[0]

    def v(self, metric: str, subject: str | None = None, **params) -> float:
        return float(self.row(metric, subject, **params)["value"])

    def anchor(self, metric: str, **params) -> float:
        part = self._select(self.anchors, metric, None, params, "anchor")
        if len(part) != 1:
            raise ReportDataError(f"{self.name}: {len(part)} anchors match {metric!r} {params}")
        return float(part.iloc[0]["value"])

    def anchor_source(self, metric: str, **params) -> str:
        part = self._select(self.anchors, metric, None, params, "anchor")
        return str(part.iloc[0]["source"])

    def values(self, column: str) -> list:
        """The distinct values of a column, in file order (e.g. the capacities swept)."""
        return list(dict.fromkeys(v for v in self.df[column] if not is_na(v)))


def _environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.filters.update(FILTERS)
    env.filters["fmt"] = lambda v, name, *a: FILTERS[name](v, *a)
    env.tests["na"] = is_na
    return env


def is_na(v) -> bool:
    """Missing in a results column (None, NaN or pandas' NA): e.g. an unlimited capacity."""
    if v is None:
        return True
    try:
        import pandas as pd

        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def views(results_root: str | None, figures_dir: Path) -> list[StudyView]:
    """A view of every registered study with results, in registry order, each with the figures the
    last drawing into ``figures_dir`` recorded for it (see the module docstring)."""
    present = set(list_studies(results_root))
    drawn = read_manifest(figures_dir)
    out = []
    for name in STUDIES.names():
        if name in present:
            view = StudyView(name, results_root)
            if drawn is not None:
                view.figures = sorted(f for f in drawn.get(name, []) if (figures_dir / f).is_file())
            else:  # a folder drawn before manifests were recorded: every figure file named after the study
                view.figures = sorted(p.name for p in figures_dir.glob(f"{name}*.png")
                                      if p.stem == name or (p.stem.startswith(name + "_") and p.stem not in STUDIES))
            out.append(view)
    return out


def missing_studies(results_root: str | None) -> list[Study]:
    """The registered studies with no results under ``results_root``, in registry order."""
    present = set(list_studies(results_root))
    return [STUDIES[name] for name in STUDIES.names() if name not in present]


def render_report(results_root: str | None = None, figures_dir: Path = Path("paper/figures"),
                  generated_at: str | None = None) -> str:
    env = _environment()
    vs = views(results_root, figures_dir)
    present = set(list_studies(results_root))
    return env.get_template("report.md.j2").render(
        studies=vs, missing=missing_studies(results_root), unregistered=sorted(present - set(STUDIES.names())),
        generated_at=generated_at or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def render_readme_block(results_root: str | None = None) -> str:
    env = _environment()
    return env.get_template("readme_measured.md.j2").render(studies=views(results_root, Path("paper/figures")),
                                                            missing=missing_studies(results_root))


def splice_readme(readme_text: str, block: str) -> str:
    """Replace the text between the README markers (both must be present, in order)."""
    begin, end = readme_text.find(README_BEGIN), readme_text.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"README has no {README_BEGIN} ... {README_END} block to regenerate")
    return readme_text[:begin + len(README_BEGIN)] + "\n" + block.strip("\n") + "\n" + readme_text[end:]


def to_html(markdown_text: str, base_dir: Path) -> str:
    """A self-contained HTML page: the report with every figure embedded as a data URI."""
    import markdown

    def embed(m: re.Match) -> str:
        path = base_dir / m.group(2)
        if not path.is_file():
            return m.group(0)
        data = base64.b64encode(path.read_bytes()).decode()
        return f"![{m.group(1)}](data:image/png;base64,{data})"

    body = markdown.markdown(re.sub(r"!\[([^\]]*)\]\(([^)]+\.png)\)", embed, markdown_text),
                             extensions=["tables", "fenced_code"])
    style = ("body{font-family:system-ui,sans-serif;max-width:62rem;margin:2rem auto;padding:0 1rem;"
             "line-height:1.45}table{border-collapse:collapse;margin:1rem 0}td,th{border:1px solid #ccc;"
             "padding:.25rem .5rem;text-align:right}td:first-child,th:first-child{text-align:left}"
             "img{max-width:100%}code{background:#f4f4f4;padding:0 .2rem}")
    return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>QuillCache — measured results</title>"
            f"<style>{style}</style></head><body>\n{body}\n</body></html>\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-root", default=None, help="results directory (default: results/)")
    ap.add_argument("--out", default="paper/report.md")
    ap.add_argument("--readme", default="README.md", help="README whose measured block is regenerated ('' = none)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if read_manifest(out.parent / "figures") is None:
        print(f"{out.parent / 'figures'} has no {MANIFEST} (run `make figures`): embedding every figure file "
              "named after a study, which may include figures an earlier run left there")
    text = render_report(args.results_root, out.parent / "figures")
    out.write_text(text)
    out.with_suffix(".html").write_text(to_html(text, out.parent))
    print(f"wrote {out} and {out.with_suffix('.html')}")
    if args.readme:
        readme = Path(args.readme)
        readme.write_text(splice_readme(readme.read_text(), render_readme_block(args.results_root)))
        print(f"regenerated the measured block of {readme}")


if __name__ == "__main__":
    main()
