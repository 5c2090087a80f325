"""Hit-rate replay: REFERENCE §5 numbers on the real trace, kernels == online reference hit for
hit on random prefix-structured traces, Belady as the bound, input validation, study smoke test."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.hitrate import (
    HITRATE_POLICIES,
    SEMI_ONLINE,
    HitRateResult,
    make_hitrate_policy,
    simulate,
)
from quillcache.hitrate.arrays import (
    TraceArrays,
    arrays_from_lists,
    compute_next_use,
    validate_arrays,
)
from quillcache.hitrate.reference import replay
from quillcache.traces.loader import TraceRequest, default_trace_path

POLICIES = sorted(HITRATE_POLICIES)

# ---------------------------------------------------------------- the real trace


@pytest.fixture(scope="module")
def real_arrays(trace_path):  # trace_path (tests/conftest.py) skips when the shared trace is absent
    from quillcache.hitrate.arrays import load_arrays

    return load_arrays(trace_path)


def test_lru_lfu_reproduce_reference_numbers(real_arrays):
    caps = [1000, 10000, 30000, 50000, 100000, None]
    want = {"lru": [0.044, 0.211, 0.326, 0.355, 0.364, 0.366], "lfu": [0.048, 0.132, 0.276, 0.344, 0.363, 0.366]}
    assert real_arrays.num_requests == 12031 and real_arrays.num_refs == 288500 and real_arrays.num_unique == 182790
    for pol, expected in want.items():
        got = [round(simulate(real_arrays, pol, c).hit_rate, 3) for c in caps]
        assert got == expected, (pol, got)
    assert round(simulate(real_arrays, "belady", 1000).hit_rate, 3) == 0.191
    assert round(simulate(real_arrays, "belady", 10000).hit_rate, 3) == 0.366


def test_quillhd_beats_lru_on_real_trace(real_arrays):
    for cap in (1000, 10000, 30000, 50000):
        assert simulate(real_arrays, "quillhd", cap).hit_rate > simulate(real_arrays, "lru", cap).hit_rate, cap


def test_kernels_match_reference_on_real_prefix(real_arrays):
    sub = real_arrays.subset(np.arange(400))
    for pol in POLICIES:
        assert np.array_equal(simulate(sub, pol, 300).hits_per_request, replay(sub, pol, 300)), pol


# ---------------------------------------------------------------- random prefix-structured traces


@st.composite
def conversation_traces(draw, max_requests: int = 40):
    """Requests that extend conversations (chains of ids), fork from other chains' prefixes,
    share a system-prompt block, repeat exactly, or end in a partial block."""
    n = draw(st.integers(0, max_requests))
    chains: list[list[int]] = []
    lists, isl = [], []
    next_id = 1
    for _ in range(n):
        kind = draw(st.sampled_from(["new", "continue", "continue", "fork", "repeat"]))
        if kind != "new" and chains:
            base = chains[draw(st.integers(0, len(chains) - 1))]
            if kind == "fork":
                base = base[: draw(st.integers(0, len(base)))]
            chain = list(base)
        else:
            chain = [0] if draw(st.booleans()) else []
        if kind != "repeat" or not chain:
            grow = draw(st.integers(0 if chain else 1, 4))
            chain.extend(range(next_id, next_id + grow))
            next_id += grow
        chains.append(chain)
        lists.append(list(chain))
        partial = draw(st.integers(0, 2)) == 0 and chain
        isl.append(len(chain) * 512 - (100 if partial else 0))
    return arrays_from_lists(lists, input_tokens=isl)


def _options(draw, pol: str) -> dict:
    if pol == "quillchain":
        return {"period": draw(st.sampled_from([3, 8, 2048])),
                "mode": draw(st.sampled_from(["challenger", "adaptive", "hd", "lru"])), "admit": draw(st.booleans()),
                "shared_rate": draw(st.booleans()), "second_chance": draw(st.booleans()),
                # period_refs scales the period and second_chance_max the second chances by the block size
                # (16384: at most 2 second chances per eviction, so the bound itself is exercised)
                "block_tokens": draw(st.sampled_from([16, 512, 16384])),
                "start_rule": draw(st.sampled_from(["lru", "hd"]))}
    if pol == "lhd":
        return {"period": draw(st.sampled_from([3, 8, 4096])), "decay": draw(st.sampled_from([0.5, 0.9]))}
    if pol == "lookahead":
        return {"window_requests": draw(st.sampled_from([0, 1, 3, 100]))}
    if pol == "lrb":
        return {"sample_size": draw(st.sampled_from([1, 4, 64])), "window_mult": draw(st.sampled_from([1, 8])),
                "seed": draw(st.integers(0, 3))}
    if pol == "2q":
        return {"kin_ratio": draw(st.sampled_from([0.1, 0.25, 0.5])), "kout_ratio": draw(st.sampled_from([0.0, 0.5, 2.0]))}
    if pol == "quillhd":
        return {"period": draw(st.sampled_from([3, 8, 32, 4096])), "mode": draw(st.sampled_from(["adaptive", "hd", "lru", "challenger"])),
                "decay": draw(st.sampled_from([0.5, 0.9])), "quantile": draw(st.sampled_from([0.5, 0.95])),
                "start_rule": draw(st.sampled_from(["hd", "lru"]))}
    if pol == "tinylfu":
        return {"sample_factor": draw(st.sampled_from([1, 2, 10])), "window_ratio": draw(st.sampled_from([0.0, 0.01, 0.3])),
                "doorkeeper": draw(st.booleans())}
    if pol == "belady":
        return {"bypass": draw(st.booleans())}
    if pol == "s3fifo":
        return {"move_to_main_threshold": draw(st.sampled_from([1, 2]))}
    return {}


@given(arrs=conversation_traces(), cap=st.integers(1, 24), data=st.data())
def test_kernels_agree_with_online_reference(arrs, cap, data):
    for pol in POLICIES:
        opts = _options(data.draw, pol)
        fast = simulate(arrs, pol, cap, **opts)
        ref = replay(arrs, pol, cap, **opts)
        assert np.array_equal(fast.hits_per_request, ref), (pol, opts)
        assert fast.hit_blocks == int(ref.sum())


@given(arrs=conversation_traces(), cap=st.integers(1, 24))
def test_belady_bounds_every_policy(arrs, cap):
    bound = simulate(arrs, "belady", cap).hit_blocks
    for pol in POLICIES:
        assert simulate(arrs, pol, cap).hit_blocks <= bound, pol
    assert simulate(arrs, "belady", cap, bypass=False).hit_blocks <= bound


@given(arrs=conversation_traces(), cap=st.integers(1, 24))
def test_hits_are_monotone_prefixes_and_unlimited_is_exact(arrs, cap):
    lens = np.diff(arrs.req_offsets)
    for pol in POLICIES:
        res = simulate(arrs, pol, cap)
        assert np.all(res.hits_per_request <= lens) and np.all(res.hits_per_request >= 0)
    # unlimited: a block hits iff its whole prefix was seen before
    seen: set[int] = set()
    want = 0
    for r in range(arrs.num_requests):
        req = arrs.request(r).tolist()
        for b in req:
            if b in seen:
                want += 1
            else:
                break
        seen.update(req)
    for pol in POLICIES:
        assert simulate(arrs, pol, None).hit_blocks == want, pol


# ---------------------------------------------------------------- bad input


def _arrays() -> TraceArrays:
    return arrays_from_lists([[0, 1, 2], [0, 1, 3], [4]])


def test_simulate_rejects_bad_policy_and_capacity():
    a = _arrays()
    with pytest.raises(ValueError, match=r"unknown hit-rate policy 'mru'.*belady.*lru.*quillhd"):
        simulate(a, "mru", 10)
    with pytest.raises(TypeError, match="policy name must be str"):
        simulate(a, 3, 10)  # type: ignore[arg-type]
    for bad in (0, -5):
        with pytest.raises(ValueError, match=f"capacity_blocks={bad} must be >= 1"):
            simulate(a, "lru", bad)
    for bad in (True, 2.5, "10"):
        with pytest.raises(TypeError, match="capacity_blocks must be an integer"):
            simulate(a, "lru", bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"policy 'lru' takes no kernel option\(s\) \['bypass'\]"):
        simulate(a, "lru", 10, bypass=True)
    with pytest.raises(ValueError, match="mode='fast'"):
        simulate(a, "quillhd", 10, mode="fast")
    with pytest.raises(ValueError, match="small_ratio=2"):
        simulate(a, "s3fifo", 10, small_ratio=2)
    with pytest.raises(TypeError, match="trace_or_arrays must be"):
        simulate(42, "lru", 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown hit-rate policy 'nope'"):
        make_hitrate_policy("nope")
    with pytest.raises(TypeError, match="belady needs the future"):
        make_hitrate_policy("belady")


def _with(a: TraceArrays, **changes) -> TraceArrays:
    fields = {f: getattr(a, f) for f in ("req_offsets", "blocks", "timestamps_ms", "input_tokens", "output_tokens",
                                         "next_use", "conv_ids", "num_unique")}
    fields.update(changes)
    return TraceArrays(**fields)


def test_malformed_arrays_are_refused_with_the_value_named():
    a = _arrays()
    cases = [
        ({"blocks": a.blocks.astype(np.int64)}, TypeError, "blocks must have dtype int32, got int64"),
        ({"blocks": np.array([0, 1, 2, 0, 1, 3, 9], np.int32)}, ValueError, r"\[0, num_unique=5\), got range \[0, 9\]"),
        ({"blocks": np.array([0, 1, 2, 0, 1, 3, -1], np.int32)}, ValueError, r"got range \[-1, 3\]"),
        ({"req_offsets": np.array([0, 3, 6, 9], np.int64)}, ValueError, "end at len\\(blocks\\)=7"),
        ({"req_offsets": np.array([0, 6, 3, 7], np.int64)}, ValueError, "non-decreasing"),
        ({"req_offsets": np.array([[0, 3, 6, 7]], np.int64)}, ValueError, "req_offsets must be 1-D"),
        ({"next_use": np.zeros(7, np.int64)}, ValueError, "next_use does not match"),
        ({"next_use": np.zeros(6, np.int64)}, ValueError, "next_use has 6 entries"),
        ({"timestamps_ms": np.zeros(2, np.int64)}, ValueError, "timestamps_ms has 2 entries for 3 requests"),
        ({"input_tokens": [1, 2, 3]}, TypeError, "input_tokens must be a numpy array, got list"),
        ({"num_unique": -1}, ValueError, "num_unique=-1 must be >= 0"),
        ({"blocks": np.arange(14, dtype=np.int32)[::2]}, ValueError, "blocks must be C-contiguous"),
    ]
    for change, exc, msg in cases:
        bad = _with(a, **change)
        with pytest.raises(exc, match=msg):
            validate_arrays(bad)
        with pytest.raises(exc, match=msg):
            simulate(bad, "lru", 2)
    with pytest.raises(ValueError, match="hash ids must be non-negative"):
        arrays_from_lists([[0, -3]])


def test_arrays_layout_and_next_use():
    a = arrays_from_lists([[10, 11], [10, 12, 11], [], [12]], input_tokens=[1024, 1500, 0, 512])
    assert a.blocks.tolist() == [0, 1, 0, 2, 1, 2] and a.num_unique == 3
    assert a.req_offsets.tolist() == [0, 2, 5, 5, 6]
    assert a.next_use.tolist() == [2, 4, 6 + 2, 5, 6 + 4, 6 + 5]
    assert a.conv_ids.tolist() == [1, 2, -1, 2]
    assert compute_next_use(np.zeros(0, np.int32), 0).shape == (0,)
    assert not a.blocks.flags.writeable
    res = simulate([TraceRequest(0, 1024, 1, (5, 6)), TraceRequest(1, 1024, 1, (5, 6))], "lru", 4)
    assert isinstance(res, HitRateResult) and res.hit_blocks == 2 and res.hit_rate == 0.5


# ---------------------------------------------------------------- study smoke test


def test_loss_anatomy_picks_the_lost_cells_and_accounts_for_every_reference():
    """``loss_anatomy`` takes only cells where ours is not above the best baseline and that baseline
    is below Belady, compares ours with that baseline, and its cells cover the trace once."""
    from experiments import hitrate_study as study

    arrs = study.synthetic_conversation_trace(60)
    cap = max(2, arrs.num_unique // 20)
    hr = {p: simulate(arrs, p, cap).hit_rate for p in (*study.GEN_BASELINES, "belady")}
    best = max(study.GEN_BASELINES, key=hr.get)
    assert hr[best] < hr["belady"]

    def rows(ours_hr: float, f: float = 0.05) -> list[tuple]:
        return [("t", 1, p, f, cap, v, 0.0) for p, v in {**hr, "quillchain": ours_hr}.items()]

    raw, summary = study.loss_anatomy({"s": ([("t", 1, arrs)], rows(hr[best]))})  # a tie: not beaten
    assert {r[4] for r in raw} == {best} and sum(r[7] for r in raw) == arrs.num_refs
    net = sum(r[9] - r[8] for r in raw)
    ours = simulate(arrs, "quillchain", cap).hit_blocks
    assert net == round(hr[best] * arrs.num_refs) - ours  # baseline-only minus ours-only = the difference
    for key in ("uses", "previous_use"):  # shares of the net loss; none when ours in fact hits more
        shares = [r.value for r in summary if key in r.params]
        assert shares and (math.isclose(sum(shares), 1.0) if net > 0 else all(math.isnan(v) for v in shares))
    assert study.loss_anatomy({"s": ([("t", 1, arrs)], rows(hr[best] + 0.01))})[0] == []  # ours wins: skipped


def test_study_quick_smoke(tmp_path, monkeypatch):
    from experiments import hitrate_study as study

    monkeypatch.delenv(study.LCS_ENV, raising=False)
    trace = default_trace_path()
    if not trace.is_file():  # a small synthetic trace in Mooncake format instead
        arrs = study.synthetic_conversation_trace(300)
        trace = tmp_path / "synthetic.jsonl"
        with open(trace, "w") as fh:
            for r in range(arrs.num_requests):
                ids = (arrs.request(r) + 0).tolist()
                fh.write(json.dumps({"timestamp": int(arrs.timestamps_ms[r]), "input_length": len(ids) * 512,
                                     "output_length": 1, "hash_ids": ids}) + "\n")
    rows = study.run(quick=True, results_root=str(tmp_path), trace=trace)
    label = Path(trace).stem  # rows name the trace they ran on (a --trace of your own is not "conversation")
    hit = {(r.subject, r.params.get("capacity_blocks")): r.value for r in rows
           if r.metric == "hit_rate" and r.params["trace"] == label}
    for cap in (1000, 10000, None):
        assert all(hit[(p, cap)] <= hit[("belady", cap)] + 1e-12 for p in POLICIES if p not in SEMI_ONLINE)
    semi = [r for r in rows if r.metric.startswith("semi_online")]
    assert {r.subject for r in semi} == SEMI_ONLINE and {r.params["window_requests"] for r in semi} == {1, 8, 64}
    assert not any(r.subject in SEMI_ONLINE for r in rows if not r.metric.startswith("semi_online"))
    assert {r.params["trace"] for r in rows} == {label, study.SYNTH_LABEL, "generalisation", *study.GEN_SHAPES,
                                                 "generalisation, held-out seeds", "generalisation, random shapes",
                                                 "generalisation, mixed shapes",
                                                 "generalisation, 16-token blocks", "generalisation, all sets"}
    assert any(r.metric == "pooled_hit_rate" and r.params["capacity_tokens"] == 3_000_000 for r in rows)
    info = {(r.params["capacity_blocks"], r.params["flip_rate"]): r for r in rows
            if r.metric == "information_bound_hit_rate" and r.subject == "reuse_oracle"}  # offline, apart
    assert {c for c, f in info if f == 0.0} == {1000, 10000} and {f for c, f in info if c == 1000} == {
        0.0, *study.INFO_FLIP_RATES}
    assert all(r.subject == "reuse_oracle" and 0.0 <= r.value <= hit[("lru", None)] + 1e-12 for r in info.values())
    assert not any(r.subject == "reuse_oracle" for r in rows if not r.metric.startswith("information_bound"))
    timing = {(r.params["capacity_blocks"], r.params["sigma"]): r for r in rows
              if r.metric == "information_bound_gap_closed" and r.subject == "timing_oracle"}
    sigma = [r for r in rows if r.metric == "timing_predictability_sigma"]
    assert len(sigma) == 1 and sigma[0].value > 0  # the quick trace's turns that come back
    assert {c for c, _ in timing} == {1000, 10000}
    assert {g for c, g in timing if c == 1000} == {*study.INFO_TIMING_SIGMAS, round(sigma[0].value, 2)}
    assert all(r.value <= 1.0 + 1e-12 for r in timing.values())  # never above Belady
    joint = {(r.params["capacity_blocks"], r.params["flip_rate"]): r for r in rows
             if r.metric == "information_bound_gap_closed" and r.subject == "joint_oracle"}
    assert {c for c, _ in joint} == {1000, 10000} and {f for c, f in joint if c == 1000} >= set(study.INFO_FLIP_RATES)
    assert all(r.params["sigma"] == round(sigma[0].value, 2) and r.value <= 1.0 + 1e-12 for r in joint.values())
    pred = {r.subject: r for r in rows if r.metric == "reuse_predictability_auc"}
    assert "logistic (all features)" in pred and all(0.0 <= r.value <= 1.0 for r in pred.values())
    learned = {(r.params["label_mode"], r.params["capacity_blocks"]): r for r in rows
               if r.metric == "learned_reuse_hit_rate"}  # the trees' bits as hits, apart from the online table
    assert set(learned) == {(m, c) for m in study.LABEL_MODES for c in study.ACCEPT_GAP_CAPS}
    assert all(hit[("lru", None)] + 1e-12 >= r.value >= 0.0 and r.params["threshold"] in study.GBM_THRESHOLDS
               for r in learned.values())
    raw = pd.read_csv(tmp_path / "hitrate" / "learned_reuse.csv")  # every threshold, raw
    assert len(raw) == len(study.LABEL_MODES) * len(study.ACCEPT_GAP_CAPS) * len(study.GBM_THRESHOLDS)
    beaten = {(r.subject, r.baseline): r for r in rows if r.metric == "cells_beaten"}
    assert set(beaten) == {(p, b) for p in ("quillchain", "quillhd") for b in study.GEN_BASELINES}
    assert all(0.0 <= r.value <= 1.0 and r.n == 4 * (len(study.GEN_SHAPES) + 1) for r in beaten.values())
    rand = {(r.subject, r.baseline): r for r in rows if r.metric == "cells_beaten_random"}
    assert set(rand) == {(p, b) for p in ("quillchain", "quillhd") for b in study.GEN_BASELINES}
    assert all(r.n == 4 * study.QUICK["random_shapes"] for r in rand.values())
    head = {r.subject: r for r in rows if r.metric == "selector_headroom"}
    checked = pd.read_csv(tmp_path / "hitrate" / "defaults_check.csv")  # the cells it is counted on
    assert len(head) == 5 and {r.n for r in head.values()} == {len(checked.groupby(["trace", "seed", "cap_fraction"]))}
    hind_fixed, hind_all = head["hindsight: better fixed rule per cell"], head[
        "hindsight: best of challenger and fixed rules per cell"]
    for rule in ("quillchain hd rule only", "quillchain lru rule only"):  # a hindsight choice is never worse
        assert head[rule].value <= hind_fixed.value <= hind_all.value <= hind_all.n
    assert head["quillchain challenger"].value <= hind_all.value
    mixed = {(r.subject, r.baseline): r for r in rows if r.metric == "cells_beaten_mixed"}
    assert set(mixed) == set(beaten)
    assert all(r.n == 4 * len(study.MIX_SHAPES) * len(study.QUICK["mix_seeds"]) for r in mixed.values())
    raw_mix = pd.read_csv(tmp_path / "hitrate" / "mixed.csv")
    assert set(raw_mix["trace"]) == set(study.MIX_SHAPES) and set(raw_mix["seed"]) == set(study.QUICK["mix_seeds"])
    assert not set(study.FULL["mix_seeds"]) & {*study.FULL["gen_seeds"], *study.FULL["heldout_seeds"]}
    b16 = {(r.subject, r.baseline): r for r in rows if r.metric == "cells_beaten_block16"}
    assert set(b16) == set(beaten) and all(r.n == 4 * len(study.GEN_SHAPES) for r in b16.values())
    raw16 = pd.read_csv(tmp_path / "hitrate" / "block16.csv")
    assert set(raw16["trace"]) == set(study.GEN_SHAPES) and set(raw16["seed"]) == set(study.QUICK["block16_seeds"])
    assert not set(study.FULL["block16_seeds"]) & set(study.FULL["gen_seeds"])  # held out of the table's seeds
    shape16, seed16, arrs16 = study.block16_traces(study.QUICK)[0]  # QuillChain ran told the block size
    row = raw16[(raw16.trace == shape16) & (raw16.seed == seed16) & (raw16.policy == "quillchain")].iloc[-1]
    assert row.hit_rate == simulate(arrs16, "quillchain", int(row.capacity_blocks), block_tokens=16).hit_rate
    anat = [r for r in rows if r.metric == "loss_anatomy"]
    for key in ("uses", "previous_use"):  # each split accounts for every net lost reference once
        shares = [r.value for r in anat if key in r.params]
        if shares:
            assert math.isclose(sum(shares), 1.0) and all(r.subject == "quillchain" for r in anat)
    lost = pd.read_csv(tmp_path / "hitrate" / "loss_anatomy.csv")
    assert set(lost["set"]) <= {"table", "heldout", "random"} and (lost.references > 0).all()
    held = {(r.subject, r.baseline): r for r in rows if r.metric == "cells_beaten_heldout"}
    assert set(held) == set(beaten)  # every shape at a seed the table does not use
    assert not set(study.QUICK["heldout_seeds"]) & set(study.QUICK["gen_seeds"])
    assert not set(study.FULL["heldout_seeds"]) & set(study.FULL["gen_seeds"])
    assert all(0.0 <= r.value <= 1.0 and r.n == 4 * len(study.GEN_SHAPES) for r in held.values())
    gap = {(r.subject, r.params.get("capacity_blocks")): r.value for r in rows
           if r.metric == "gap_closed" and r.params["trace"] == label}
    for cap in (1000, 10000):  # the acceptance cells are present for ours
        assert ("quillchain", cap) in gap
    speeds = [r for r in rows if r.metric == "replay_refs_per_s" and r.subject == "kernel_lru"]
    assert speeds and all(r.value > 0 for r in speeds)  # one row per baseline (libCacheSim's when importable)
    assert {r.baseline for r in speeds} <= {"python_ordereddict_lru", "libcachesim_lru"}
    with open(tmp_path / "hitrate" / "summary.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)
    for name in ("hit_rates.csv", "pooled.csv", "throughput.csv", "generalisation.csv", "information_bounds.csv",
                 "predictability.csv", "heldout.csv", "timing_bounds.csv", "joint_bounds.csv", "random_shapes.csv",
                 "mixed.csv",
                 "random_shape_knobs.csv"):
        assert (tmp_path / "hitrate" / name).stat().st_size > 0
    paths = study.plot(str(tmp_path), tmp_path / "fig")
    assert all(p.stat().st_size > 1000 for p in paths)


_SMALL_INTS = st.lists(st.integers(-3, 12), max_size=10)


@st.composite
def _corruption(draw, a: TraceArrays) -> dict:
    """One field of valid arrays replaced by a drawn value (often invalid, sometimes still valid)."""
    field = draw(st.sampled_from(["req_offsets", "blocks", "next_use", "conv_ids", "num_unique", "timestamps_ms"]))
    if field == "num_unique":
        return {field: draw(st.integers(-1, a.num_unique + 3))}
    if field in ("blocks", "conv_ids"):
        vals = draw(st.one_of(_SMALL_INTS, st.lists(st.integers(-2, 12), min_size=len(getattr(a, field)),
                                                    max_size=len(getattr(a, field)))))
        new = np.array(vals, np.int32)
        if field == "blocks":  # with its own next uses, so that the ids themselves are what is checked
            return {field: new, "next_use": compute_next_use(new, max(a.num_unique, 0))}
        return {field: new}
    vals = draw(st.one_of(_SMALL_INTS, st.lists(st.integers(-3, 12), min_size=len(getattr(a, field)),
                                                max_size=len(getattr(a, field)))))
    return {field: np.array(vals, np.int64)}


@given(lists=st.lists(st.lists(st.integers(0, 8), max_size=5), max_size=8), cap=st.integers(1, 5), data=st.data())
@settings(max_examples=100)
def test_fuzzed_arrays_are_refused_or_replayed_never_crash(lists, cap, data):
    """Valid arrays (``arrays_from_lists``), half the time with one field corrupted, through every
    policy: valid ones always replay, with the reference's hits; a corrupted one is refused
    (ValueError/TypeError) or, where the drawn value keeps every invariant, replays like the reference."""
    arrs = arrays_from_lists(lists)
    change = data.draw(st.one_of(st.none(), _corruption(arrs)))
    if change is not None:
        arrs = _with(arrs, **change)
        try:
            validate_arrays(arrs)
        except (ValueError, TypeError):
            for policy in POLICIES:
                with pytest.raises((ValueError, TypeError)):
                    simulate(arrs, policy, cap)
            return
    for policy in POLICIES:
        res = simulate(arrs, policy, cap)
        want = replay(arrs, policy, cap)
        assert np.array_equal(res.hits_per_request, want), (policy, cap, change)
        assert res.hit_blocks == int(want.sum())


def test_sweep_is_a_tidy_frame_with_the_gap_closed():
    from quillcache.hitrate.sweep import sweep

    reqs = [TraceRequest(i, 2048, 1, ids) for i, ids in enumerate([(1, 2, 3), (4, 5), (1, 2, 6), (4, 5, 7), (1, 2, 3)])]
    df = sweep(reqs, ["lru", "belady", "fifo"], [2, None])
    assert list(df.columns) == ["policy", "capacity_blocks", "hit_rate", "hit_blocks", "total_blocks", "refs_per_s",
                                "gap_closed"]
    assert df["capacity_blocks"].isna().tolist() == [False, True] * 3  # None = unlimited, a typed NA
    for _, r in df.iterrows():  # each cell is exactly what simulate() gives
        cap = None if pd.isna(r.capacity_blocks) else int(r.capacity_blocks)
        assert r.hit_blocks == simulate(reqs, r.policy, cap).hit_blocks
    at2 = df[df.capacity_blocks == 2].set_index("policy")
    if at2.loc["belady", "hit_rate"] > at2.loc["lru", "hit_rate"]:
        assert at2.loc["lru", "gap_closed"] == 0.0 and at2.loc["belady", "gap_closed"] == 1.0
    with pytest.raises(ValueError, match="non-empty list of policy names"):
        sweep(reqs, "lru", [2])
    with pytest.raises(ValueError, match="unknown|not registered|registered"):
        sweep(reqs, ["nope"], [2])


# ---------------------------------------------------------------- online: no future knowledge


ONLINE = [p for p in POLICIES if p != "belady" and p not in SEMI_ONLINE]


def _learning_options(draw, pol: str) -> dict:
    """``_options`` with every learning period short enough to end several times in a drawn trace
    (default periods are 512 to 4096 references, longer than any of them): QuillHD's, LHD's and
    QuillChain's densities, horizons and rule switches, TinyLFU's aging, LRB's labels by window."""
    opts = _options(draw, pol)
    if pol in ("quillhd", "lhd"):
        opts["period"] = draw(st.integers(1, 8))
    if pol == "quillchain":  # period_refs: 1..8 references of 512-token blocks, 1 of 16384-token ones
        opts.update(period=draw(st.integers(1, 8)), cap_period=False, block_tokens=draw(st.sampled_from([512, 16384])))
    if pol == "tinylfu":
        opts["sample_factor"] = 1
    if pol == "lrb":
        opts["window_mult"] = 1
    return opts


