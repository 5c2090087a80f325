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

Harness-provided options (the caller may not override them): ``s3fifo`` gets
``capacity_bytes=capacity``; ``tinylfu``, ``quillhd``, ``quillchain``, ``lhd``, ``arc``, ``2q``,
``lrb`` and ``belady`` get ``capacity_keys``;
``belady`` gets ``next_use_oracle``, which returns ``arrays.next_use[p]`` for the reference being
made now (position ``p``; the harness moves the cursor before each block); ``lookahead`` (semi-online)
gets the same and ``window_end_oracle``, the first position of request ``r + 1 + window_requests``.

Slow (dicts and OrderedDicts); used by the tests to check that each Numba kernel
reproduces its online policy hit for hit, and as the plain-Python baseline of the study.
"""

from __future__ import annotations

import numpy as np

from quillcache._checks import check_int
from quillcache.hitrate.arrays import TraceArrays, validate_arrays
from quillcache.policies import make_policy

HARNESS_OPTIONS = {
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


def build_policy(name: str, capacity_blocks: int, arrs: TraceArrays, cursor: list[int], **options):
    given = set(options) & set(HARNESS_OPTIONS.get(name, ()))
    if given:
        raise ValueError(f"options {sorted(given)} are set by the replay harness for policy {name!r}")
    if name == "s3fifo":
        options["capacity_bytes"] = capacity_blocks
    elif name in ("tinylfu", "quillhd", "quillchain", "lhd", "arc", "2q", "lrb"):
        options["capacity_keys"] = capacity_blocks
    elif name == "belady":
        nu = arrs.next_use
        options["capacity_keys"] = capacity_blocks
        options["next_use_oracle"] = lambda _key: int(nu[cursor[0]])
    elif name == "lookahead":
        nu, off, nreq = arrs.next_use, arrs.req_offsets, arrs.num_requests
        w = options.get("window_requests", 8)
        options["next_use_oracle"] = lambda _key: int(nu[cursor[0]])
        options["window_end_oracle"] = lambda: int(off[min(cursor[1] + 1 + w, nreq)])
    return make_policy(name, **options)


def replay(arrs: TraceArrays, policy: str, capacity_blocks: int, **options) -> np.ndarray:
    """Per-request prefix hits (int32[R]) of ``policy`` at ``capacity_blocks`` blocks."""
    validate_arrays(arrs)
    cap = check_int("capacity_blocks", capacity_blocks, 1)
    cursor = [0, 0]  # position of the reference being made, index of its request
    pol = build_policy(policy, cap, arrs, cursor, **options)
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
