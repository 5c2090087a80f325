"""Strict JSON for request bodies, shared by the project's HTTP servers (the gateway, the STAND-IN engine).

Invariants:
- A body decodes as RFC 8259 JSON or raises ``BodyError`` whose message names what is wrong: not JSON
  at all, a non-standard constant (``NaN``, ``Infinity``, ``-Infinity``, which Python's own parser
  accepts), or nesting too deep for the parser (``RecursionError`` caught; the caller's own depth
  limit on what did parse stays the caller's).
- Every number in a decoded value is finite: a valid JSON number that overflows a 64-bit float
  (``1e400``, which Python parses to ``inf``) raises ``BodyError`` naming the field it is in and the
  number, so a decoded body always re-serialises as JSON (never as the non-JSON ``Infinity``).
- The encoding is detected as ``json.loads`` does (UTF-8/16/32 with or without BOM).
- One decoder per process: ``json.loads(**kw)`` would build one per call.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["BodyError", "loads_strict"]


class BodyError(ValueError):
    """A request body that is not strict JSON; ``str()`` is a message fit for a 400 answer."""


class _Constant(ValueError):
    pass


class _Overflow(ValueError):
    pass


class _Marked(float):
    """A number that overflowed, kept as text by the locating decoder (only on the error path)."""

    __slots__ = ("text",)


def _refuse_constant(name: str) -> Any:
    raise _Constant(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Overflow(text)
    return value


def _mark_overflow(text: str) -> float:
    value = float(text)
    if math.isfinite(value):
        return value
    marked = _Marked(value)
    marked.text = text
    return marked


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
_LOCATOR = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_mark_overflow)


def _show(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _overflow_path(value: Any) -> tuple[str, str] | None:
    """(the path of the first overflowed number in ``value``, its text) - ``temperature``, ``a.b[2]``."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, _Marked):
            return path, v.text
        if isinstance(v, dict):
            stack.extend((x, f"{path}.{k}" if path else k) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None


def _overflow_message(text: str, fallback: str) -> str:
    try:
        found = _overflow_path(_LOCATOR.decode(text))
    except (ValueError, RecursionError):  # invalid past the number: still name the number
        found = None
    path, number = found if found is not None else ("", fallback)
    where = f" field {_show(path, 80)!r}" if path else ""
    return (f"request body{where}: the number {_show(number)} is out of range (it overflows a 64-bit float; "
            "send a finite number)")


def loads_strict(raw: bytes, max_depth: int | None = None) -> Any:
    """``raw``'s JSON value; ``BodyError`` otherwise. ``max_depth`` is only named in the message for a body
    too deeply nested to parse at all."""
    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        return _DECODER.decode(text)
    except _Constant as exc:
        raise BodyError(f"request body is not valid JSON: {exc} is not a JSON value (send a number, or null)") \
            from None
    except _Overflow as exc:
        raise BodyError(_overflow_message(text, str(exc))) from None
    except RecursionError:
        limit = "" if max_depth is None else f" (more than {max_depth} levels)"
        raise BodyError(f"request body is nested too deeply{limit}") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise BodyError(f"request body is not valid JSON: {exc}"[:200]) from None