def _state_after(arrs: TraceArrays, pol: str, cap: int, cut: int, opts: dict) -> tuple[frozenset, list, list]:
    """Drive ``pol``'s policy object over requests ``0..cut-1`` of ``arrs`` with the loop of
    ``quillcache.hitrate.reference.replay`` (the same harness options, from its ``build_policy``) and
    stop there: the blocks it then holds, the order it would evict them in, and its hits on the way."""
    from quillcache.hitrate.reference import build_policy

    cursor = [0, 0]
    p = build_policy(pol, cap, arrs, cursor, **opts)
    begin = getattr(p, "begin_request", None)
    off, blocks, isl = arrs.req_offsets.tolist(), arrs.blocks.tolist(), arrs.input_tokens.tolist()
    hits = []
    for r in range(cut):
        keys = blocks[off[r]:off[r + 1]]
        k = next((i for i, b in enumerate(keys) if b not in p), len(keys))
        hits.append(k)
        cursor[1] = r
        if begin is not None:
            begin(keys, k, isl[r])
        for j, b in enumerate(keys):
            cursor[0] = off[r] + j
            if b in p:
                p.touch(b)
            elif p.admit(b, 1):
                if len(p) >= cap:
                    p.evict(p.victim())
                p.insert(b, 1)
    return frozenset(p), p.eviction_order(), hits


