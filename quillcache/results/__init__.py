"""Results: the schema every study writes and the API a researcher reads them with.

Writing (studies): ``SummaryRow`` (one measured cell, typed ``params``, same-run baseline),
``Anchor`` (a figure reported elsewhere), ``write_summary`` (summary.csv + meta.json +
anchors.csv), ``write_raw``, ``spread``, ``print_table``.

Reading (notebooks, figures, the report): ``list_studies``, ``read_summary``, ``read_raw``,
``read_anchors``, ``read_meta``, ``read_all``. Importing this package loads neither pandas nor
matplotlib; the readers import pandas when first called.
"""

from __future__ import annotations

from quillcache.results.meta import PROFILES, RunMeta
from quillcache.results.schema import ANCHOR_COLUMNS, SUMMARY_COLUMNS, Anchor, ParamValue, SummaryRow
from quillcache.results.stats import spread
from quillcache.results.table import fmt_number, print_table
from quillcache.results.writer import results_dir, results_root, write_raw, write_summary

_READERS = ("list_studies", "read_summary", "read_raw", "read_anchors", "read_meta", "read_all",
            "ResultsFormatError", "ResultsNotFoundError")

__all__ = ["ANCHOR_COLUMNS", "Anchor", "PROFILES", "ParamValue", "RunMeta", "SUMMARY_COLUMNS", "SummaryRow",
           "fmt_number", "print_table", "results_dir", "results_root", "spread", "write_raw", "write_summary",
           *_READERS]


def __getattr__(name: str):
    if name in _READERS:
        from quillcache.results import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'quillcache.results' has no attribute {name!r}")
