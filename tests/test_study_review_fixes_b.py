"""Regression tests for reviewed defects of the transfer and master studies and the master report section.

Fast and unit-level: the study functions are called on synthetic inputs (fake runners, fake child processes), the
report section is rendered from a synthetic copy of results/master under a tmp dir. No study runs whole; the one
test that needs Mooncake's prepared venv skips where it is not prepared.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from experiments import master_study as ms
from experiments import transfer_mooncake as tm
from experiments import transfer_study as ts
from results_copy import copy_study

ROOT = Path(__file__).resolve().parents[1]


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


# ------------------------------------------------------------------ transfer study: latency units, equal work

def _cell(mk_lat: list[float], unit: str, batch: int) -> dict:
    raw_lat = [k * 10e-6 for _ in range(50) for k in range(1, batch + 1)]  # per request, 10 us apart in a batch
    return {ts.RAW: {"gbps": [1.0] * 3, "lat": raw_lat, "cpu": [1.0] * 3},
            ts.OURS: {"gbps": [1.0] * 3, "lat": raw_lat, "cpu": [1.0] * 3},
            ts.MOONCAKE: {"gbps": [1.0] * 3, "lat": mk_lat, "cpu": [1.0] * 3, "unit": unit}}


def _latency_rows(res: dict, batch: int) -> dict:
    return {(r.subject, r.metric): r for r in ts._cell_rows("cross_core", "read", 65536, batch, 3, 1, res)
            if r.metric.startswith("latency")}


def test_mooncake_batch_latency_is_compared_with_the_raw_pairs_batch_calls():
    batch = 16
    rows = _latency_rows(_cell([160e-6] * 50, "batch", batch), batch)  # as fast as the raw pair's batches
    for q in ("latency_p50", "latency_p99"):
        mk = rows[(ts.MOONCAKE, q)]
        assert mk.baseline == ts.RAW
        assert mk.baseline_value == pytest.approx(160.0) and mk.ratio == pytest.approx(1.0)
        assert "per batch" in mk.notes and "start to last completion" in mk.notes
    ours = rows[(ts.OURS, "latency_p50")]  # per request: still the raw pair's per-request percentile
    assert ours.baseline_value == pytest.approx(85.0) and ours.ratio == pytest.approx(1.0)


def test_batch_latency_without_matching_raw_samples_has_no_baseline():
    res = _cell([160e-6] * 50, "batch", 16)
    res[ts.RAW]["lat"] = res[ts.RAW]["lat"][:-1]  # not whole calls of 16: no per-batch time to compare with
    mk = _latency_rows(res, 16)[(ts.MOONCAKE, "latency_p50")]
    assert not mk.baseline and pd.isna(mk.baseline_value)
    assert ts._batch_times([1.0, 3.0, 2.0, 5.0, 4.0, 6.0], 3) == [3.0, 6.0]


def test_the_study_asks_mooncake_for_the_same_calls_as_the_other_subjects(monkeypatch):
    got = {}
    monkeypatch.setattr(tm, "prepare", lambda workdir: tm.MooncakeAvailability(True, "ok", "test"))
    monkeypatch.setattr(tm, "run_mooncake", lambda **kw: got.update(kw) or {"reason": "stub"})
    for size, batch in ((32 << 20, 16), (32 << 20, 128), (2 << 20, 128), (64 << 10, 1)):
        ts._mooncake(ts.FULL, size, batch, "read", next(iter(ts.PLACEMENTS)))
        assert got["calls_per_repeat"] == ts._calls(size, batch, ts.FULL)


def _prepared_mooncake() -> Path:
    workdir = tm.default_workdir()
    problem = tm._stamp_problem(workdir, tm.read_stamp(workdir))
    if problem:
        pytest.skip(f"Mooncake not prepared: {problem}")
    return workdir


def test_mooncake_makes_the_calls_asked_and_is_timed_by_its_whole_loop():
    workdir = _prepared_mooncake()
    r = tm.run_mooncake(block_bytes=64 << 10, batch=2, op="read", repeats=1, workdir=workdir, timeout_s=120,
                        calls_per_repeat=3)
    assert r["reason"] is None, r["reason"]
    assert r["calls_per_repeat"] == 3 and len(r["latency_s"]) == 3 and r["bytes_per_repeat"] == 3 * 2 * (64 << 10)
    assert r["seconds"][0] > sum(r["latency_s"])  # the loop's wall time (gaps between calls included), not the sum
    assert r["gbps"][0] == pytest.approx(r["bytes_per_repeat"] / r["seconds"][0] / 1e9)
    with pytest.raises(ValueError, match="calls_per_repeat"):
        tm.run_mooncake(block_bytes=1, batch=1, op="read", repeats=1, workdir=workdir, calls_per_repeat=0)


# ------------------------------------------------------------------ transfer_raw: RawPeer's start deadline

def test_raw_peer_that_never_prints_its_port_is_killed_at_the_deadline(tmp_path, monkeypatch):
    silent = _script(tmp_path / "silent-python", "exec sleep 6")
    from experiments import transfer_raw as tr

    monkeypatch.setattr(tr.sys, "executable", str(silent))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"raw peer \(pid (\d+)\): no reply to 'startup' before the deadline") as ei:
        tr.RawPeer(1 << 20, timeout_s=0.3)
    assert time.monotonic() - t0 < 3.0
    pid = int(ei.value.args[0].split("pid ")[1].split(")")[0])
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped


def test_raw_peer_starts_and_serves():
    from experiments import transfer_raw as tr

    with tr.RawPeer(1 << 20, timeout_s=60) as peer:
        client = tr.RawClient(peer.port)
        try:
            assert len(client.batch(tr.READ, memoryview(bytearray(1 << 20)), [0, 4096], 4096)) == 2
        finally:
            client.close()


# ------------------------------------------------------------------ master_mooncake: a failed start leaks nothing

def test_a_failed_mooncake_start_stops_the_master_it_spawned(tmp_path, monkeypatch):
    from experiments import master_mooncake as mm

    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    _script(venv_bin / "python", "exit 1")
    _script(venv_bin / "mooncake_master", "exec sleep 30")  # never listens
    for d in ("site", "cudart", "lib"):
        (tmp_path / d).mkdir()
    (tmp_path / "lib" / "libcuda.so.1").write_bytes(b"")
    stamp = {"format": tm.STAMP_FORMAT, "venv_python": str(venv_bin / "python"), "site_packages": str(tmp_path / "site"),
             "cudart_dir": str(tmp_path / "cudart"), "libcuda_stub": str(tmp_path / "lib" / "libcuda.so.1")}
    (tmp_path / tm.STAMP_NAME).write_text(__import__("json").dumps(stamp))
    spawned = []
    real = subprocess.Popen

    def popen(*a, **kw):
        p = real(*a, **kw)
        spawned.append(p)
        return p

    monkeypatch.setattr(mm.subprocess, "Popen", popen)
    run = mm.MooncakeMasterRun(segment_bytes=1 << 20, workdir=tmp_path, timeout_s=0.5)
    try:
        with pytest.raises(mm.MooncakeError, match="did not listen"):
            run.start()
        assert spawned and all(p.poll() is not None for p in spawned)
    finally:
        for p in spawned:
            if p.poll() is None:
                p.kill()
                p.wait()


# ------------------------------------------------------------------ master study: log-tail child, restart count

def test_a_failing_log_tail_child_reports_its_error(tmp_path):
    bad = tmp_path / "a-file"
    bad.write_text("x")
    with pytest.raises(RuntimeError, match=r"log-tail child failed .*: FileExistsError"):
        ms._sigkill_with_tail(str(bad), 10)


def test_a_log_tail_child_that_exits_without_a_line_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(ms, "_tail_then_wait", lambda data_dir, n, wfd: os._exit(3))
    with pytest.raises(RuntimeError, match="exited without a report"):
        ms._sigkill_with_tail(str(tmp_path / "d"), 10)


def test_a_restarted_server_process_is_asked_its_object_count(tmp_path, monkeypatch):
    real = ms.ServerProcess
    (tmp_path / "empty").mkdir()

    def on_an_empty_dir(d, log_path=None, **kw):  # a server that recovered the wrong state
        return real(tmp_path / "empty", log_path=log_path, **kw)

    monkeypatch.setattr(ms, "ServerProcess", on_an_empty_dir)
    cfg = dict(ms.QUICK, restart_objects=(2000,), restart_reps=1, tail_objects=2000, largest_tail_cap=2000)
    raw: list = []
    with pytest.raises(AssertionError, match=r"\(clean\) as a server process serves 0 objects, not 2000"):
        ms._restart_study(cfg, tmp_path, True, raw)
    assert not [r for r in raw if r[1] == "process"]


# ------------------------------------------------------------------ master study: one interleaved group

class _FakeRunner:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def run(self, op, batch, keys, api="objects"):
        self.log.append(self.name)
        return 1e-3, 0

    def close(self) -> None:
        pass


def _fake_study(monkeypatch, log: list, *, remote_fails=False, mooncake_start=None, mooncake_fail_after=None):
    class FakeMooncake(_FakeRunner):
        apis = (ms.MOONCAKE_API,)

        def __init__(self) -> None:
            if mooncake_start is not None:
                raise mooncake_start
            super().__init__(ms.MOONCAKE, log)
            log.append("mooncake started")
            self.calls = 0

        def run(self, op, batch, keys, api=None):
            self.calls += 1
            if mooncake_fail_after is not None and self.calls > mooncake_fail_after:
                raise RuntimeError("client peer died")
            log.append(self.name)
            return {"seconds": 1e-3, "bad": 0, "calls": 1, "rpcs": 1}

    class FakeRemote(_FakeRunner):
        def __init__(self, work, stream=True, server=None):
            if remote_fails:
                raise RuntimeError("master server gave no ready line (exited)")
            super().__init__(ms.RPC if stream else ms.RPC_ZMQ, log)
            self.server = object()

    monkeypatch.setattr(ms, "_Embedded", lambda d: _FakeRunner(ms.EMB_MEM if d is None else ms.EMB_LOG, log))
    monkeypatch.setattr(ms, "_Remote", FakeRemote)
    monkeypatch.setattr(ms, "_Mooncake", FakeMooncake)
    monkeypatch.setattr(ms, "_mooncake_restart", lambda r: ms.SummaryRow(
        metric="objects_after_restart", subject=ms.MOONCAKE, value=0, unit="count"))


CFG = dict(reps=3, single_calls=20, put_single_calls=20, batch_calls=1)
MK = (True, "mooncake-transfer-engine test: mooncake_master + MooncakeDistributedStore", "test")


def _row(rows, metric):
    (r,) = [r for r in rows if r.metric == metric]
    return r


def test_embedded_subjects_run_interleaved_with_mooncake(tmp_path, monkeypatch):
    log: list = []
    _fake_study(monkeypatch, log)
    raw: list = []
    rows, status = ms._ops_study(CFG, tmp_path, (True, "server ok"), MK, raw)
    assert status == {}
    assert log.index("mooncake started") < log.index(ms.EMB_LOG)  # started before anything was measured
    reps = [r[5] for r in raw if r[0] == "ops"]
    assert reps == sorted(reps)  # every subject's repetition 0, then every subject's 1, ...: one group
    for rep in range(CFG["reps"]):
        for op in ms.OPS:
            ran = {r[1] for r in raw if r[0] == "ops" and r[5] == rep and r[2] == op and r[3] == ms.BATCH}
            assert ran == {ms.EMB_LOG, ms.EMB_MEM, ms.RPC, ms.RPC_ZMQ, ms.MOONCAKE}
    ops = [r for r in rows if r.metric == "ops_per_s"]
    assert all(r.params["interleaved"] for r in ops)
    assert all(r.baseline == ms.MOONCAKE for r in ops if r.subject != ms.MOONCAKE)
    assert {r.subject for r in rows if r.metric == "accept_batched_vs_mooncake"} == set(ms.ACCEPT_SUBJECTS)


def test_mooncake_is_measured_when_the_rpc_server_cannot_start(tmp_path, monkeypatch):
    log: list = []
    _fake_study(monkeypatch, log, remote_fails=True)
    rows, status = ms._ops_study(CFG, tmp_path, (True, "server ok"), MK, [])
    assert _row(rows, "mooncake_available").value == 1.0
    rpc = _row(rows, "rpc_available")
    assert rpc.value == 0.0 and rpc.notes == ("not measured: could not start: RuntimeError: master server gave no "
                                              "ready line (exited)")
    assert any(r.subject == ms.EMB_LOG and r.baseline == ms.MOONCAKE for r in rows if r.metric == "ops_per_s")


def test_mooncake_not_measured_says_its_own_reason(tmp_path, monkeypatch):
    _fake_study(monkeypatch, [], mooncake_start=RuntimeError("mooncake_master did not listen"))
    rows, _ = ms._ops_study(CFG, tmp_path, (True, "server ok"), MK, [])
    assert _row(rows, "mooncake_available").notes == ("not measured: could not start: RuntimeError: mooncake_master "
                                                      "did not listen")
    assert _row(rows, "rpc_available").value == 1.0

    _fake_study(monkeypatch, [], mooncake_fail_after=20)
    rows, status = ms._ops_study(CFG, tmp_path, (True, "server ok"), MK, [])
    mk = _row(rows, "mooncake_available")
    assert mk.value == 0.0 and mk.notes == "not measured: failed while measuring: RuntimeError: client peer died"
    ops = [r for r in rows if r.metric == "ops_per_s"]
    assert {r.subject for r in ops} == {ms.EMB_LOG, ms.EMB_MEM, ms.RPC, ms.RPC_ZMQ}  # the others went on
    assert not any(r.baseline for r in ops)


# ------------------------------------------------------------------ master report section from synthetic results

def _render(tmp_path: Path, edit) -> str:
    from experiments import report

    copy_study(ROOT / "results" / "master", tmp_path / "master")
    path = tmp_path / "master" / "summary.csv"
    df = pd.read_csv(path)
    edit(df)
    df.to_csv(path, index=False)
    env = report._environment()
    return " ".join(str(env.get_template("sections/master.md.j2").module.section(
        report.StudyView("master", str(tmp_path)))).split())


def _restart_values(clean: float, sigkill: float):
    def edit(df):
        big = (df.metric == "restart_s") & (df.objects >= 1_000_000)
        df.loc[big & (df.state == "clean"), "value"] = clean
        df.loc[big & (df.state != "clean"), "value"] = sigkill
    return edit


def test_restart_sentences_say_apart_clean_and_sigkill_misses(tmp_path):
    text = _render(tmp_path, _restart_values(clean=1.25, sigkill=3.5))
    miss = text.split("the issue's restart bound is missed after a SIGKILL with a long log tail: ")[1].split(". ")[0]
    assert ", 0 objects of log tail" not in miss and miss.count("3.5 s") == 4
    assert "missed after a clean shutdown" not in text
    assert "a clean restart of the same state takes 1.25 s in-process" in text
    assert "holding at 1M objects" not in text
    assert ("miss the issue's restart bound at 1M objects: sigkill in-process, sigkill process, sigkill_largest_tail "
            "in-process, sigkill_largest_tail process)") in text


def test_restart_sentences_when_only_clean_restarts_miss(tmp_path):
    text = _render(tmp_path, _restart_values(clean=2.75, sigkill=1.5))
    assert "after a SIGKILL" not in text.split("What does not hold")[1]
    assert ("With 1,000,000 objects, the issue's restart bound is missed after a clean shutdown, with no log tail "
            "to replay: 2.75 s (in-process); 2.75 s (process).") in text
    assert "miss the issue's restart bound at 1M objects: clean in-process, clean process)" in text


def test_restart_bound_holding_is_claimed_only_when_it_holds(tmp_path):
    text = _render(tmp_path, _restart_values(clean=1.5, sigkill=1.75))
    assert "the restart rows above show the issue's restart bound holding at 1M objects" in text
    assert "restart bound is missed" not in text


@pytest.mark.parametrize("factor, verdict", [(10, "misses"), (1.2, "within")])
def test_failover_verdict_follows_the_measured_times(tmp_path, factor, verdict):
    def edit(df):
        m = df.metric == "failover_s"
        df.loc[m, "value"] = df.loc[m, "ttl_s"] * factor
    text = _render(tmp_path, edit)
    if verdict == "misses":
        assert "Failover misses the issue's bound of twice the lease TTL: 20 s (median) at a TTL of 2 s" in text
        assert "within the issue's bound" not in text
    else:
        assert "a little over one lease TTL" in text and "within the issue's bound of twice the TTL" in text
        assert "Failover misses" not in text


def test_setup_says_how_the_embedded_subjects_compare_with_mooncake(tmp_path):
    def apart(df):  # results without the interleaved column (runs before it existed): measured apart
        if "interleaved" in df.columns:
            df.drop(columns=["interleaved"], inplace=True)
    old = _render(tmp_path / "old", apart)
    assert "the embedded subjects ran before Mooncake's master started" in old
    assert "Every subject runs interleaved" not in old

    def interleaved(df):
        df["interleaved"] = pd.Series([True if m == "ops_per_s" else None for m in df.metric], dtype=object)
    new = _render(tmp_path / "new", interleaved)
    assert "Every subject runs interleaved with the others cell by cell" in new
    assert "the embedded subjects ran before" not in new