def _decisions(arrs: TraceArrays, pol: str, cap: int, cut: int, opts: dict) -> tuple[tuple, tuple]:
    """``pol``'s (blocks held, eviction order) after request ``cut - 1``, replaying requests
    ``0..cut-1`` alone and replaying the whole trace. The prefix is re-densified by ``subset``,
    which keeps every id (ids are numbered by first appearance)."""
    head = arrs.subset(np.arange(cut))
    held, order, hits = _state_after(head, pol, cap, cut, opts)
    assert hits == replay(head, pol, cap, **opts).tolist(), (pol, opts)  # _state_after is replay's loop
    return (held, order), _state_after(arrs, pol, cap, cut, opts)[:2]


@given(arrs=conversation_traces(), cap=st.integers(1, 24), cut=st.integers(0, 40), data=st.data())
def test_online_policies_decide_without_the_future(arrs, cap, cut, data):
    """Decisions, not hits: every online policy object holds the same blocks (and would evict them in
    the same order) after the last request of a trace prefix whether it replays the prefix alone or
    the whole trace, with learning periods that end inside the prefix (``_learning_options``), so
    what is learnt at a period's end (densities, horizons, the rule in use) is checked too. Equal
    hits on the prefix would not do: Belady and lookahead have them as well (they use the future
    only to pick among blocks not referenced before the cut), but they fail this check, on the
    blocks held alone (``test_the_decision_check_catches_policies_that_see_the_future``). The
    kernels replay these objects hit for hit (``test_kernels_agree_with_online_reference``), which
    carries the guarantee to them; their hits on the prefix are checked here as well."""
    cut = min(cut, arrs.num_requests)
    head = arrs.subset(np.arange(cut))
    for pol in ONLINE:
        opts = _learning_options(data.draw, pol)
        alone, with_rest = _decisions(arrs, pol, cap, cut, opts)
        assert alone == with_rest, (pol, cut, opts)
        full = simulate(arrs, pol, cap, **opts).hits_per_request
        assert np.array_equal(simulate(head, pol, cap, **opts).hits_per_request, full[:cut]), (pol, cut, opts)


