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


# ---------------------------------------------------------------- second review: prefix-chained traces (M2)


UNCHAINED = [[3], [2, 5, 6], [2, 4, 6, 5], [5, 2, 3]]  # 6 follows 5, then 4; lengthaware beats Belady at 3 blocks


def _jsonl(path: Path, lists: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(lists)), encoding="utf-8")
    return path


def test_arrays_from_lists_says_whether_the_ids_are_prefix_chained_and_where_not():
    from quillcache.hitrate.arrays import ChainBreak

    for chained in ([], [[]], [[1, 2], [1, 2, 3], [], [1, 4], [7]], _lists()):
        a = arrays_from_lists(chained)
        assert a.prefix_chained is True and a.chain_break is None, chained
    a = arrays_from_lists(UNCHAINED)
    assert a.prefix_chained is False
    assert a.chain_break == ChainBreak(request=2, position=2, block_id=6, parent=4, first_request=1, first_position=2,
                                       first_parent=5, in_one_request=False)
    assert str(a.chain_break) == ("block id 6 (request 2, position 2) follows id 4, but at its first reference "
                                  "(request 1, position 2) it follows id 5")
    # an id twice in one request; a first block that follows another block elsewhere; the trace's own ids (uint64)
    big = 2**64 - 1
    assert arrays_from_lists([[0, 5, 5], [0]]).chain_break == ChainBreak(0, 2, 5, 5, 0, 1, 0, True)
    assert arrays_from_lists([[1, 2], [2]]).chain_break == ChainBreak(1, 0, 2, None, 0, 1, 1, False)
    assert arrays_from_lists([[big, 9], [], [7, 9]]).chain_break == ChainBreak(2, 1, 9, 7, 0, 1, big, False)
    assert "it occurs twice in request 0" in str(arrays_from_lists([[0, 5, 5], [0]]).chain_break)
    # a sub-trace is checked again; the study's traces are prefix-chained and belady bounds the policies there
    assert a.subset(np.array([0, 1])).prefix_chained is True and a.subset(np.array([0, 1, 3])).prefix_chained is False
    assert simulate(a, "lengthaware", 3).hit_blocks > simulate(a, "belady", 3).hit_blocks  # why it matters


def test_validate_refuses_a_prefix_chained_flag_the_blocks_contradict():
    a = arrays_from_lists(UNCHAINED)
    assert _with(a).prefix_chained is None  # built by hand without it: not known, accepted
    validate_arrays(_with(a))
    with pytest.raises(ValueError, match=r"prefix_chained=True but the blocks are not \(block reference 6 breaks it\)"):
        validate_arrays(_with(a, prefix_chained=True))
    with pytest.raises(ValueError, match="chain_break must be given exactly when prefix_chained is False"):
        validate_arrays(_with(a, prefix_chained=False))
    ok = arrays_from_lists(_lists())
    with pytest.raises(ValueError, match="prefix_chained=False but the blocks are prefix-chained"):
        validate_arrays(_with(ok, prefix_chained=False, chain_break=a.chain_break))
    with pytest.raises(TypeError, match="prefix_chained must be a bool or None"):
        validate_arrays(_with(ok, prefix_chained=1))


def test_the_study_refuses_a_trace_that_is_not_prefix_chained():
    from experiments.hitrate_study import hit_rate_table

    with pytest.raises(AssertionError, match="not prefix-chained: block id 6 .request 2, position 2."):
        hit_rate_table(arrays_from_lists(UNCHAINED), [3], ["lru", "belady"])
    assert hit_rate_table(arrays_from_lists(_lists()), [2], ["lru"])[("lru", 2)] >= 0.0


