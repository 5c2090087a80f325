"""Plain-Python replay that drives the ONLINE policy objects: the specification of the kernels.

``replay(arrays, policy, capacity_blocks, **options)`` builds the policy by name (from the policy
registry ``quillcache.policies.POLICIES``) and applies the prefix-aware definition
(REFERENCE §5) through the ``EvictionPolicy`` protocol, one block (size 1) per key:

    k = number of leading blocks of the request that are tracked   -> hits[r] = k
    policy.begin_request(blocks, k, input_tokens)                  (only if the policy has it)
    for each block b of the request, in order:
        if b is tracked: policy.touch(b)
        elif policy.admit(b, 1):
            if len(policy) >= capacity: policy.evict(policy.victim())
            policy.insert(b, 1)

Harness-provided options (the caller may not override them) come from two tables, so adding a
policy is one entry, not a branch: ``HARNESS_OPTIONS`` (policy -> the options it gets) and
``HARNESS_VALUES`` (option -> how its value is made). ``s3fifo`` gets
``capacity_bytes=capacity``; ``tinylfu``, ``quillhd``, ``quillchain``, ``lhd``, ``arc``, ``2q``,
``lrb`` and ``belady`` get ``capacity_keys``;
``belady`` gets ``next_use_oracle``, which returns ``arrays.next_use[p]`` for the reference being
made now (position ``p``; the harness moves the cursor before each block; ``replay(..., next_use=keys)``
substitutes other keys); ``lookahead`` (semi-online) gets the same and ``window_end_oracle``, the
first position of request ``r + 1 + window_requests``, where ``window_requests`` is the caller's
option or else the default in ``LookaheadPolicy``'s signature (read from the class, never restated).

Slow (dicts and OrderedDicts); used by the tests to check that each Numba kernel
reproduces its online policy hit for hit, and as the plain-Python baseline of the study.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from quillcache._checks import check_int
from quillcache.hitrate.arrays import TraceArrays, validate_arrays
from quillcache.policies import POLICIES, make_policy


@dataclass(frozen=True)
class _Harness:
    """What the harness knows when it builds a policy: the values of its options are read from here."""

    policy: str
    capacity_blocks: int
    arrs: TraceArrays
    cursor: list[int]  # [position of the reference being made, index of its request]
    next_use: np.ndarray  # int64[N]: what ``next_use_oracle`` returns at each position
    options: dict

    def option(self, name: str):
        """The caller's value of the policy option ``name``, else the policy class's default (so the
        harness and the class cannot disagree on it)."""
        if name in self.options:
            return self.options[name]
        return inspect.signature(POLICIES[self.policy]).parameters[name].default


def _next_use_oracle(h: _Harness):
    nu, cursor = h.next_use, h.cursor
    return lambda _key: int(nu[cursor[0]])


def _window_end_oracle(h: _Harness):
    off, nreq, cursor, w = h.arrs.req_offsets, h.arrs.num_requests, h.cursor, h.option("window_requests")
    return lambda: int(off[min(cursor[1] + 1 + w, nreq)])


# harness option -> how the harness makes its value
HARNESS_VALUES: dict[str, Callable[[_Harness], object]] = {
    "capacity_bytes": lambda h: h.capacity_blocks,
    "capacity_keys": lambda h: h.capacity_blocks,
    "next_use_oracle": _next_use_oracle,
    "window_end_oracle": _window_end_oracle,
}

# policy -> the options the harness gives it (each one a key of HARNESS_VALUES)
HARNESS_OPTIONS: dict[str, tuple[str, ...]] = {
    "s3fifo": ("capacity_bytes",),
    "tinylfu": ("capacity_keys",),
    "quillhd": ("capacity_keys",),
    "quillchain": ("capacity_keys",),
    "lhd": ("capacity_keys",),
    "arc": ("capacity_keys",),
    "2q": ("capacity_keys",),
    "lrb": ("capacity_keys",),
    "belady": ("capacity_keys", "next_use_oracle"),
    "lookahead": ("next_use_oracle", "window_end_oracle"),
}


def build_policy(name: str, capacity_blocks: int, arrs: TraceArrays, cursor: list[int], *,
                 next_use: np.ndarray | None = None, **options):
    """The policy ``name`` built with the caller's ``options`` plus the harness's own
    (``HARNESS_OPTIONS[name]``, made by ``HARNESS_VALUES``; the caller may not set them). The
    next-use oracles return ``next_use[cursor[0]]`` (default ``arrs.next_use``)."""
    harness = HARNESS_OPTIONS.get(name, ())
    given = set(options) & set(harness)
    if given:
        raise ValueError(f"options {sorted(given)} are set by the replay harness for policy {name!r}")
    h = _Harness(name, capacity_blocks, arrs, cursor, arrs.next_use if next_use is None else next_use, options)
    made = {opt: HARNESS_VALUES[opt](h) for opt in harness}
    return make_policy(name, **options, **made)


def replay(arrs: TraceArrays, policy: str, capacity_blocks: int, *, next_use: np.ndarray | None = None,
           **options) -> np.ndarray:
    """Per-request prefix hits (int32[R]) of ``policy`` at ``capacity_blocks`` blocks; ``next_use``
    (int64[N], default ``arrs.next_use``) is what the next-use oracles return, so an offline bound
    can drive ``belady`` with keys of its own (``quillcache.hitrate.bounds.timing_oracle_reference``)."""
    validate_arrays(arrs)
    cap = check_int("capacity_blocks", capacity_blocks, 1)
    if next_use is not None and len(next_use) != arrs.num_refs:
        raise ValueError(f"next_use has {len(next_use)} keys for {arrs.num_refs} references")
    cursor = [0, 0]  # position of the reference being made, index of its request
    pol = build_policy(policy, cap, arrs, cursor, next_use=next_use, **options)
    begin = getattr(pol, "begin_request", None)
    off = arrs.req_offsets.tolist()
    blocks = arrs.blocks.tolist()
    isl = arrs.input_tokens.tolist()
    hits = np.zeros(arrs.num_requests, dtype=np.int32)
    for r in range(arrs.num_requests):
        s, e = off[r], off[r + 1]
        keys = blocks[s:e]
        k = 0
        for b in keys:
            if b in pol:
                k += 1
            else:
                break
        hits[r] = k
        cursor[1] = r
        if begin is not None:
            begin(keys, k, isl[r])
        for j, b in enumerate(keys):
            cursor[0] = s + j
            if b in pol:
                pol.touch(b)
            elif pol.admit(b, 1):
                if len(pol) >= cap:
                    v = pol.victim()
                    assert v is not None, f"{policy}: full cache ({len(pol)} keys) returned no victim"
                    pol.evict(v)
                pol.insert(b, 1)
            assert len(pol) <= cap
    return hits