@pytest.mark.parametrize("pol, opts, hand_made", [
    ("belady", {}, [[1], [2], [3], [3], [2]]), ("belady", {"bypass": False}, [[1], [2], [3], [3], [2]]),
    ("lookahead", {}, [[1, 2], [3], [1, 2]]), ("lookahead", {"window_requests": 1}, [[1, 2], [3], [1, 2]])])
def test_the_decision_check_catches_policies_that_see_the_future(pol, opts, hand_made):
    """Positive control: the check of ``test_online_policies_decide_without_the_future`` fails for
    the two policies that see the future, on the blocks held alone, on traces of its own strategy
    (found by Hypothesis) and on a hand-made trace, cache 2, cut before its last request: the block
    dropped there is chosen by what the last request references."""
    from hypothesis import Phase, find

    alone, with_rest = _decisions(arrays_from_lists(hand_made), pol, 2, len(hand_made) - 1, opts)
    assert alone[0] != with_rest[0]

    def held_differ(x) -> bool:
        alone, with_rest = _decisions(x[0], pol, x[1], min(x[2], x[0].num_requests), opts)
        return alone[0] != with_rest[0]

    # the first trace found will do (no shrinking); none in 2,000: NoSuchExample, the check is blind
    find(st.tuples(conversation_traces(), st.integers(1, 24), st.integers(0, 40)), held_differ,
         settings=settings(database=None, max_examples=2000, deadline=None, phases=[Phase.generate]))


