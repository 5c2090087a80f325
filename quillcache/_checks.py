"""The one set of argument validators every public API uses (ints, floats, fractions, choices).

Contract:
- ``check_int`` accepts Python and NumPy integers (``numbers.Integral``) and refuses ``bool``,
  NumPy bools, 0-d arrays and everything else with a ``TypeError`` naming the argument, its type and its value;
  a value outside ``[lo, hi]`` raises ``ValueError`` naming the argument, the value and the bounds.
- ``check_float`` accepts real numbers (ints included, ``bool`` refused), refuses NaN and
  infinities, and checks ``lo <= value`` (``lo < value`` with ``lo_open``) and ``value <= hi``
  (``value < hi`` with ``hi_open``); ``finite=False`` lets ``+inf`` through where "unlimited" is
  meaningful (NaN is always refused).
- ``check_buffer`` gives any C-contiguous buffer as a flat view of its bytes (``len`` = bytes, not
  items) and refuses other objects and non-contiguous buffers with a ``TypeError`` naming the argument.
- Callers may pass their own exception classes (``error`` for a bad value, ``type_error`` for a
  bad type) so a component keeps its typed errors (e.g. ``AllocatorError``) while sharing the
  checks and the wording of the messages.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Collection

__all__ = ["check_buffer", "check_choice", "check_float", "check_fraction", "check_int", "is_int"]


def is_int(value: object) -> bool:
    """True for Python and NumPy integers, False for ``bool`` and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None, *,
              error: type[Exception] = ValueError, type_error: type[Exception] = TypeError) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (either bound may be None)."""
    if type(value) is not int:
        if not is_int(value):
            raise type_error(f"{name} must be an integer, got {type(value).__name__} {value!r}")
        value = operator.index(value)  # type: ignore[arg-type]
    if (lo is not None and value < lo) or (hi is not None and value > hi):  # type: ignore[operator]
        raise error(f"{name}={value} must be {_bounds(lo, hi)}")
    return value  # type: ignore[return-value]


def check_float(name: str, value: object, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False, hi_open: bool = False, finite: bool = True,
                error: type[Exception] = ValueError, type_error: type[Exception] = TypeError) -> float:
    """``value`` as a float with ``lo <= value <= hi`` (strict where ``lo_open`` / ``hi_open``)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_" or not isinstance(value, numbers.Real):
        raise type_error(f"{name} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if math.isnan(v) or (finite and not math.isfinite(v)):
        raise error(f"{name}={v} must be finite")
    if ((lo is not None and (v <= lo if lo_open else v < lo))
            or (hi is not None and (v >= hi if hi_open else v > hi))):
        raise error(f"{name}={v} must be {_bounds(lo, hi, lo_open, hi_open)}")
    return v


def check_fraction(name: str, value: object, *, error: type[Exception] = ValueError) -> float:
    """A float in ``[0, 1]``."""
    return check_float(name, value, 0.0, 1.0, error=error)


def check_choice(name: str, value: object, choices: Collection[str], *,
                 error: type[Exception] = ValueError) -> str:
    """``value`` if it is one of ``choices``; otherwise an error listing them."""
    if not isinstance(value, str) or value not in choices:
        raise error(f"{name}={value!r} must be one of {sorted(choices)}")
    return value


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"{'<' if hi_open else '<='} {hi}"


def check_buffer(name: str, value: object) -> memoryview:
    """``value`` as a 1-D unsigned-byte view of its bytes (module docstring)."""
    try:
        view = memoryview(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be bytes, bytearray or a contiguous buffer, got {type(value).__name__}") from None
    if not view.c_contiguous:
        raise TypeError(f"{name} must be a C-contiguous buffer, got a non-contiguous {type(value).__name__} "
                        f"(shape {view.shape}, strides {view.strides}); copy it with bytes() first")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view
