"""Regressions from the review of the hit-rate replay: bounds at capacities above the distinct blocks,
the lookahead window past the trace's end, option values outside the kernels' int64, what
``validate_arrays`` checks, and arrays the caller still owns (or that can change under a validated
instance)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from quillcache.hitrate import kernels, simulate
from quillcache.hitrate.arrays import TraceArrays, arrays_from_lists, compute_next_use, validate_arrays
from quillcache.hitrate.bounds import (joint_oracle, joint_oracle_reference, reuse_oracle, reuse_oracle_reference,
                                       timing_oracle, timing_oracle_reference)
from quillcache.hitrate.predicted_reuse import predicted_reuse_lru, predicted_reuse_lru_reference
from quillcache.hitrate.reference import replay
from quillcache.policies import make_policy

FIELDS = ("req_offsets", "blocks", "timestamps_ms", "input_tokens", "output_tokens", "next_use", "conv_ids",
          "num_unique")


def _lists() -> list[list[int]]:
    return [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3, 7], [5, 6, 8], [1, 9], [1, 2, 4], [5, 6, 8]]


def _with(a: TraceArrays, **changes) -> TraceArrays:
    fields = {f: getattr(a, f) for f in FIELDS}
    fields.update(changes)
    return TraceArrays(**fields)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# ---------------------------------------------------------------- 1. bounds above the distinct blocks


HUGE_CAPACITIES = (10**11, 2**62)  # accepted by the CLI (at most 2**62); heaps of 2 * cap + 16 slots cannot exist


def test_bounds_run_a_capacity_above_the_distinct_blocks_as_that_many():
    arrs = arrays_from_lists(_lists())
    u = arrs.num_unique
    bits = np.arange(arrs.num_requests) % 2 == 0
    runs = {
        "reuse_oracle": lambda cap: reuse_oracle(arrs, cap, 0.2, 1),
        "reuse_oracle_reference": lambda cap: reuse_oracle_reference(arrs, cap, 0.2, 1),
        "timing_oracle": lambda cap: timing_oracle(arrs, cap, 0.5, 1),
        "timing_oracle_reference": lambda cap: timing_oracle_reference(arrs, cap, 0.5, 1),
        "joint_oracle": lambda cap: joint_oracle(arrs, cap, 0.5, 0.25, 1),
        "joint_oracle_reference": lambda cap: joint_oracle_reference(arrs, cap, 0.5, 0.25, 1),
        "predicted_reuse_lru": lambda cap: predicted_reuse_lru(arrs, cap, bits),
        "predicted_reuse_lru_reference": lambda cap: np.asarray(predicted_reuse_lru_reference(arrs, cap, bits)),
    }
    for name, run in runs.items():
        at_u = run(u)
        for cap in (u + 1, *HUGE_CAPACITIES):
            assert np.array_equal(run(cap), at_u), (name, cap)
    with pytest.raises(ValueError, match="capacity_blocks=0 must be >= 1"):
        timing_oracle(arrs, 0, 0.5)
    with pytest.raises(TypeError, match="capacity_blocks must be an integer"):
        joint_oracle(arrs, True, 0.5, 0.1)  # type: ignore[arg-type]
    empty = arrays_from_lists([[], []])  # no distinct block: still a capacity of 1
    assert joint_oracle(empty, 2**62, 0.5, 0.1).tolist() == [0, 0]


def test_cli_bounds_at_a_capacity_above_the_distinct_blocks_equal_the_unlimited_rows(tmp_path: Path):
    pd = pytest.importorskip("pandas")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 20,
                                         "hash_ids": ids}) + "\n" for i, ids in enumerate(_lists())))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "quillcache", "hitrate", str(trace), "--policies", "lru",
                        "--capacities", f"{2**62},inf", "--bounds", "--bound-flip-rates", "10%", "--out", str(out)],
                       capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    df = pd.read_csv(out / "hitrate.csv")
    assert {"reuse_oracle", "timing_oracle", "joint_oracle@10%"} <= set(df["policy"])
    huge = df[df.capacity_blocks == 2**62].set_index("policy")["hit_blocks"]
    unlimited = df[df.capacity_blocks.isna()].set_index("policy")["hit_blocks"]
    assert len(huge) == len(unlimited) == df["policy"].nunique()
    assert huge.sort_index().equals(unlimited.sort_index())


# ---------------------------------------------------------------- 2. lookahead windows past the trace


def test_lookahead_window_past_the_trace_is_the_whole_trace():
    arrs = arrays_from_lists([[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3, 7]])
    assert replay(arrs, "lookahead", 2, window_requests=1).tolist() == [0, 1, 0, 0]  # a short window misses one
    whole = replay(arrs, "lookahead", 2, window_requests=arrs.num_requests)
    for w in (arrs.num_requests, 10**6, 2**62, sys.maxsize - 1, sys.maxsize, 2**63, 2**64, 2**70):
        assert np.array_equal(simulate(arrs, "lookahead", 2, window_requests=w).hits_per_request, whole), w
        assert np.array_equal(replay(arrs, "lookahead", 2, window_requests=w), whole), w
    # the kernel itself: r + 1 + window_requests must not wrap for any int64 window
    for w in (sys.maxsize - 1, sys.maxsize):
        hits = np.zeros(arrs.num_requests, np.int32)
        kernels.lookahead(arrs.req_offsets, arrs.blocks, arrs.num_unique, 2, hits, arrs.next_use, w)
        assert np.array_equal(hits, whole), w


# ---------------------------------------------------------------- 3. option values outside the kernels' domain


@pytest.mark.parametrize(("policy", "options", "message"), [
    ("quillhd", {"period": 2**50 + 1}, r"period=1125899906842625 must be in \[1, 1125899906842624\]"),
    ("lhd", {"period": 2**64}, r"period=18446744073709551616 must be in \[1, "),
    ("quillchain", {"period": sys.maxsize}, r"period=9223372036854775807 must be in \[1, 2199023255552\]"),
    ("quillhd", {"block_tokens": 2**63 + 1}, r"block_tokens=9223372036854775809 must be in \[1, 65536\]"),
    ("quillchain", {"block_tokens": 65537}, r"block_tokens=65537 must be in \[1, 65536\]"),
    ("lrb", {"block_tokens": 2**40}, r"block_tokens=1099511627776 must be in \[1, 65536\]"),
    ("tinylfu", {"sample_factor": sys.maxsize}, r"sample_factor=9223372036854775807 must be in \[1, 1073741824\]"),
])
def test_options_outside_the_kernels_domain_are_refused_naming_them(policy, options, message):
    arrs = arrays_from_lists(_lists())
    with pytest.raises(ValueError, match=message):
        simulate(arrs, policy, 2, **options)
    with pytest.raises(ValueError, match=message):  # the online class says the same
        replay(arrs, policy, 2, **options)


@pytest.mark.parametrize(("policy", "options"), [
    ("quillhd", {"period": 2**50}), ("lhd", {"period": 2**50}),
    ("quillchain", {"period": 2**41, "block_tokens": 1, "cap_period": False}),
    ("quillchain", {"period": 1, "block_tokens": 65536}),
    ("quillhd", {"block_tokens": 65536}), ("lrb", {"block_tokens": 65536}),
    ("tinylfu", {"sample_factor": 2**30}),
    ("lrb", {"seed": 2**63 - 1}), ("lrb", {"seed": 2**63 + 1}), ("lrb", {"seed": 2**64 + 5}),
    ("belady", {"bypass": np.bool_(False)}), ("belady", {"bypass": np.bool_(True)}),
])
def test_the_largest_accepted_options_replay_like_the_online_class(policy, options):
    arrs = arrays_from_lists(_lists() * 3)
    for cap in (2, 4):
        assert np.array_equal(simulate(arrs, policy, cap, **options).hits_per_request,
                              replay(arrs, policy, cap, **options)), (policy, options, cap)


def test_an_lrb_seed_is_taken_mod_2_64_as_the_class_takes_it():
    arrs = arrays_from_lists(_lists() * 3)
    assert np.array_equal(simulate(arrs, "lrb", 3, seed=2**64 + 5).hits_per_request,
                          simulate(arrs, "lrb", 3, seed=5).hits_per_request)
    assert make_policy("lrb", seed=2**64 + 5)._ctr == 5


def test_the_block_size_bound_is_the_trace_schemas():
    from quillcache.policies.base import MAX_BLOCK_TOKENS
    from quillcache.traces.schemas import MAX_BLOCK_TOKENS as SCHEMA_MAX

    assert MAX_BLOCK_TOKENS == SCHEMA_MAX


# ---------------------------------------------------------------- 6. what validate_arrays checks


def test_validate_refuses_ids_not_dense_in_order_of_first_appearance():
    a = arrays_from_lists([[10, 11], [10, 12], [13]])  # blocks 0 1 0 2 3, num_unique 4
    assert a.blocks.tolist() == [0, 1, 0, 2, 3]
    cases = [
        (np.array([3, 1, 3, 0, 2], np.int32), 4, r"blocks\[0\]=3 is not 0"),
        (np.array([0, 2, 0, 1, 3], np.int32), 4, r"blocks\[1\]=2 appears before id 1"),
        (np.array([0, 1, 0, 3, 2], np.int32), 4, r"blocks\[3\]=3 appears before id 2"),
        (np.array([0, 1, 0, 2, 3], np.int32), 6, r"num_unique=6 but only ids 0..3 appear"),
    ]
    for blocks, u, message in cases:
        bad = _with(a, blocks=blocks, next_use=compute_next_use(blocks, u), num_unique=u,
                    conv_ids=np.array([blocks[1], blocks[3], blocks[4]], np.int32))
        with pytest.raises(ValueError, match=message):
            validate_arrays(bad)
        with pytest.raises(ValueError, match=message):
            simulate(bad, "tinylfu", 2)


def test_validate_refuses_wrong_conv_ids_and_timestamps_going_back():
    a = arrays_from_lists([[10, 11], [10, 12], [13], []], timestamps_ms=[5, 6, 6, 9])
    assert a.conv_ids.tolist() == [1, 2, 3, -1]
    for conv, message in (([1, 2, 3, 0], r"conv_ids\[3\]=0 must be request 3's .*: -1"),
                          ([7, 2, 3, -1], r"conv_ids\[0\]=7 must be .*: 1"),
                          ([1, 2, -5, -1], r"conv_ids\[2\]=-5 must be .*: 3")):
        with pytest.raises(ValueError, match=message):
            validate_arrays(_with(a, conv_ids=np.array(conv, np.int32)))
    with pytest.raises(ValueError, match=r"timestamps_ms must be non-decreasing; timestamps_ms\[2\]=4 < 6"):
        validate_arrays(_with(a, timestamps_ms=np.array([5, 6, 4, 9], np.int64)))
    validate_arrays(_with(a))  # the same values in a fresh instance: accepted


# ---------------------------------------------------------------- 7. arrays the caller owns; views under the cache


def test_arrays_from_lists_copies_the_callers_arrays_and_leaves_them_writable():
    ts, isl, osl = np.arange(3, dtype=np.int64), np.full(3, 512, np.int64), np.zeros(3, np.int64)
    arrs = arrays_from_lists([[1], [2], [1]], timestamps_ms=ts, input_tokens=isl, output_tokens=osl)
    for mine, theirs in ((ts, arrs.timestamps_ms), (isl, arrs.input_tokens), (osl, arrs.output_tokens)):
        assert mine.flags.writeable and not np.shares_memory(mine, theirs)
        assert not theirs.flags.writeable and theirs.flags.owndata
    ts[0], isl[0] = 7, 100  # the caller keeps using its arrays; the trace does not change
    assert arrs.timestamps_ms.tolist() == [0, 1, 2] and arrs.input_tokens.tolist() == [512, 512, 512]
    for f in FIELDS[:-1]:  # everything the project builds takes validate_arrays' fast path
        assert getattr(arrs, f).flags.owndata and not getattr(arrs, f).flags.writeable, f


def test_a_validated_instance_over_writable_memory_is_checked_again():
    base = np.array([0, 1, 0], np.int32)  # writable memory under a read-only view
    blocks = _frozen(base.view())
    t = TraceArrays(_frozen(np.array([0, 1, 2, 3], np.int64)), blocks, _frozen(np.zeros(3, np.int64)),
                    _frozen(np.full(3, 512, np.int64)), _frozen(np.zeros(3, np.int64)),
                    _frozen(compute_next_use(blocks, 2)), _frozen(np.array([0, 1, 0], np.int32)), 2)
    assert simulate(t, "belady", 1).hits_per_request.tolist() == [0, 0, 1]
    base[2] = 1  # in range, but next_use and conv_ids are now stale: the instance is no longer valid
    with pytest.raises(ValueError, match="conv_ids|next_use"):
        simulate(t, "belady", 1)
    base[2] = 0  # valid again: replayed again
    assert simulate(t, "belady", 1).hits_per_request.tolist() == [0, 0, 1]