def test_quillchain_on_real_trace_prefixes_equals_the_full_run(real_arrays):
    """The acceptance check on the conversation trace: cuts drawn from a seeded RNG (seed in the
    message) at 1k and 10k blocks; the prefix replay sees none of the requests after the cut."""
    seed = 18
    cuts = np.random.default_rng(seed).integers(1, real_arrays.num_requests, 3)
    for cap in (1000, 10000):
        full = simulate(real_arrays, "quillchain", cap).hits_per_request
        for cut in cuts:
            head = real_arrays.subset(np.arange(int(cut)))
            assert np.array_equal(simulate(head, "quillchain", cap).hits_per_request, full[:cut]), (seed, cap, cut)


def test_quillchain_beats_lru_sieve_s3fifo_on_real_trace(real_arrays):
    for cap in (1000, 10000, 30000, 50000, 100000):
        ours = simulate(real_arrays, "quillchain", cap).hit_rate
        for base in ("lru", "sieve", "s3fifo"):
            assert ours > simulate(real_arrays, base, cap).hit_rate, (cap, base)


def test_lookahead_is_semi_online_and_uses_only_its_window():
    """Lookahead sees the queued requests (so it is not in the online list); a window of 0 sees
    only the request being served, and what lies past the window never changes its choice."""
    from quillcache.policies.lookahead import LookaheadPolicy

    assert SEMI_ONLINE == {"lookahead"} and "lookahead" not in ONLINE
    nu = {"a": 5, "b": 100, "c": 7}
    end = [6]
    p = LookaheadPolicy(next_use_oracle=lambda k: nu[k], window_end_oracle=lambda: end[0])
    for k in "abc":
        p.insert(k, 1)
    assert p.victim() == "b"  # a is referenced in the window; b and c are not: b is older
    end[0] = 1000
    assert p.victim() == "b"  # all in the window: the one referenced last
    nu["b"] = 6
    p.touch("b")
    assert p.victim() == "c"
    # past the window only the order of the window matters, not how far beyond a next use lies
    arrs = arrays_from_lists([[1, 2], [3, 4], [1, 5], [6], [3, 7], [2, 1]])
    w0 = simulate(arrs, "lookahead", 2, window_requests=0).hits_per_request
    assert np.array_equal(w0, replay(arrs, "lookahead", 2, window_requests=0))
    with pytest.raises(ValueError, match="window_requests=-1"):
        simulate(arrs, "lookahead", 2, window_requests=-1)