def test_cli_refuses_a_trace_that_is_not_prefix_chained_naming_the_block(tmp_path: Path, capsys):
    from quillcache.cli import main

    trace = _jsonl(tmp_path / "np.jsonl", UNCHAINED)
    out = tmp_path / "out"
    assert main(["hitrate", str(trace), "--policies", "lengthaware", "--capacities", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1  # ONE line, before any replay
    assert err[0].startswith(f"quillcache hitrate: error: {trace}:3: hash ids are not prefix-chained: block id 6 "
                             f"at hash_ids[2] follows id 4, but at its first reference (line 2, hash_ids[2]) it "
                             f"follows id 5; Belady is then no upper bound")  # file and lines (CLI review s37 L1)
    assert "--allow-unchained" in err[0]
    assert not out.exists() or not any(out.iterdir())  # nothing written


def test_cli_allow_unchained_labels_belady_a_heuristic_and_leaves_every_gap_closed_na(tmp_path: Path, capsys):
    import pandas as pd

    from quillcache.cli import main
    from quillcache.results import read_summary

    trace = _jsonl(tmp_path / "np.jsonl", UNCHAINED)
    out = tmp_path / "out"
    assert main(["hitrate", str(trace), "--policies", "lengthaware", "--capacities", "3,inf", "--bounds",
                 "--allow-unchained", "--out", str(out)]) == 0
    cap = capsys.readouterr()
    assert "belady (heuristic: trace not prefix-chained, no bound)" in cap.out
    assert "offline bound" not in cap.out and "+200.0%" not in cap.out
    assert "--allow-unchained: belady is a heuristic and gap_closed is NA in every row" in cap.err
    raw = (out / "hitrate.csv").read_text().splitlines()
    df = pd.read_csv(out / "hitrate.csv")
    assert df["gap_closed"].isna().all() and len(df) == 8  # lru, lengthaware, belady, reuse_oracle x 2 capacities
    gap_col = raw[0].split(",").index("gap_closed")
    assert all(line.split(",")[gap_col] == "" for line in raw[1:])  # NA: empty in the CSV
    by = df.drop_duplicates("policy").set_index("policy")
    assert by.loc["belady", "label"] == "heuristic: trace not prefix-chained, no bound"
    assert by.loc["belady", "policy_class"] == "offline" and by.loc["lengthaware", "policy_class"] == "online"
    assert by.loc["reuse_oracle", "label"].endswith("; heuristic: trace not prefix-chained, no bound")
    tidy = read_summary("out", tmp_path)
    assert set(tidy["metric"]) == {"hit_rate"} and (tidy["prefix_chained"] == False).all()  # noqa: E712
    assert set(tidy[tidy.subject.isin(["belady", "reuse_oracle"])]["notes"]) == {
        "heuristic: trace not prefix-chained, no bound"}


# ---------------------------------------------------------------- second review: the class of each row (L4)


def test_cli_files_keep_lookahead_apart_as_the_study_does(tmp_path: Path, capsys):
    import pandas as pd

    from quillcache.cli import main
    from quillcache.hitrate import HITRATE_KERNELS
    from quillcache.results import read_summary

    trace = _jsonl(tmp_path / "c.jsonl", _lists())
    out = tmp_path / "out"
    assert main(["hitrate", str(trace), "--policies", "lookahead,sieve", "--capacities", "2,inf", "--quiet",
                 "--out", str(out)]) == 0
    df = pd.read_csv(out / "hitrate.csv")
    cls = dict(zip(df["policy"], df["policy_class"]))
    assert cls == {"lru": "online", "sieve": "online", "lookahead": "semi_online", "belady": "offline"}
    label = dict(zip(df["policy"], df["label"].fillna("")))
    assert label == {"lru": "", "sieve": "", "lookahead": "semi-online", "belady": "offline bound"}
    w = HITRATE_KERNELS["lookahead"].options["window_requests"]
    assert set(df[df.policy == "lookahead"]["window_requests"]) == {w} and df[df.policy != "lookahead"][
        "window_requests"].isna().all()
    tidy = read_summary("out", tmp_path)
    semi = tidy[tidy.subject == "lookahead"]
    assert set(semi["metric"]) == {"semi_online_hit_rate", "semi_online_gap_closed"}  # the study's names
    assert set(semi["window_requests"]) == {w}
    assert set(tidy[tidy.subject != "lookahead"]["metric"]) == {"hit_rate", "gap_closed"}
    assert not tidy["metric"].isin(["hit_rate", "gap_closed"])[tidy.subject == "lookahead"].any()
    assert "prefix_chained" not in tidy.columns or tidy["prefix_chained"].isna().all()


# ---------------------------------------------------------------- second review: docstrings (M1, L3)


def test_docstrings_claim_neither_belady_without_bypass_optimal_nor_hits_on_a_prefix_as_the_online_proof():
    """Without bypass Belady is per-reference MIN and not optimal for prefix hits among policies that
    always admit: [0,1,2] [0,1,2] [0] at 2 blocks, it hits 1 block, keeping 0 and dropping 2 for 1 on
    the second request hits 2; with bypass it hits 3. And equal hits on a trace prefix do not show a
    policy sees no future (Belady has them too); the online test compares decisions."""
    import quillcache.hitrate as hitrate
    import quillcache.policies.belady as belady

    arrs = arrays_from_lists([[0, 1, 2], [0, 1, 2], [0]])
    assert simulate(arrs, "belady", 2, bypass=False).hit_blocks == 1
    assert simulate(arrs, "belady", 2).hit_blocks == 3
    text = " ".join((belady.__doc__ or "").split())
    assert "MIN among policies that always admit" not in text and "not optimal for prefix hits" in text
    text = " ".join((hitrate.__doc__ or "").split())
    assert "hits on a trace prefix == the full run's" not in text and "Tested on decisions, not hits" in text
