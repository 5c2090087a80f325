"""Reviewed defects of the studies' measurement code and report sentences (fixes A).

1. store_bench_dram: ``get_into`` copied every block into one reused block-sized buffer (cache-resident)
   while the memcpy baseline streamed through a store-sized destination; it now writes the baseline's
   destination at the baseline's offsets.
2./3. recovery_bench: every cell is warmed up untimed, preparation (writing an index directory) is
   outside the timer, ``open_index('art')`` is compared with ``open_index('art')`` of a clean log, and
   sizes and damaged/clean are interleaved; ratios and time per MiB come from per-round samples, and
   the report says "flat" only when the per-round growth of time per MiB is.
4. storage_study: reopen and batched-lookup rows are medians of repetitions with n, p10 and p90;
   one-build rows keep n = 1 and do not call themselves medians.
5. rpc_choice: a failed warm-up kills the server child; a zmq call times out instead of hanging.
6. kvquant's thread sentence is generated from the rows; bench_alloc writes REFERENCE §6's figures as
   labelled anchors and the report shows them.

Nothing here asserts speed: fake clocks, call records and tiny parameters only.
"""

from __future__ import annotations

import gc
import math
import pickle
import random
import statistics
import subprocess
import threading
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from quillcache.results import read_anchors, spread, write_summary
from results_copy import copy_study

ROOT = Path(__file__).resolve().parents[1]


def _section(name: str, root: Path) -> str:
    from experiments import report

    text = report.render_report(str(root), root / "figures")
    return text[text.index(f'<a id="{name}"></a>'):]


# ------------------------------------------------------------------------------------- 1. store_dram


class _RecordingStore:
    """Stands in for LocalKvStore: records every call and the address and size get_into writes to."""

    def __init__(self, events: list):
        self.events = events
        self.into: list[tuple[int, int]] = []

    def put(self, k, data):
        self.events.append("put")

    def get(self, k, verify=False):
        self.events.append("get")

    def get_into(self, k, out):
        self.events.append("get_into")
        self.into.append((out.__array_interface__["data"][0], out.nbytes))

    def delete(self, k):
        self.events.append("delete")


def test_get_into_writes_the_memcpy_baselines_destination_at_its_offsets(monkeypatch):
    from experiments import store_bench_dram as sb
    from quillcache.store.keys import StoreKey

    size, slots = 4096, 8
    dst = np.zeros(size * slots, np.uint8)
    srcs = [np.full(size, i, np.uint8) for i in range(3)]
    keys = [StoreKey(i + 1, b"\x01" * 16) for i in range(slots)]  # as run(): one store's worth per round
    n_blocks = 2 * slots + 3  # three rounds, the last one partial
    events: list = []
    clock = iter(range(1000))
    monkeypatch.setattr(sb.time, "perf_counter", lambda: events.append("clock") or float(next(clock)))
    store = _RecordingStore(events)
    sb._store_cell(store, keys, srcs, n_blocks, dst, False)
    base = dst.__array_interface__["data"][0]
    # block i lands where _memcpy_cell puts block i: (i % slots) * size into the store-sized buffer
    assert store.into == [(base + (i % slots) * size, size) for i in range(n_blocks)]
    # the timer encloses each loop exactly: clock, puts, clock, gets, clock, get_intos, clock, deletes
    for m in (slots, slots, 3):
        head = events[:4 * m + 4]
        del events[:4 * m + 4]
        assert head == ["clock"] + ["put"] * m + ["clock"] + ["get"] * m + ["clock"] + ["get_into"] * m + \
            ["clock"] + ["delete"] * m
    assert events == []