def test_kernel_and_online_class_use_the_same_constants():
    """The QuillHD kernel and its online class are twins: their shared constants cannot drift."""
    from quillcache.hitrate import kernels_quillhd as kernel
    from quillcache.policies import quillhd as online

    for name in ("HD_SUB", "NUM_BUCKETS", "CHAIN_CLASSES", "RATE_MIN_REFS", "RATE_SILENCE_GAPS",
                 "SECOND_CHANCE_TOKENS", "PERIOD_MIN_REFS"):
        assert getattr(kernel, name) == getattr(online, name), name
    for block_tokens in (1, 16, 512, 8192, 32768, 10**6):
        assert kernel.second_chance_max(block_tokens) == online.second_chance_max(block_tokens), block_tokens
    for period in (1, 511, 512, 2048, 65536):
        for capacity in (1, 300, 512, 1000, 4096, 10**6):
            assert kernel.learning_period(period, capacity) == online.learning_period(period, capacity)


def test_random_shapes_are_seeded_in_range_and_valid():
    from experiments import hitrate_study as study

    a = study.random_shape(np.random.default_rng(5))
    assert a == study.random_shape(np.random.default_rng(5)) and set(a) == set(study.RANDOM_SHAPE_SPACE)
    rng = np.random.default_rng(0)
    for _ in range(200):
        knobs = study.random_shape(rng)
        for name, (kind, *args) in study.RANDOM_SHAPE_SPACE.items():
            v = knobs[name]
            assert (v in args) if kind == "choice" else args[0] <= v <= args[1], (name, v)
    traces = study.random_shape_traces({**study.QUICK, "gen_sessions": 20})
    assert [t[0] for t in traces] == [f"random_{i:02d}" for i in range(study.QUICK["random_shapes"])]
    assert all(arrs.num_refs > 0 for _, _, arrs, _ in traces)


