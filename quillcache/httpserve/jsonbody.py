"""Strict JSON request bodies, shared by the project's HTTP servers (the gateway, the STAND-IN engine):
the declared type, the size cap, the decoding.

Invariants:
- ``check_content_type``: a request that declares a Content-Type other than JSON (``application/json``
  or a ``+json`` type, parameters such as ``charset`` allowed) raises ``UnsupportedMediaType`` (a 415
  answer) naming the type it declared; a request without one (or with an empty one) is accepted, as
  curl and some SDKs send JSON without it.
- ``read_capped``: the whole body, or ``BodyTooLarge`` (a 413 answer) naming the cap as soon as the body
  is known to exceed it: from ``Content-Length`` before anything is read, else while reading (at most
  one chunk past the cap is held).
- A body decodes as RFC 8259 JSON or raises ``BodyError`` whose message names what is wrong: not JSON
  at all, a non-standard constant (``NaN``, ``Infinity``, ``-Infinity``, which Python's own parser
  accepts), an integer with more digits than CPython converts (``sys.get_int_max_str_digits()``, 4300
  by default; the message names the limit, not Python's advice; no per-number hook, which would
  triple the decoding time of a token-id prompt), or nesting too deep for the parser
  (``RecursionError`` caught; the caller's own depth limit on what did parse stays the caller's).
- Every number in a decoded value is finite: a valid JSON number that overflows a 64-bit float
  (``1e400``, which Python parses to ``inf``) raises ``BodyError`` naming the field it is in and the
  number, so a decoded body always re-serialises as JSON (never as the non-JSON ``Infinity``).
- The encoding is detected as ``json.loads`` does (UTF-8/16/32 with or without BOM).
- One decoder per process: ``json.loads(**kw)`` would build one per call.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

__all__ = ["BodyError", "BodyTooLarge", "UnsupportedMediaType", "check_content_type", "loads_strict", "read_capped"]


class BodyError(ValueError):
    """A request body that is not strict JSON; ``str()`` is a message fit for a 400 answer."""


class BodyTooLarge(BodyError):
    """A request body over the server's cap; ``str()`` is a message fit for a 413 answer."""


class UnsupportedMediaType(BodyError):
    """A request body declared as something other than JSON; ``str()`` is a message fit for a 415 answer."""


def check_content_type(value: str | None) -> None:
    """``UnsupportedMediaType`` unless ``value`` (a request's Content-Type, None when absent) declares JSON
    or nothing (module doc)."""
    if not value:
        return
    media = value.partition(";")[0].strip().lower()
    if media == "application/json" or (media.endswith("+json") and "/" in media) or not media:
        return
    raise UnsupportedMediaType(f"Content-Type {value[:100]!r} is not supported: send the body as application/json")


async def read_capped(request: Any, cap: int) -> bytes:
    """The whole body of a Starlette ``request``; ``BodyTooLarge`` over ``cap`` bytes, ``BodyError`` for a
    malformed Content-Length (module doc). ``ClientDisconnect`` propagates."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise BodyError("malformed Content-Length header") from None
        if n > cap:
            raise BodyTooLarge(f"request body of {n} bytes is over the limit of {cap} bytes")
    chunks = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > cap:
            raise BodyTooLarge(f"request body is over the limit of {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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
        if type(exc) is ValueError:  # the decoder's only plain one: an integer past CPython's conversion limit
            raise BodyError(f"request body: a number in the body has too many digits (limit "
                            f"{getattr(sys, 'get_int_max_str_digits', lambda: 0)()}; send it as a string)") from None
        raise BodyError(f"request body is not valid JSON: {exc}"[:200]) from None