def test_get_into_and_memcpy_leave_the_same_bytes_in_the_destination():
    from experiments import store_bench_dram as sb
    from quillcache.store.dram import LocalKvStore
    from quillcache.store.keys import StoreKey

    size, slots = 4096, 4
    srcs = [np.full(size, i + 1, np.uint8) for i in range(3)]
    n_blocks = slots + 2  # wraps
    a, b = np.zeros(size * slots, np.uint8), np.zeros(size * slots, np.uint8)
    sb._memcpy_cell(a, srcs, n_blocks)
    store = LocalKvStore(size * slots, segment_bytes=size * slots, alignment_bytes=4096)
    try:
        sb._store_cell(store, [StoreKey(i + 1, b"\x01" * 16) for i in range(slots)], srcs, n_blocks, b, False)
    finally:
        store.close()
    assert np.array_equal(a, b) and a.any()


# ------------------------------------------------------------------------------------- 2./3. recovery


def test_time_interleaved_warms_up_and_times_exactly_the_run():
    from experiments.recovery_bench import Cell, time_interleaved

    now = [0.0]
    log: list = []

    def cell(key):
        def prepare():
            log.append(("prepare", key))
            now[0] += 100.0  # a costly preparation: it must not reach a sample
            return key

        def run(arg):
            assert arg == key
            log.append(("run", key))
            now[0] += 1.0

            def after():
                log.append(("after", key))
                now[0] += 1000.0  # e.g. closing an index: after the timer
            return after

        return Cell(key, run, prepare)

    pairs = [(cell("d1"), cell("c1")), (cell("d2"), cell("c2"))]
    reps = 4
    samples = time_interleaved(pairs, reps, clock=lambda: now[0])
    assert {k: len(v) for k, v in samples.items()} == {"d1": reps, "c1": reps, "d2": reps, "c2": reps}
    assert all(s == 1.0 for v in samples.values() for s in v)  # the timer encloses run() only
    runs = [k for what, k in log if what == "run"]
    assert runs[:4] == ["d1", "c1", "d2", "c2"]  # one warm-up call of every cell, not counted
    # then every round visits every size, damaged and clean back to back, alternating which goes first
    assert runs[4:] == ["d1", "c1", "d2", "c2", "c1", "d1", "c2", "d2"] * (reps // 2)
    # each call: prepared just before, closed just after
    assert log == [(w, k) for k in runs for w in ("prepare", "run", "after")]


def test_open_index_art_is_compared_with_open_index_art_of_a_clean_log_and_prepared_outside_the_timer(tmp_path):
    from experiments import recovery_bench as rb

    pairs, info = rb._pairs(dict(records=(20,), mib=(1,)), random.Random(1), tmp_path)
    by = {c.key: c for pair in pairs for c in pair}
    fake, clean = by[("wal_fake_headers", "open_index('art'), fake headers", 1)], \
        by[("wal_fake_headers", "open_index('art'), clean log", 1)]
    assert (fake, clean) in pairs  # timed back to back, in one pair
    for c in (fake, clean):
        d = c.prepare()  # writes the log into a fresh directory (untimed)
        assert sorted(p.name for p in d.iterdir()) == ["art.wal"]
        closer = c.run(d)
        assert (closer is None) == (c is fake)  # the damaged log is refused; the clean one is replayed
        if closer is not None:
            closer()
    assert abs(info[clean.key][3] - (1 << 20)) < 64 << 10 and info[fake.key][3] == 1 << 20  # same size


def test_recovery_rows_use_per_round_ratios_and_interleaved_samples():
    from experiments import recovery_bench as rb

    info, samples = {}, {}
    for n, bytes_ in ((100, 2**20), (400, 4 * 2**20)):
        for subject in ("salvage scan, damaged", "salvage scan, clean log"):
            key = ("ssd_log_flip_every_second", subject, n)
            info[key] = (*key, bytes_, "")
    # per round the damaged scan takes 3x, 1x and 5x the clean one: the ratio is the median of those (3),
    # not the ratio of the medians (3 / 2)
    samples[("ssd_log_flip_every_second", "salvage scan, damaged", 100)] = [3.0, 2.0, 10.0]
    samples[("ssd_log_flip_every_second", "salvage scan, clean log", 100)] = [1.0, 2.0, 2.0]
    # the 4x larger log takes 4x the time in every round: time per MiB flat, growth 1 per round
    samples[("ssd_log_flip_every_second", "salvage scan, damaged", 400)] = [12.0, 8.0, 40.0]
    samples[("ssd_log_flip_every_second", "salvage scan, clean log", 400)] = [4.0, 8.0, 8.0]
    rows = rb._rows(samples, info, 3)
    assert all(r.n == 3 for r in rows)
    ratio = [r for r in rows if r.metric == "damaged_over_clean" and r.params["records"] == 100][0]
    assert (ratio.value, ratio.p10, ratio.p90) == (3.0, 1.0, 5.0)
    growth = {r.subject: r for r in rows if r.metric == "per_mib_growth"}
    assert (growth["salvage scan, damaged"].value, growth["salvage scan, damaged"].p90) == (1.0, 1.0)
    assert growth["salvage scan, damaged"].params["size_ratio"] == 4
    scan = [r for r in rows if r.metric == "scan_s" and r.params["records"] == 400][0]
    assert scan.baseline == "salvage scan, clean log" and scan.baseline_value == 8.0


@pytest.fixture(scope="module")
def recovery_quick(tmp_path_factory):
    from experiments import recovery_bench as rb

    root = tmp_path_factory.mktemp("recovery")
    mp = pytest.MonkeyPatch()
    mp.setattr(rb, "QUICK", dict(reps=2, records=(20, 40), mib=(1, 2)))
    try:
        rows = rb.run(quick=True, results_root=str(root))
    finally:
        mp.undo()
    return root, rows


def test_recovery_quick_rows_and_the_report_section_follow_the_data(recovery_quick, tmp_path):
    root, rows = recovery_quick
    by = {(r.metric, r.subject, r.params["file_bytes"]): r for r in rows}
    art = [r for r in rows if r.metric == "scan_s" and r.subject.startswith("open_index")]
    assert art and all(r.baseline == "open_index('art'), clean log" and r.n == 2 for r in art)
    for r in rows:
        assert r.n == 2 and r.p10 <= r.value <= r.p90, r
    assert ("per_mib_growth", "wal.scan, fake headers", 2 << 20) in by
    text = _section("recovery", root)
    assert "open_index('art')" in text
    # the verdict follows per_mib_growth: force "rises" and "flat" and read the sentence back
    for value, word, absent in ((3.0, "rises with size", "time per MiB flat"), (1.0, "time per MiB flat", "rises")):
        forced = [replace(r, value=value, p10=value, p90=value) if r.metric == "per_mib_growth" else r for r in rows]
        write_summary("recovery", forced, root=tmp_path / str(value), profile="quick")
        text = _section("recovery", tmp_path / str(value))
        assert word in text and absent not in text


# ------------------------------------------------------------------------------------- 4. storage


def _cell(kind: str, recovery: list[float], batch: list[float]) -> dict:
    return {"kind": kind, "entries": 100, "ops": 150, "entries_target": 100, "point_p50_ns": 1000.0,
            "point_p99_ns": 2000.0, "point_n": 40, "locate_obj_p50_ns": 1500.0, "locate_obj_p99_ns": 2500.0,
            "scan_p50_ns": 3000.0, "scan_p99_ns": 4000.0, "scan_n": 10, "scan_mean_rows": 2.0,
            "scan_prefix_hash_bytes": 1, "insert_ops_per_s": 1e5, "wa_build": 2.0, "wa_total": 3.0, "close_s": 0.01,
            "rss_growth_bytes": 1 << 20, "rocksdb_stat_bytes": 10.0, "logical_bytes": 5, "rocksdb_stats": {},
            "recovery_s": statistics.median(recovery), "recovery_s_samples": recovery,
            "recovery_eager_s": statistics.median(recovery) if kind == "art" else math.nan,
            "recovery_eager_s_samples": recovery if kind == "art" else [],
            "batch_locate_ns_per_hash": statistics.median(batch), "batch_locate_ns_samples": batch}


def test_storage_summary_rows_of_repeated_measurements_carry_n_and_spread():
    from experiments.storage_study import _summary

    rec, batch = [0.5, 0.1, 0.3, 0.2, 0.4], [10.0, 12.0, 11.0, 30.0, 9.0, 10.5]
    rows = _summary([_cell("art", rec, batch), _cell("rocksdb", [1.0, 2.0, 3.0], [20.0] * 5)])
    by = {(r.metric, r.subject, r.baseline): r for r in rows}
    for metric, samples in (("recovery_reopen_to_first_answer", rec), ("recovery_reopen_eager_verify", rec),
                            ("batch_locate", batch)):
        r = by[(metric, "art", "rocksdb")]
        sp = spread(samples)
        assert (r.n, r.value, r.p10, r.p90) == (len(samples), sp["median"], sp["p10"], sp["p90"]), metric
        assert "median of" in r.notes
    assert by[("recovery_reopen_to_first_answer", "rocksdb", "")].n == 3
    for metric in ("insert_rate", "write_amplification_build", "write_amplification_total", "close", "rss_growth"):
        r = by[(metric, "art", "rocksdb")]
        assert r.n == 1 and math.isnan(r.p10) and "median" not in r.notes and "one build" in r.notes, metric


def test_run_cell_repeats_batch_locate_and_returns_every_reopen(tmp_path):
    from experiments import storage_study
    from quillcache.index import ResidencyEntry
    from quillcache.types import CacheTier

    rng = random.Random(5)
    live = {}
    for i in range(300):
        e = ResidencyEntry(rng.getrandbits(64), f"n{i % 3}", CacheTier.DRAM, rng.randbytes(16), 0, i * 4096, 4096)
        live[e.key] = e
    entries = list(live.values())
    w = types.SimpleNamespace(live=live, num_puts=len(entries), num_removes=0,
                              batches=[types.SimpleNamespace(puts=entries[i:i + 50], removes=[])
                                       for i in range(0, len(entries), 50)])
    path = tmp_path / "w.pkl"
    path.write_bytes(pickle.dumps(w))
    try:
        cell = storage_study.run_cell("art", str(path), str(tmp_path / "db"), 20, 5, 0)
    finally:
        gc.unfreeze()
    assert storage_study.BATCH_LOCATE_REPS >= 5
    assert len(cell["batch_locate_ns_samples"]) == storage_study.BATCH_LOCATE_REPS
    assert len(cell["recovery_s_samples"]) == 5 and len(cell["recovery_eager_s_samples"]) == 5
    assert cell["recovery_s"] == statistics.median(cell["recovery_s_samples"])


# ------------------------------------------------------------------------------------- 5. rpc_choice


def test_a_failed_warm_up_kills_the_server_child(monkeypatch):
    from experiments import rpc_choice as rc

    monkeypatch.chdir(ROOT)
    spawned = []
    real = subprocess.Popen

    def recording(*a, **kw):
        p = real(*a, **kw)
        spawned.append(p)
        return p

    monkeypatch.setattr(rc.subprocess, "Popen", recording)
    monkeypatch.setattr(rc, "VALUE_BYTES", 99)  # the child serves 100-byte values: the warm-up check fails
    try:
        with pytest.raises(AssertionError):
            rc.measure(["zmq"])
    finally:
        alive = [p for p in spawned if p.poll() is None]
        for p in alive:  # never leave one behind, whatever happened
            p.kill()
            p.wait()
    assert len(spawned) == 1 and not alive


def test_a_zmq_call_to_a_silent_server_times_out_instead_of_hanging(monkeypatch):
    import zmq

    from experiments import rpc_choice as rc

    monkeypatch.setattr(rc, "CALL_TIMEOUT_S", 0.2)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = rc._ZmqClient(port)
    outcome: list = []

    def call():
        try:
            outcome.append(client.call("get", "k"))
        except BaseException as exc:  # noqa: BLE001 - what the call raised is the result
            outcome.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(timeout=10)
    hung = t.is_alive()
    if hung:  # unblock the call (the request is there to answer) before failing
        import msgpack

        if router.poll(5000):
            ident, body = router.recv_multipart()
            _v, rid, *_ = msgpack.unpackb(body)
            router.send_multipart([ident, msgpack.packb([1, rid, True, b"x"])])
        t.join(timeout=10)
    client.close()
    router.close()
    ctx.term()
    assert not hung, "the call blocked past its timeout"
    assert isinstance(outcome[0], TimeoutError) and "no reply within" in str(outcome[0])


def test_readme_does_not_claim_a_measured_choice_over_grpcio():
    readme = (ROOT / "README.md").read_text()
    assert "chosen over grpcio by measurement" not in readme
    assert "experiments/rpc_choice.py" in readme and "not kept in `results/`" in readme


# ------------------------------------------------------------------------------------- 6. kvquant, alloc


def test_kvquant_thread_sentence_follows_the_rows(tmp_path):
    src = ROOT / "results" / "kvquant"
    if not (src / "summary.csv").is_file():
        pytest.skip("no committed kvquant results")
    copy_study(src, tmp_path / "kvquant")
    text = _section("kvquant", tmp_path)
    assert "another study ran beside them" not in text
    df = pd.read_csv(src / "summary.csv", keep_default_na=False, dtype=str)
    multi = df[(df.metric == "throughput") & (df.threads != "") & (df.threads != "1")]
    if multi.empty:
        pytest.skip("the committed run has no multi-thread rows")
    for _, r in multi.iterrows():
        one = df[(df.metric == "throughput") & (df.subject == r.subject) & (df.bytes_counted == r.bytes_counted)
                 & (df.threads == "1")].iloc[0]
        word = "faster" if float(r.value) > float(one.value) else "slower"
        assert f"{r.subject} ran at" in text and word in text
    # make every multi-thread row 100x the one-thread one: the sentence now says faster
    fast = df.copy()
    for col in ("value", "p10", "p90"):
        fast.loc[multi.index, col] = "1000.0"
    fast.to_csv(tmp_path / "kvquant" / "summary.csv", index=False)
    text = _section("kvquant", tmp_path)
    assert "with one thread (faster)" in text and "with one thread (slower)" not in text


def test_bench_alloc_writes_reference_6_as_labelled_anchors_and_the_report_shows_them(monkeypatch, tmp_path):
    from experiments.microbench import bench_alloc as ba

    monkeypatch.setattr(ba, "QUICK", dict(reps=1, fast_pairs=1000, ref_pairs=200, warmup_pairs=100, fast_calls=100,
                                         ref_calls=50))
    ba.run(quick=True, results_root=str(tmp_path))
    anchors = read_anchors("microbench_alloc", tmp_path)
    got = {(r.metric, r.range_end): (r.value, r.unit) for r in anchors.itertuples()}
    assert got == {("churn_pair_ns", "low"): (80.0, "ns"), ("churn_pair_ns", "high"): (88.0, "ns"),
                   ("burst_ns", "low"): (15.0, "ns"), ("burst_ns", "high"): (17.0, "ns")}
    assert all("REFERENCE §6" in s for s in anchors["source"])
    text = _section("microbench_alloc", tmp_path)
    assert "80–88 ns" in text and "15–17 ns" in text and "not a same-run baseline" in text
    reference = ROOT.parent / "shared" / "REFERENCE.md"
    if reference.is_file():  # the quoted row is REFERENCE §6's, word for word
        assert ba.REFERENCE_6_ROW in reference.read_text()
