"""The ``quillcache hitrate`` command's value specs: capacities (block counts, ``inf``, or shares of a trace's
distinct blocks that resolve once the trace is loaded) and the joint oracle's flip rates. Pure parsing: every
function raises ``ValueError`` naming the flag and the item that is wrong, and reads no trace."""

from __future__ import annotations

import re
from dataclasses import dataclass

from quillcache.cli.argtypes import MAX_COUNT

__all__ = ["MAX_CAPACITY_BLOCKS", "Share", "joint_label", "parse_capacities", "parse_flip_rates",
           "resolve_capacities"]

MAX_CAPACITY_BLOCKS = MAX_COUNT  # far above any trace's distinct blocks, and safe in every int64 column

_CAP_RE = re.compile(r"^(\d+)([kKmM]?)$")
_SHARE_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)%$")


@dataclass(frozen=True)
class Share:
    """A capacity given as a share of the trace's distinct blocks (``fraction`` in (0, 1])."""

    fraction: float
    text: str  # as the user wrote it, e.g. "1%"

    def blocks(self, num_unique: int) -> int:
        """The study's rule (``experiments.hitrate_study.generalisation``): at least one block."""
        return max(1, int(num_unique * self.fraction))


def parse_flip_rates(text: str) -> list[float]:
    """``"5%,0.1"`` -> ``[0.05, 0.1]``: shares in [0, 1) as a percentage or a fraction, rounded to 12
    decimals (so ``0.7%`` and ``0.007`` are one share, with one ``joint_label``); ``"none"`` -> ``[]``;
    ValueError naming the bad item."""
    if text.strip().lower() == "none":
        return []
    out: list[float] = []
    for item in text.split(","):
        s = item.strip()
        try:
            rate = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
        except ValueError:
            raise ValueError(f"--bound-flip-rates: {item!r} is not a share of requests (e.g. 10% or 0.1)") from None
        if not 0.0 <= rate < 1.0:  # (NaN fails too)
            raise ValueError(f"--bound-flip-rates: {item!r} must be a share in [0%, 100%)")
        out.append(round(rate, 12))
    return list(dict.fromkeys(out))


def joint_label(rate: float) -> str:
    """The policy name of the joint oracle's rows at flip rate ``rate``: ``joint_oracle@10%``."""
    return f"joint_oracle@{round(rate * 100, 10):.10g}%"


def parse_capacities(text: str) -> list[int | Share | None]:
    """``"1k,10000,5%,inf"`` -> ``[1000, 10000, Share(0.05, "5%"), None]``; ValueError naming the bad item
    (a count must lie in ``[1, MAX_CAPACITY_BLOCKS]``)."""
    out: list[int | Share | None] = []
    for item in text.split(","):
        s = item.strip()
        if s.lower() in ("inf", "unlimited"):
            out.append(None)
            continue
        if s.endswith("%"):
            m = _SHARE_RE.match(s)
            if not m:
                raise ValueError(f"--capacities: {item!r} is not a share of the distinct blocks (e.g. 1%, 0.5%)")
            pct = float(m.group(1))
            if not 0.0 < pct <= 100.0:
                raise ValueError(f"--capacities: {item!r} must be a share in (0%, 100%]")
            out.append(Share(pct / 100.0, s))
            continue
        m = _CAP_RE.match(s)
        if not m:
            raise ValueError(f"--capacities: {item!r} is not a block count (e.g. 1000, 10k, 2M), a share (1%) or inf")
        n = int(m.group(1)) * {"": 1, "k": 1000, "m": 1_000_000}[m.group(2).lower()]
        if n < 1:
            raise ValueError(f"--capacities: {item!r} must be >= 1 block")
        if n > MAX_CAPACITY_BLOCKS:
            raise ValueError(f"--capacities: {item!r} is too large (at most {MAX_CAPACITY_BLOCKS:,} blocks; "
                             f"use inf for unlimited)")
        out.append(n)
    return list(dict.fromkeys(out))


def resolve_capacities(specs: list[int | Share | None], num_unique: int) -> tuple[list[int | None], dict[int, Share]]:
    """Block counts (None = unlimited) in the order given, duplicates dropped, and the share each
    count came from, if any (``{1832: Share(0.01, "1%")}``; the first share wins when two resolve alike)."""
    caps: list[int | None] = []
    shares: dict[int, Share] = {}
    for s in specs:
        cap = s.blocks(num_unique) if isinstance(s, Share) else s
        if isinstance(s, Share):
            shares.setdefault(cap, s)
        caps.append(cap)
    return list(dict.fromkeys(caps)), shares
