"""argparse ``type=`` converters shared by the commands: each returns the value or raises
``argparse.ArgumentTypeError`` with a one-line message naming the text (``OneLineParser`` prints it)."""

from __future__ import annotations

import argparse
import math
import re

__all__ = ["non_negative_float", "parse_size", "port", "positive_float", "positive_int", "size_arg"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1 << 20,
          "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1000 ** 4, "tb": 1000 ** 4, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MIN_SIZE_BYTES = 4096


def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    value = _number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def port(text: str) -> int:
    value = _number(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not in [0, 65535]")
    return value


def parse_size(text: str) -> int:
    """``"256MiB"`` -> 268435456; ``ValueError`` naming the text otherwise."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with B/KiB/MiB/GiB/TiB/KB/MB/GB/TB)")
    return int(float(m.group(1)) * _UNITS[unit])


def size_arg(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < MIN_SIZE_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is below the minimum of {MIN_SIZE_BYTES} bytes")
    return value
