"""argparse ``type=`` converters shared by the commands: each returns the value or raises
``argparse.ArgumentTypeError`` with a one-line message naming the text (``OneLineParser`` prints it)."""

from __future__ import annotations

import argparse
import math
import re

__all__ = ["MAX_COUNT", "address", "int_in_range", "non_negative_float", "parse_size", "port", "positive_float",
           "positive_float_up_to", "positive_int", "size_arg"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1 << 20,
          "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1000 ** 4, "tb": 1000 ** 4, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MIN_SIZE_BYTES = 4096
ADDRESS_SCHEMES = ("tcp://", "qtcp://")  # an RPC address: tcp://HOST:PORT, HOST:PORT, or a stream's qtcp://
# a host name, an IPv4 address, or an IPv6 address in brackets
_HOST = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)$")
MAX_COUNT = 2**62  # the most a count or size flag takes: far above any real one, safe in every int64 column


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


def int_in_range(low: int, high: int):
    """A converter for an integer in ``[low, high]`` (its message names the range)."""

    def convert(text: str) -> int:
        value = _number(text, int, "an integer")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not in [{low}, {high}]")
        return value

    convert.__name__ = f"integer in [{low}, {high}]"  # argparse names a converter by it in some messages
    return convert


def positive_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def positive_float_up_to(high: float):
    """A converter for a number in ``(0, high]`` (its message names the range)."""

    def convert(text: str) -> float:
        value = _number(text, float, "a number")
        if not 0 < value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not in (0, {high:g}]")
        return value

    convert.__name__ = f"number in (0, {high:g}]"
    return convert


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


def address(text: str) -> str:
    """An RPC address as typed (``tcp://HOST:PORT``, ``HOST:PORT`` or ``qtcp://HOST:PORT``, a port in
    [1, 65535]), checked for its form only: whether anything answers there is the command's business."""
    scheme = next((s for s in ADDRESS_SCHEMES if text.startswith(s)), "")
    host, sep, port_text = text[len(scheme):].rpartition(":")
    if not sep or not _HOST.match(host) or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address: tcp://HOST:PORT (or HOST:PORT) with a "
                                         f"port in [1, 65535]")
    return text


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
