"""``sweep``: hit rate of several policies at several capacities, as one tidy DataFrame.

One row per (policy, capacity): ``policy``, ``capacity_blocks`` (nullable integer; NA means
unlimited), ``hit_rate``, ``hit_blocks``, ``total_blocks``, ``refs_per_s`` (kernel time only,
JIT excluded), and ``gap_closed``: the share of the LRU→Belady gap the policy closes at that
capacity, ``(hit - lru) / (belady - lru)``, computed when both ``lru`` and ``belady`` are in the
sweep and the gap is positive (NA otherwise). The trace is converted to arrays once.

``options`` gives kernel options per policy (e.g. ``{"quillchain": {"block_tokens": 16}}``);
``progress(policy, capacity)`` is called after each cell (for a progress bar).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from quillcache._checks import check_int
from quillcache.hitrate import as_arrays, simulate

_INT64_MAX = 2**63 - 1  # capacity_blocks is an Int64 column


def sweep(trace_or_arrays: object, policies: Sequence[str], capacities: Sequence[int | None], *,
          options: Mapping[str, Mapping[str, object]] | None = None,
          progress: Callable[[str, int | None], None] | None = None):
    """Run every policy at every capacity (None = unlimited, else an int in ``[1, 2**63 - 1]``, the
    range of the Int64 column; ValueError naming the first capacity outside it, before any replay)."""
    import pandas as pd

    if isinstance(policies, str) or not policies:
        raise ValueError(f"policies must be a non-empty list of policy names, got {policies!r}")
    if isinstance(capacities, (str, int)) or not capacities:
        raise ValueError(f"capacities must be a non-empty list of block counts (None = unlimited), got {capacities!r}")
    for cap in capacities:
        if cap is not None:
            check_int("capacity_blocks", cap, 1, _INT64_MAX)
    arrs = as_arrays(trace_or_arrays)
    options = options or {}
    records = []
    for policy in dict.fromkeys(policies):
        for cap in dict.fromkeys(capacities):
            r = simulate(arrs, policy, cap, **dict(options.get(policy, {})))
            records.append({"policy": policy, "capacity_blocks": cap, "hit_rate": r.hit_rate,
                            "hit_blocks": r.hit_blocks, "total_blocks": r.total_blocks, "refs_per_s": r.refs_per_s})
            if progress is not None:
                progress(policy, cap)
    df = pd.DataFrame.from_records(records)
    df["capacity_blocks"] = df["capacity_blocks"].astype("Int64")
    return with_gap_closed(df)


def with_gap_closed(df):
    """``df`` (rows of ``policy``, ``capacity_blocks``, ``hit_rate``) with its ``gap_closed`` column
    (re)computed from the ``lru`` and ``belady`` rows at each capacity (NA where either is missing
    or the gap is not positive). Rows of other subjects (e.g. an information bound) get it too."""
    import pandas as pd

    df = df.reset_index(drop=True)
    df["gap_closed"] = pd.Series(pd.NA, index=df.index, dtype="Float64")
    by = {(p, c): h for p, c, h in zip(df["policy"], df["capacity_blocks"].fillna(-1), df["hit_rate"])}
    for i, (p, c) in enumerate(zip(df["policy"], df["capacity_blocks"].fillna(-1))):
        lru, bel = by.get(("lru", c)), by.get(("belady", c))
        if lru is not None and bel is not None and bel - lru > 1e-12:
            df.loc[i, "gap_closed"] = (by[(p, c)] - lru) / (bel - lru)
    return df
