"""The tidy results schema: one ``SummaryRow`` per measured cell.

A row names what was measured (``metric``), on what (``subject``), its value and ``unit``, and
the baseline measured *in the same run* (``baseline``, ``baseline_value``; ``ratio = value /
baseline_value``). Parameters of the cell (capacity, backend, block size, entries, …) are typed
values in ``params``; each becomes a column of its own in ``summary.csv``, so a reader never
parses them out of a metric name. ``p10``/``p90`` carry the spread of repeated measurements
whose median is ``value``.

Invariants:
- a metric name holds no parameter (``hit_rate`` with ``capacity_blocks=1000``, never
  ``hit_rate@1k``); ``write_summary`` refuses a metric containing ``@``;
- figures reported elsewhere (papers, the seed) are never a row's baseline: they are
  ``Anchor`` records in ``anchors.csv`` (``quillcache.results.anchors``);
- notes never hold an absolute path of the machine that ran the study;
- every row a constructor accepts reads back: ``n`` is an integer (not a bool), ``value``,
  ``baseline_value``, ``p10`` and ``p90`` (an anchor's ``value``) real numbers that fit a float
  (not a bool, not text; NaN and infinities are numbers), else the constructor raises a TypeError
  or ValueError naming the field.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Mapping, Union

ParamValue = Union[int, float, str, bool]

# The fixed columns, in file order; parameter columns follow them, sorted by name.
SUMMARY_COLUMNS = ("metric", "subject", "value", "unit", "baseline", "baseline_value", "ratio", "n", "p10", "p90",
                   "notes")

_PARAM_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Columns a reader adds (``read_summary``) that a parameter may not shadow.
RESERVED_COLUMNS = frozenset(SUMMARY_COLUMNS) | {"study", "profile"}


def _check_param(name: str, value: object) -> None:
    if not isinstance(name, str) or not _PARAM_NAME.match(name):
        raise ValueError(f"parameter name {name!r} must be lower_snake_case (letters, digits, _)")
    if name in RESERVED_COLUMNS:
        raise ValueError(f"parameter name {name!r} is a reserved results column")
    if isinstance(value, bool) or isinstance(value, (int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"parameter {name}={value!r} is not a finite number")
        return
    raise TypeError(f"parameter {name}={value!r} is a {type(value).__name__}; use int, float, str or bool")


def _check_real(where: str, name: str, value: object) -> None:
    """A real number the writer writes as text the reader parses back (``repr``/``str``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name}={value!r} is a {type(value).__name__}; it must be a real number "
                        f"(int or float; NaN for none)")
    try:
        float(value)
        text = float.__repr__(value) if isinstance(value, float) else str(value)  # as the csv module writes it
        float(text)
    except (ValueError, OverflowError):
        raise ValueError(f"{where}: {name} (type {type(value).__name__}) does not fit a float or is not written as "
                         f"one, so it would not read back; pass a float") from None


def _check_count(where: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: n={value!r} is a {type(value).__name__}; it must be an integer (the number "
                        f"of measurements)")


@dataclass(frozen=True, kw_only=True)
class SummaryRow:
    """One measured figure, with the baseline it was measured against in the same run."""

    metric: str
    subject: str
    value: float
    unit: str
    baseline: str = ""
    baseline_value: float = math.nan
    n: int = 1
    p10: float = math.nan
    p90: float = math.nan
    notes: str = ""
    params: Mapping[str, ParamValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"SummaryRow({self.metric!r}, {self.subject!r})"
        for name in ("value", "baseline_value", "p10", "p90"):
            _check_real(where, name, getattr(self, name))
        _check_count(where, self.n)
        for name, value in self.params.items():
            _check_param(name, value)

    @property
    def ratio(self) -> float:
        if not self.baseline or not math.isfinite(self.baseline_value) or self.baseline_value == 0:
            return math.nan
        return self.value / self.baseline_value

    def as_dict(self) -> dict:
        """The fixed columns (``SUMMARY_COLUMNS`` order) followed by the parameters."""
        d = {k: getattr(self, k) for k in SUMMARY_COLUMNS if k != "ratio"}
        d["ratio"] = self.ratio
        out = {k: d[k] for k in SUMMARY_COLUMNS}
        out.update(self.params)
        return out

    @classmethod
    def from_spread(cls, samples_spread: Mapping[str, float], **kw) -> "SummaryRow":
        """A row whose value is the median of ``spread(samples)`` and whose p10/p90 come with it."""
        return cls(value=samples_spread["median"], p10=samples_spread["p10"], p90=samples_spread["p90"], **kw)


@dataclass(frozen=True, kw_only=True)
class Anchor:
    """A figure reported outside this repository (a paper, the seed, a vendor's page), kept for
    comparison and never used as a same-run baseline. ``source`` says where it comes from."""

    metric: str
    subject: str
    value: float
    unit: str
    source: str
    notes: str = ""
    params: Mapping[str, ParamValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.source.strip():
            raise ValueError(f"anchor {self.metric!r}/{self.subject!r} needs a source")
        _check_real(f"Anchor({self.metric!r}, {self.subject!r})", "value", self.value)
        for name, value in self.params.items():
            _check_param(name, value)

    def as_dict(self) -> dict:
        out = {"metric": self.metric, "subject": self.subject, "value": self.value, "unit": self.unit,
               "source": self.source, "notes": self.notes}
        out.update(self.params)
        return out


ANCHOR_COLUMNS = ("metric", "subject", "value", "unit", "source", "notes")
