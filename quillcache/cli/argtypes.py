"""argparse ``type=`` converters shared by the commands: each returns the value or raises
``argparse.ArgumentTypeError`` with a one-line message naming the text (``OneLineParser`` prints it); and
``directory_problem``, the check a command runs on a directory flag before any work (it may create the folder,
so it is not a converter: parsing, ``--help`` included, has no side effect); and ``memory_problem``, the check
of a flag that makes a command hold memory against what this machine (and its cgroup) has available."""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

__all__ = ["MAX_COUNT", "MEMORY_SHARE", "SIZE_MULTIPLE_BYTES", "address", "available_memory_bytes",
           "directory_problem", "int_in_range", "memory_problem", "non_negative_float", "parse_size", "port",
           "positive_float", "positive_float_up_to", "positive_int", "size_arg"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1 << 20,
          "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1000 ** 4, "tb": 1000 ** 4, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
MIN_SIZE_BYTES = 4096
SIZE_MULTIPLE_BYTES = 4096  # a size flag (size_arg) is whole pages: never rounded behind the user's back
ADDRESS_SCHEMES = ("tcp://", "qtcp://")  # an RPC address: tcp://HOST:PORT, HOST:PORT, or a stream's qtcp://
# a host name, an IPv4 address, or an IPv6 address in brackets
_HOST = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)$")
MAX_COUNT = 2**62  # the most a count or size flag takes: far above any real one, safe in every int64 column
# the share of the available memory a command may take (a quarter is left to everything else), as
# replay --real-bytes does (quillcache.harness.replay._check_ram)
MEMORY_SHARE = 0.75
_CGROUP_ROOT = Path("/sys/fs/cgroup")


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


def _size_value(text: str) -> int | float:
    """The bytes ``text`` says, exactly as typed (an int unless it has a fraction); ``ValueError`` naming it."""
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with B/KiB/MiB/GiB/TiB/KB/MB/GB/TB)")
    number = m.group(1)
    if "." not in number:
        return int(number) * _UNITS[unit]
    value = float(number) * _UNITS[unit]
    if not math.isfinite(value):  # (int(inf) would raise OverflowError, which argparse does not catch)
        raise ValueError(f"{text!r} is not a size (too large)")
    return value


def parse_size(text: str) -> int:
    """``"256MiB"`` -> 268435456 (a fraction of a byte rounded down); ``ValueError`` naming the text otherwise."""
    return int(_size_value(text))


def size_arg(text: str) -> int:
    """A size flag: ``parse_size``'s forms, in [``MIN_SIZE_BYTES``, ``MAX_COUNT``] bytes and a whole multiple of
    ``SIZE_MULTIPLE_BYTES``: anything else is refused, never rounded (``--dram 4097`` was silently 4096)."""
    try:
        exact = _size_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    value = int(exact)
    if value < MIN_SIZE_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is below the minimum of {MIN_SIZE_BYTES} bytes")
    if value > MAX_COUNT:
        shown = text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
        raise argparse.ArgumentTypeError(f"{shown!r} is above the maximum of {MAX_COUNT} bytes")
    if exact != value or value % SIZE_MULTIPLE_BYTES:
        down = value // SIZE_MULTIPLE_BYTES * SIZE_MULTIPLE_BYTES
        said = value if exact == value else format(exact, ".15g")
        raise argparse.ArgumentTypeError(
            f"{text!r} is {said} bytes, not a multiple of {SIZE_MULTIPLE_BYTES}: give e.g. {down} or "
            f"{down + SIZE_MULTIPLE_BYTES} (a whole number of MiB, GiB or TiB always is one)")
    return value


def directory_problem(flag: str, path: str, writes: str | None = None) -> str | None:
    """Why ``path`` (typed as ``flag``) cannot be the directory a command writes in, a sentence naming both;
    None when it can: an existing directory, or a missing one, which is then created (with its parents).
    A file (or a special file, or a dangling symlink) in the way is refused, never replaced. With ``writes``
    (what the command writes there, for the message), an existing directory must also be writable."""
    if not path.strip():
        return f"{flag} {path!r} is empty: it must name a directory"
    if os.path.isdir(path):
        if writes is not None and not os.access(path, os.W_OK | os.X_OK):
            return f"{flag} {path} is not writable ({writes})"
        return None
    if os.path.lexists(path):
        kind = ("a file" if os.path.isfile(path) else "a symlink to nothing" if not os.path.exists(path)
                else "a special file")
        return f"{flag} {path} is {kind}, not a directory"
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if os.path.lexists(above) and not os.path.isdir(above):
        return f"{flag} {path} cannot be created: {above} is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"{flag} {path} cannot be created ({e.strerror or e})"
    return None


def _reclaimable_bytes(folder: Path, key: str) -> int:
    """The cgroup's inactive file cache (``memory.stat``'s ``key``): counted in its usage, but the kernel drops it
    before it refuses memory (the figure ``docker stats`` subtracts); 0 when it cannot be read."""
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room() -> int | None:
    """What this process's memory cgroup (v2 ``memory.max`` less ``memory.current``, or v1
    ``memory.limit_in_bytes`` less ``memory.usage_in_bytes``; the usage without its inactive file cache, which
    the kernel reclaims first), or any cgroup above it, still lets it take; None when no limit applies (or none
    can be read)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    folders = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: one hierarchy
            base, files = _CGROUP_ROOT, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = _CGROUP_ROOT / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                    "total_inactive_file")
        else:
            continue
        folder = base / path.strip("/")
        while True:  # this cgroup and every one above it (a container sees its own as the root)
            folders.append((folder, files))
            if folder == base:
                break
            folder = folder.parent
    rooms = []
    for folder, (limit_file, usage_file, cache_key) in folders:
        try:
            limit_text = (folder / limit_file).read_text().strip()
            if limit_text == "max":
                continue
            limit, usage = int(limit_text), int((folder / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit < 2**60:  # v1 says "no limit" with a huge number
            rooms.append(max(0, limit - max(0, usage - _reclaimable_bytes(folder, cache_key))))
    return min(rooms) if rooms else None


def available_memory_bytes() -> int:
    """The memory this process can still take: ``MemAvailable`` (the figure ``replay --real-bytes`` checks,
    ``quillcache.harness.replay.available_ram_bytes``), lowered to what a cgroup memory limit leaves when
    one applies; 0 when neither is known."""
    from quillcache.harness.replay import available_ram_bytes

    have = available_ram_bytes()
    room = _cgroup_room()
    return room if room is not None and (not have or room < have) else have


def memory_problem(what: str, need_bytes: int, lower: str) -> str | None:
    """Why a command cannot hold ``need_bytes`` (``what``: the flags that ask for them, e.g. "--dram x --nodes
    4"), or None: more than ``MEMORY_SHARE`` of ``available_memory_bytes()`` is refused, before anything is
    allocated; ``lower`` says which flag to lower."""
    have = available_memory_bytes()
    if not have or need_bytes <= MEMORY_SHARE * have:
        return None
    gib = 1 << 30
    return (f"{what} needs {need_bytes / gib:,.1f} GiB of memory but this machine has {have / gib:,.1f} GiB "
            f"available (a command takes at most {MEMORY_SHARE:.0%} of it); lower {lower}")
