"""Count-min sketch of block-hash frequencies: conservative update, TinyLFU aging, merge, top-k.

``CountMinSketch`` is the public face of the Cython core ``quillcache.sketch._sketch``; the
algorithm (hashing included) is specified by ``quillcache.sketch.reference``, which the tests
hold the core to, counter for counter.

Geometry: ``width = ceil(e/eps)``, ``depth = ceil(ln(1/delta))`` (eps=0.001, delta=0.01 gives
2719 x 5 = 54 KiB of uint32 counters, which stays in L2).

Invariants:
- Without aging, ``estimate(x) >= true count of x`` always (both update modes, after ``merge``),
  and ``estimate(x) <= true + eps * total`` with probability ``>= 1 - delta`` per key.
  Conservative update never estimates above the standard update on the same stream.
- Counters are uint32 and saturate at ``2**32 - 1`` (never wrap); ``total`` saturates at 2**64 - 1.
- With ``aging_window = W``, after every W counted additions (weighted by count) all counters,
  ``total`` and the stored heavy-hitter estimates are halved; ``halve()`` does it on demand.
- ``heavy_hitters()`` returns at most ``top_k`` ``(key, estimate)`` pairs, estimate descending
  (ties: smaller key first), from candidates re-ranked on every addition.
- Inputs are validated before the core sees them: keys are 1-D C-contiguous ``uint64`` arrays or
  Python/NumPy integers in [0, 2**64); anything else raises TypeError/ValueError naming the value.
- Every row's counters sum to at most ``total``: an addition of ``count`` raises each row by at most
  ``count`` (conservative update raises less, saturation stops it), halving halves both sides rounding
  down, and ``merge`` adds both sides. (Equality is not an invariant: conservative update, saturation
  and halving each make a row fall short.)
- Not thread-safe: a mutating call made while another thread is inside one raises RuntimeError
  (the core releases the GIL during batch loops but never races on its own state).

Snapshots (``to_bytes`` / ``from_bytes``, also what pickle uses), all little-endian: a header
(``_HEADER``: magic ``b"QCCMS\\x00v2"`` carrying the format version, then eps, delta, width, depth, seed,
conservative, top_k, aging_window (0 = off), aging clock, total, heavy-hitter count), the counters
(uint32, depth x width), the heavy-hitter heap's keys (uint64) and stored estimates (uint32), then a
crc32c (uint32) of every byte before it. ``from_bytes`` refuses with a ValueError naming what failed:
a bad magic, a header the config checks refuse, a length other than the header implies, a crc32c
mismatch (any damaged byte), an aging clock or heap that the sketch could not hold, or a row whose
counters sum to more than ``total``. A version-1 snapshot (magic ``b"QCCMS\\x00v1"``: the same layout
without the crc32c, written before it existed) still loads, checked for everything but the crc32c.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import crc32c
import numpy as np

from quillcache._checks import check_float, check_int, is_int
from quillcache.sketch._sketch import SketchCore
from quillcache.sketch.reference import (
    COUNTER_MAX,
    MASK64,
    MAX_COUNTERS,
    MAX_DEPTH,
    MAX_TOP_K,
    MAX_WIDTH,
    dimensions_for,
)

__all__ = ["CountMinSketch", "SketchConfig"]

_MAGIC = b"QCCMS\x00v2"  # version 2: a crc32c follows the body
_MAGIC_V1 = b"QCCMS\x00v1"  # version 1: the same header and body, no crc32c (still read)
# magic, eps, delta, width, depth, seed, conservative, top_k, aging_window(0=off), since_aging, total, n_heavy
_HEADER = struct.Struct("<8sddIIQ?3xIQQQI")
_CRC = struct.Struct("<I")


@dataclass(frozen=True, kw_only=True)
class SketchConfig:
    """Accuracy targets and options of a sketch; ``width``/``depth`` are derived from eps/delta."""

    eps: float
    delta: float
    conservative: bool = True
    seed: int = 0
    aging_window: int | None = None
    top_k: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_float("eps", self.eps, 0.0, 1.0, lo_open=True, hi_open=True))
        object.__setattr__(self, "delta", check_float("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True))
        if not isinstance(self.conservative, (bool, np.bool_)):
            raise TypeError(f"conservative must be bool, got {type(self.conservative).__name__}")
        object.__setattr__(self, "conservative", bool(self.conservative))
        object.__setattr__(self, "seed", check_int("seed", self.seed, 0, MASK64))
        if self.aging_window is not None:
            object.__setattr__(self, "aging_window", check_int("aging_window", self.aging_window, 1, MASK64))
        object.__setattr__(self, "top_k", check_int("top_k", self.top_k, 0, MAX_TOP_K))
        # a coarse bound before computing the geometry (e/eps or ln(1/delta) of a subnormal is infinite,
        # and ceil(inf) raises OverflowError); the exact bounds follow
        if not math.e / self.eps <= 2 * MAX_WIDTH:
            raise ValueError(f"eps={self.eps!r} gives width ceil(e/eps) = {math.e / self.eps:.3g} > {MAX_WIDTH} "
                             f"counters per row")
        if not -math.log(self.delta) <= MAX_DEPTH + 1:
            raise ValueError(f"delta={self.delta!r} gives depth ceil(ln(1/delta)) = {-math.log(self.delta):.3g} > "
                             f"{MAX_DEPTH} rows")
        width, depth = dimensions_for(self.eps, self.delta)
        if width > MAX_WIDTH:
            raise ValueError(f"eps={self.eps!r} gives width {width} > {MAX_WIDTH} counters per row")
        if depth > MAX_DEPTH:
            raise ValueError(f"delta={self.delta!r} gives depth {depth} > {MAX_DEPTH} rows")
        if width * depth > MAX_COUNTERS:
            raise ValueError(
                f"eps={self.eps!r}, delta={self.delta!r} give {width}x{depth} = {width * depth} counters "
                f"> {MAX_COUNTERS} ({MAX_COUNTERS * 4 // 2**20} MiB)"
            )

    @property
    def width(self) -> int:
        return dimensions_for(self.eps, self.delta)[0]

    @property
    def depth(self) -> int:
        return dimensions_for(self.eps, self.delta)[1]


def _as_keys(keys: object) -> np.ndarray:
    """A 1-D C-contiguous native uint64 array, or a one-element array for a single integer key."""
    if is_int(keys):
        k = int(keys)
        if not 0 <= k <= MASK64:
            raise ValueError(f"key {k} is outside the uint64 range [0, 2**64)")
        return np.array([k], dtype=np.uint64)
    if not isinstance(keys, np.ndarray):
        raise TypeError(f"keys must be a numpy uint64 array or an int, got {type(keys).__name__}")
    if keys.dtype != np.dtype(np.uint64):
        raise TypeError(f"keys must have dtype uint64 (native byte order), got dtype {keys.dtype.str} ({keys.dtype})")
    if keys.ndim != 1:
        raise ValueError(f"keys must be 1-D, got shape {keys.shape}")
    if not keys.flags.c_contiguous:
        raise ValueError(f"keys must be C-contiguous, got strides {keys.strides}; pass np.ascontiguousarray(keys)")
    return keys


def _as_counts(counts: object, n: int) -> np.ndarray | None:
    """None (every key counts once) or a 1-D C-contiguous uint32 array of length ``n``."""
    if counts is None:
        return None
    if is_int(counts):
        c = check_int("count", counts, 0, COUNTER_MAX)
        return None if c == 1 else np.full(n, c, dtype=np.uint32)
    if not isinstance(counts, np.ndarray):
        raise TypeError(f"counts must be None, an int or an integer numpy array, got {type(counts).__name__}")
    if counts.dtype.kind not in "iu":
        raise TypeError(f"counts must have an integer dtype, got dtype {counts.dtype}")
    if counts.ndim != 1:
        raise ValueError(f"counts must be 1-D, got shape {counts.shape}")
    if counts.shape[0] != n:
        raise ValueError(f"{n} keys but {counts.shape[0]} counts")
    if not counts.flags.c_contiguous:
        raise ValueError(f"counts must be C-contiguous, got strides {counts.strides}")
    if n:
        lo, hi = counts.min(), counts.max()
        if lo < 0:
            i = int(np.argmin(counts))
            raise ValueError(f"counts[{i}]={int(counts[i])} is negative")
        if hi > COUNTER_MAX:
            i = int(np.argmax(counts))
            raise ValueError(f"counts[{i}]={int(counts[i])} exceeds {COUNTER_MAX}")
    return counts.astype(np.uint32, copy=False)


def _as_key(key: object) -> int:
    if not is_int(key):
        raise TypeError(f"key must be an int in [0, 2**64), got {type(key).__name__} {key!r}")
    k = int(key)
    if not 0 <= k <= MASK64:
        raise ValueError(f"key {k} is outside the uint64 range [0, 2**64)")
    return k


class CountMinSketch:
    """Count-min sketch over uint64 block hashes (see the module docstring for invariants)."""

    __slots__ = ("_config", "_core")

    def __init__(
        self,
        eps: float,
        delta: float,
        *,
        conservative: bool = True,
        seed: int = 0,
        aging_window: int | None = None,
        top_k: int = 0,
    ) -> None:
        self._config = SketchConfig(
            eps=eps, delta=delta, conservative=conservative, seed=seed, aging_window=aging_window, top_k=top_k
        )
        cfg = self._config
        self._core = SketchCore(cfg.width, cfg.depth, cfg.conservative, cfg.seed, cfg.aging_window or 0, cfg.top_k)

    @classmethod
    def from_config(cls, config: SketchConfig) -> "CountMinSketch":
        if not isinstance(config, SketchConfig):
            raise TypeError(f"config must be SketchConfig, got {type(config).__name__}")
        return cls(
            config.eps,
            config.delta,
            conservative=config.conservative,
            seed=config.seed,
            aging_window=config.aging_window,
            top_k=config.top_k,
        )

    # ---- properties ----------------------------------------------------------------------
    @property
    def config(self) -> SketchConfig:
        return self._config

    @property
    def width(self) -> int:
        return self._core.width

    @property
    def depth(self) -> int:
        return self._core.depth

    @property
    def total(self) -> int:
        """N: the counted stream length (sum of counts), halved by aging."""
        return self._core.total

    @property
    def additions_since_aging(self) -> int:
        """The aging clock: counted additions since the last automatic halving."""
        return self._core.since_aging

    @property
    def nbytes(self) -> int:
        """Bytes held by counters and heavy-hitter structures."""
        return self._core.nbytes

    def __repr__(self) -> str:
        c = self._config
        return (
            f"CountMinSketch(eps={c.eps}, delta={c.delta}, width={self.width}, depth={self.depth}, "
            f"conservative={c.conservative}, aging_window={c.aging_window}, top_k={c.top_k}, total={self.total})"
        )

    # ---- updates -------------------------------------------------------------------------
    def add(self, keys: np.ndarray | int, counts: np.ndarray | int | None = None) -> None:
        """Count each key once, or ``counts[i]`` times (a scalar count applies to every key)."""
        arr = _as_keys(keys)
        self._core.add(arr, _as_counts(counts, arr.shape[0]))

    def add_one(self, key: int, count: int = 1) -> None:
        self._core.add_one(_as_key(key), check_int("count", count, 0, COUNTER_MAX))

    def halve(self) -> None:
        """Halve every counter, ``total`` and the stored heavy-hitter estimates (aging clock untouched)."""
        self._core.halve()

    def clear(self) -> None:
        self._core.clear()

    def merge(self, other: "CountMinSketch") -> None:
        """Add ``other``'s counters into this sketch (saturating) and re-rank heavy-hitter candidates."""
        if not isinstance(other, CountMinSketch):
            raise TypeError(f"can only merge a CountMinSketch, got {type(other).__name__}")
        for name in ("width", "depth", "seed", "conservative"):
            mine = getattr(self._config, name)
            theirs = getattr(other._config, name)
            if mine != theirs:
                raise ValueError(f"cannot merge sketches with different {name}: {mine!r} != {theirs!r}")
        self._core.merge(other._core)

    # ---- queries -------------------------------------------------------------------------
    def estimate(self, keys: np.ndarray | int) -> np.ndarray:
        """uint32 estimates for ``keys`` (never below the true counts without aging)."""
        return self._core.estimate(_as_keys(keys))

    def estimate_one(self, key: int) -> int:
        return self._core.estimate_one(_as_key(key))

    def heavy_hitters(self) -> list[tuple[int, int]]:
        """Up to ``top_k`` ``(key, estimate)`` pairs, estimate descending, ties by key."""
        keys = self._core.heavy_keys()
        est = self._core.estimate(keys)
        out = list(zip((int(k) for k in keys), (int(e) for e in est)))
        out.sort(key=lambda kv: (-kv[1], kv[0]))
        return out

    def counters(self) -> np.ndarray:
        """A copy of the counters, shape (depth, width), uint32."""
        return self._core.table.copy()

    # ---- serialization -------------------------------------------------------------------
    def __reduce__(self):
        return (CountMinSketch.from_bytes, (self.to_bytes(),))

    def to_bytes(self) -> bytes:
        """Little-endian snapshot: header, counters, heavy-hitter heap, crc32c (restored exactly; the
        module docstring gives the format)."""
        c = self._config
        hk = self._core.heavy_keys()
        he = self._core.heavy_stored()
        header = _HEADER.pack(
            _MAGIC,
            c.eps,
            c.delta,
            self.width,
            self.depth,
            c.seed,
            c.conservative,
            c.top_k,
            c.aging_window or 0,
            self._core.since_aging,
            self._core.total,
            hk.shape[0],
        )
        table = self._core.table.astype("<u4").tobytes()
        parts = [header, table, hk.astype("<u8").tobytes(), he.astype("<u4").tobytes()]
        crc = 0
        for part in parts:
            crc = crc32c.crc32c(part, crc)
        parts.append(_CRC.pack(crc))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> "CountMinSketch":
        """Rebuild a sketch from ``to_bytes`` (a version-1 snapshot too, which has no crc32c); malformed or
        damaged input raises ValueError naming what failed, never crashes."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes-like, got {type(data).__name__}")
        buf = bytes(data)
        if len(buf) < _HEADER.size:
            raise ValueError(f"sketch snapshot is {len(buf)} bytes; the header alone is {_HEADER.size}")
        magic, eps, delta, width, depth, seed, cons, top_k, aging, since, total, n_heavy = _HEADER.unpack_from(buf)
        if magic not in (_MAGIC, _MAGIC_V1):
            raise ValueError(f"not a sketch snapshot: magic {magic!r} is neither {_MAGIC!r} nor {_MAGIC_V1!r}")
        crc_bytes = _CRC.size if magic == _MAGIC else 0
        cfg = SketchConfig(
            eps=eps, delta=delta, conservative=cons, seed=seed, aging_window=aging or None, top_k=top_k
        )  # validates before anything is allocated
        if (cfg.width, cfg.depth) != (width, depth):
            raise ValueError(f"snapshot says {width}x{depth} but eps={eps}, delta={delta} give {cfg.width}x{cfg.depth}")
        n_counters = width * depth
        expected = _HEADER.size + 4 * n_counters + 12 * n_heavy + crc_bytes
        if len(buf) != expected:
            raise ValueError(f"sketch snapshot is {len(buf)} bytes; expected {expected}")
        if crc_bytes:
            body_end = len(buf) - crc_bytes
            stored, actual = _CRC.unpack_from(buf, body_end)[0], crc32c.crc32c(memoryview(buf)[:body_end])
            if stored != actual:
                raise ValueError(f"sketch snapshot crc32c: stored {stored:#010x} != computed {actual:#010x} over "
                                 f"{body_end} bytes of header and body: the snapshot is corrupted")
        if n_heavy > top_k:
            raise ValueError(f"snapshot holds {n_heavy} heavy hitters but top_k={top_k}")
        if (aging and since >= aging) or (not aging and since):
            raise ValueError(f"snapshot aging clock {since} is inconsistent with aging_window={aging or None}")
        sk = cls.from_config(cfg)
        off = _HEADER.size
        counters = np.frombuffer(buf, dtype="<u4", count=n_counters, offset=off).astype(np.uint32)
        off += 4 * n_counters
        row_sums = counters.reshape(depth, width).sum(axis=1, dtype=np.uint64)  # < 2**63: width <= 2**31
        if int(row_sums.max()) > total:
            row = int(np.argmax(row_sums))
            raise ValueError(f"snapshot counters of row {row} sum to {int(row_sums[row])} > total={total} (a row "
                             f"never sums to more than the counted stream)")
        hk = np.frombuffer(buf, dtype="<u8", count=n_heavy, offset=off).astype(np.uint64)
        off += 8 * n_heavy
        he = np.frombuffer(buf, dtype="<u4", count=n_heavy, offset=off).astype(np.uint32)
        sk._core.load_state(counters, total, since, hk, he)
        return sk