def test_a_mixed_trace_is_its_parts_interleaved_by_time_with_disjoint_blocks():
    from experiments import hitrate_study as study
    from quillcache.traces.sessions import SessionsConfig, generate

    parts, seed, sessions = ("gen_base", "classify"), 3, 60
    mixed = study.mixed_arrays(parts, seed, sessions)
    rates = [SessionsConfig(**study.mix_part(p)).session_rate_per_s for p in parts]
    alone = [generate(SessionsConfig(**{**study.mix_part(p), "seed": seed,
                                        "num_sessions": max(1, round(sessions * r / sum(rates)))}))
             for p, r in zip(parts, rates)]
    assert len(alone[1]) > len(alone[0])  # the faster part has more sessions: both span the same time
    assert (np.diff(mixed.timestamps_ms) >= 0).all()
    # every request of every part, in arrival order (ties: part order)
    flat = [(q.timestamp, i, q) for i, reqs in enumerate(alone) for q in reqs]
    expected = sorted(flat, key=lambda x: (x[0], x[1]))
    off, blocks = mixed.req_offsets, mixed.blocks
    got = [blocks[off[r]:off[r + 1]].tolist() for r in range(mixed.num_requests)]
    assert len(got) == len(expected)
    assert [len(q) for q in got] == [len(q.hash_ids) for _, _, q in expected]
    assert mixed.timestamps_ms.tolist() == [t for t, _, _ in expected]
    # a part's block ids map one-to-one onto its own (its reuse is unchanged); the parts share no block
    mapping: list[dict[int, int]] = [{}, {}]
    for ids, (_, i, q) in zip(got, expected):
        for h, o in zip(ids, q.hash_ids):
            assert mapping[i].setdefault(o, h) == h
    for m in mapping:
        assert len(set(m.values())) == len(m)
    assert mapping[0] and mapping[1] and not set(mapping[0].values()) & set(mapping[1].values())
    labels = [t[0] for t in study.mixed_traces({**study.QUICK, "gen_sessions": 10})]
    assert labels == [m for m in study.MIX_SHAPES for _ in study.QUICK["mix_seeds"]]
