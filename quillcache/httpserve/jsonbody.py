"""Strict JSON for request bodies, shared by the project's HTTP servers (the gateway, the STAND-IN engine).

Invariants:
- A body decodes as RFC 8259 JSON or raises ``BodyError`` whose message names what is wrong: not JSON
  at all, a non-standard constant (``NaN``, ``Infinity``, ``-Infinity``, which Python's own parser
  accepts), or nesting too deep for the parser (``RecursionError`` caught; the caller's own depth
  limit on what did parse stays the caller's).
- The encoding is detected as ``json.loads`` does (UTF-8/16/32 with or without BOM).
- One decoder per process: ``json.loads(**kw)`` would build one per call.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["BodyError", "loads_strict"]


class BodyError(ValueError):
    """A request body that is not strict JSON; ``str()`` is a message fit for a 400 answer."""


class _Constant(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _Constant(name)


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)


def loads_strict(raw: bytes, max_depth: int | None = None) -> Any:
    """``raw``'s JSON value; ``BodyError`` otherwise. ``max_depth`` is only named in the message for a body
    too deeply nested to parse at all."""
    try:
        return _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except _Constant as exc:
        raise BodyError(f"request body is not valid JSON: {exc} is not a JSON value (send a number, or null)") \
            from None
    except RecursionError:
        limit = "" if max_depth is None else f" (more than {max_depth} levels)"
        raise BodyError(f"request body is nested too deeply{limit}") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise BodyError(f"request body is not valid JSON: {exc}"[:200]) from None
