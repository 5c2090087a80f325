"""Master study: metadata throughput against Mooncake's master, restart time, SIGKILLs and failover (issue 14 item 5).

Everything in one run on this machine:

1. **Restart time** at 10k, 100k and 1M objects (the quick profile leaves out 1M): a data dir is filled
   through ``MasterService`` (8 segments on 8 nodes, one replica of ``SIZE_BYTES`` per object, batches of
   2,000) and closed cleanly (which snapshots). Then, each in a fresh forked process: the time of
   ``MasterService(data_dir=D)`` (load the snapshot, replay the log, rebuild allocators and the residency
   index) until it returns, serving, with every object back (checked). **clean**: after the clean close.
   **sigkill**: after a child that wrote a log tail of ``tail_objects`` more objects (two records each,
   below the default snapshot interval, so it is all replayed) was SIGKILLed. When the master server
   process exists (``python -m quillcache.master``), the same two states are also timed from process start
   to its ready line (``server process``: interpreter start and imports included); then, untimed, the server
   is asked for its object count (``MasterClient.stats``), which must be every object (raw_restart.csv's
   ``objects_found`` is that answer).
2. **SIGKILL study**: ``kills`` SIGKILLs of a master process (forked from this one, so its start costs no
   interpreter) at seeded random points of a put/get/remove workload (the one of
   ``tests/master_kill_child.py``: batches of 1-8 puts with 1-3 replicas on 3 nodes, one put in five left
   in flight, one batch in ten followed by a forced remove; a snapshot every 50 records so kills land in
   snapshots, log rotations and appends alike). The child appends one line per acknowledged ``put_end``
   to a file with ``os.write`` (visible after the kill). After each kill a fresh process recovers the data
   dir and checks: every acknowledged object (not removed since) COMPLETE with the same replicas
   (``lost``), no PENDING object readable or in the residency index, no put left in flight COMPLETE.
3. **Metadata operations per second**, single-key (batch 1) and batched (batch 1,000): ``put`` =
   put_start + put_end of one new object (single-key: two calls), ``get_replicas`` (grants a read lease)
   and ``exists`` (no lease) of objects put before. Subjects: ``quillcache embedded (log)`` (a
   ``MasterService`` with a data dir in this process: every state-changing call returns after its fsync),
   ``quillcache embedded (no log)`` (no data dir: nothing is durable, like Mooncake's master without its
   operation log), ``quillcache rpc`` (the master server process with a data dir, ``MasterClient`` over TCP
   loopback on the server's plain-TCP transport, ``qtcp://``, the client's default), ``quillcache rpc (zmq)``
   (the same server and client on its ZeroMQ transport) and ``Mooncake master``; all five run interleaved in
   one group, cell by cell, their order alternating between repetitions, so every comparison with the baseline
   and between transports sees the same moments of the machine (param ``interleaved``; a subject that cannot
   start or fails is left out with its reason, the others go on) (``Mooncake master``: ``mooncake_master`` from the PyPI
   wheel and its Python client in another process, metadata calls only: ``experiments.master_mooncake``;
   every call is one master RPC, counted from its metrics)). One segment on one node (``QC_SEGMENT_BYTES`` for
   ours, metadata only; ``SEGMENT_BYTES`` for Mooncake's client, which allocates it),
   one replica, objects of ``SIZE_BYTES``; ops/s = keys / wall time of the loop; median over ``reps``
   repetitions (p10/p90), after an untimed warm-up. The batched ``put`` and ``get_replicas`` cells of the
   quillcache subjects run once per API (param ``api``): ``objects`` (``batch_put_start`` of ``PutRequest``s
   + ``batch_put_end``; ``get_replicas``: per-key result objects) and ``columns`` (``batch_put_start_columns``
   with the sizes as one int64 array + ``batch_put_end``; ``get_replicas_columns``: one array per field,
   raw bytes on the wire), back to back in each repetition, their order alternating; Mooncake's rows (its
   own client's calls) carry no ``api`` and are the baseline of both. Acceptance
   rows ``accept_batched_vs_mooncake``: per subject in ``ACCEPT_SUBJECTS``, batched op and API, the median
   ratio to Mooncake's same op and batch, ``holds`` when at least 1.
4. **Failover** through etcd (``EtcdProcess``), when the master's HA mode exists (otherwise a
   ``failover_available`` = 0 row says why): per repetition two server processes with ``--etcd`` (a leader, a
   standby), a writer thread acknowledging batches of puts through the leader for a second, then SIGKILL of the
   leader; failover time = the kill to the standby's first acknowledged put_start + put_end (probed every 20 ms);
   then every object the old leader acknowledged is looked up on the new one (same replicas, else lost).

Acceptance (issue 14): 0 objects lost; restart with 1M objects ≤ 2 s; ≥ 10,000 single-key round trips/s
from one client; batched throughput ≥ Mooncake's master in the same run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.microbench import bench_main
from quillcache.cli.parent import kill_on_parent_death
from quillcache.master import (MasterConfig, MasterService, ObjectNotReadyError, ObjectStatus, PutRequest,
                               ReplicaConfig, SegmentDescriptor, SegmentExistsError, residency_key)
from quillcache.results import SummaryRow, spread, write_raw, write_summary

NAME = "master"
SIZE_BYTES = 4096
SEGMENT_BYTES = 1 << 30  # Mooncake's client registers (and allocates) a real segment of this size
QC_SEGMENT_BYTES = 1 << 32  # the quillcache subjects' one segment (metadata only): room for every object the
#                           cells put (both batch APIs, and the RPC server shared by two transports) below the
#                           eviction watermark, so a read never meets an evicted key
BATCH = 1000
FULL = dict(reps=5, single_calls=5000, put_single_calls=1000, batch_calls=20, restart_objects=(10_000, 100_000,
            1_000_000), restart_reps=5, tail_objects=45_000, kills=1000, kill_wait_s=0.03, failover_reps=5,
            failover_ttls=(2, 5), largest_tail_cap=None)
QUICK = dict(reps=3, single_calls=1000, put_single_calls=200, batch_calls=5, restart_objects=(10_000, 100_000),
             restart_reps=3, tail_objects=10_000, kills=20, kill_wait_s=0.1, failover_reps=2,
             failover_ttls=(2,), largest_tail_cap=20_000)  # (the quick profile exercises the row, not the bound)
EMB_LOG, EMB_MEM, RPC, MOONCAKE = ("quillcache embedded (log)", "quillcache embedded (no log)", "quillcache rpc",
                                   "Mooncake master")
RPC_ZMQ = "quillcache rpc (zmq)"  # the same server over its ZeroMQ transport, interleaved with RPC (plain TCP)
OPS = ("put", "get_replicas", "exists")
APIS = ("objects", "columns")  # MasterService/MasterClient per-object batch calls; the columnar ones
COLUMN_OPS = ("put", "get_replicas")  # the ops with a columnar form
MOONCAKE_API = "mooncake"  # Mooncake's own client calls (result key only: its rows carry no api param)
MOONCAKE_RESTART = "Mooncake master restart"  # _ops_study's status key when its restart check failed
ACCEPT_SUBJECTS = (RPC, EMB_LOG)  # the line is over the network; embedded (durable) shown beside it
SEED = 14
REPO = Path(__file__).resolve().parents[1]


# ============================================================================ helpers: forked children

def _fork_call(fn, *args, timeout_s: float = 600.0) -> dict:
    """Run ``fn(*args) -> dict`` in a forked child; return its dict (the child exits with ``os._exit``: no
    close, no snapshot, nothing flushed that ``fn`` did not commit itself)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            out = json.dumps(fn(*args)).encode()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
            code = 1
        try:
            os.write(w, out)
        finally:
            os._exit(code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise RuntimeError(f"{fn.__name__} did not finish within {timeout_s:.0f} s")
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b"{}")
    if "error" in out:
        raise RuntimeError(f"{fn.__name__} failed in its child process: {out['error']}")
    return out


def _server_process_available() -> bool:
    return importlib.util.find_spec("quillcache.master.__main__") is not None


def _server_available() -> tuple[bool, str]:
    """Helper E's master server process and client (``python -m quillcache.master``, ``MasterClient``)."""
    if importlib.util.find_spec("quillcache.master.__main__") is None:
        return False, "the master server process (python -m quillcache.master) does not exist in this checkout"
    if importlib.util.find_spec("quillcache.master.client") is None:
        return False, "quillcache.master.client (MasterClient) does not exist in this checkout"
    return True, "python -m quillcache.master + MasterClient over TCP loopback"


class ServerProcess:
    """``python -m quillcache.master --data-dir D --port 0 [extra]``; ``ready_s``: Popen to its JSON line."""

    def __init__(self, data_dir: Path, extra: list[str] | None = None, timeout_s: float = 60.0,
                 log_path: Path | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log_path = log_path or Path(data_dir).with_suffix(".server.log")
        self._log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "quillcache.master", "--data-dir", str(data_dir),
                                      "--port", "0", *(extra or [])], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=str(REPO),
                                     start_new_session=True, preexec_fn=kill_on_parent_death(signal.SIGKILL))
        self.info = self._ready_line(timeout_s)
        self.ready_s = time.perf_counter() - t0
        self.address = self.info["address"]

    def _ready_line(self, timeout_s: float) -> dict:
        fd, buf, deadline = self.proc.stdout.fileno(), b"", time.monotonic() + timeout_s
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"master server gave no ready line ({'exited' if self.proc.poll() is not None else 'timeout'}); "
                                   f"log: {self.log_path.read_text(errors='replace')[-600:]}")
            if select.select([fd], [], [], min(left, 0.5))[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    continue
                buf += chunk
        return json.loads(buf.split(b"\n", 1)[0])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


# ============================================================================ 1. restart time

def _segments(svc: MasterService, n_nodes: int, capacity: int) -> None:
    for i in range(n_nodes):
        try:
            svc.mount_segment(SegmentDescriptor(node_id=f"n{i}", segment_id=i, capacity_bytes=capacity))
        except SegmentExistsError:
            pass


def _restart_config() -> MasterConfig:
    """The defaults, as the server process runs them. Recovery rebuilds every segment's allocator, whose cost grows
    with the segment's capacity in allocation units, so segments are sized to the objects (25% headroom)."""
    return MasterConfig()


def _fill(data_dir: str, n: int, prefix: str, capacity_objects: int, n_nodes: int = 8,
          config: MasterConfig | None = None) -> dict:
    """Open (or create) the master at ``data_dir`` (segments for ``capacity_objects`` objects with 25% headroom,
    8 nodes) and put ``n`` objects in batches of 2,000."""
    svc = MasterService(config or _restart_config(), data_dir=data_dir)
    _segments(svc, n_nodes, math.ceil(capacity_objects * 1.25 / n_nodes) * SIZE_BYTES)
    lsn0 = svc.lsn
    t0 = time.perf_counter()
    for j in range(0, n, 2000):
        keys = [f"{prefix}-{i:08d}" for i in range(j, min(n, j + 2000))]
        res = svc.batch_put_start([PutRequest(key=k, size_bytes=SIZE_BYTES) for k in keys])
        assert not any(isinstance(x, Exception) for x in res), res[:3]
        svc.batch_put_end(keys)
    return {"load_s": time.perf_counter() - t0, "records": svc.lsn - lsn0, "svc": svc}


def _build(data_dir: str, n: int, capacity_objects: int) -> dict:
    out = _fill(data_dir, n, "key", capacity_objects)
    out.pop("svc").close()  # a clean shutdown: snapshot, log restarted
    return out


def _tail_then_wait(data_dir: str, n_tail: int, wfd: int) -> None:
    """Child: recover, write a tail of ``n_tail`` objects (all in the log, no snapshot: the on-disk state of a
    master SIGKILLed with that many changes past its last published snapshot), report, wait for SIGKILL."""
    no_snapshot = dataclasses.replace(_restart_config(), snapshot_every_records=10**12, snapshot_every_s=1e12)
    out = _fill(data_dir, n_tail, "tail", n_tail, config=no_snapshot)
    out.pop("svc")
    os.write(wfd, (json.dumps(out) + "\n").encode())
    while True:
        time.sleep(60)


def _timed_open(data_dir: str) -> dict:
    t0 = time.perf_counter()
    svc = MasterService(_restart_config(), data_dir=data_dir)
    el = time.perf_counter() - t0
    return {"restart_s": el, "objects": svc.stats().num_objects, "recovery_s": svc.recovery_s,
            "replayed_records": svc.recovered_records}


def _largest_tail(n: int) -> int:
    """The most objects a log tail can hold after a snapshot of ``n`` objects under the default cadence
    (a snapshot is started once the log holds ``MasterConfig.snapshot_due_changes(objects)`` changes, and while
    it is written the log takes up to snapshot_inflight_records more before the master waits for it; a crash just
    before it is published leaves both to replay; each object is 2 changes, put in _fill's calls of 2,000): the
    worst case a restart replays."""
    cfg = _restart_config()

    def fits(t: int) -> bool:  # the tail's changes were all written before a snapshot was due, or while it ran
        return 2 * t <= cfg.snapshot_due_changes(n + t) + cfg.snapshot_inflight_records

    lo, hi = 0, 1 << 26
    while lo < hi:  # the largest t that fits (fits is true up to it: the threshold shrinks slower than 2t grows)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return max(2000, lo // 2000 * 2000 - 2000)


def _sigkill_with_tail(data_dir: str, n_tail: int, timeout_s: float = 600.0) -> dict:
    """Fork a child that writes a log tail of ``n_tail`` objects to ``data_dir`` (``_tail_then_wait``), wait for its
    report line, SIGKILL it. A child that fails sends its exception through the pipe (as ``_fork_call``'s do) and
    this raises a RuntimeError naming it; one that exits without a line, or is late, raises a RuntimeError too."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _tail_then_wait(data_dir, n_tail, w)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(w, (json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n").encode())
        finally:
            os._exit(1)
    os.close(w)
    buf, deadline = b"", time.monotonic() + timeout_s
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                raise RuntimeError(f"the log-tail child did not report within {timeout_s:.0f} s")
            chunk = os.read(r, 65536)
            if not chunk:
                raise RuntimeError(f"the log-tail child exited without a report (data dir {data_dir})")
            buf += chunk
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    out = json.loads(buf.split(b"\n")[0])
    if "error" in out:
        raise RuntimeError(f"the log-tail child failed (data dir {data_dir}): {out['error']}")
    return out


def _served_objects(srv: ServerProcess) -> int:
    """The object count a started master server process reports (``MasterClient.stats``)."""
    from quillcache.master.client import MasterClient

    with MasterClient(srv.address, timeout_s=60.0) as c:
        return int(c.stats().num_objects)


def _restart_study(cfg: dict, work: Path, server_ok: bool, raw: list) -> list[SummaryRow]:
    rows: list[SummaryRow] = []
    for n in cfg["restart_objects"]:
        d = work / f"restart-{n}"
        largest = min(_largest_tail(n), cfg["largest_tail_cap"] or 1 << 62)
        states = {}
        for state in ("clean", "sigkill", "sigkill_largest_tail"):
            expect = n
            tail = cfg["tail_objects"] if state == "sigkill" else largest
            if state != "sigkill":  # a fresh build: the clean state, and the largest tail on a snapshot of n objects
                shutil.rmtree(d, ignore_errors=True)
                built = _fork_call(_build, str(d), n, n + max(cfg["tail_objects"], largest), timeout_s=1200)
            t = None
            if state.startswith("sigkill"):
                t = _sigkill_with_tail(str(d), tail)
                expect = n + tail
                states[state] = (f"SIGKILL after a log tail of {tail:,} objects ({t['records']:,} records)"
                                 + ((" - the largest the default snapshot cadence lets the log hold"
                                     if tail == _largest_tail(n) else " - capped by the quick profile")
                                    if state == "sigkill_largest_tail" else ""))
            else:
                states[state] = f"clean close (snapshot) after loading {n:,} objects in {built['load_s']:.1f} s"
            times, proc_times = [], []
            for rep in range(cfg["restart_reps"]):
                got = _fork_call(_timed_open, str(d))
                if got["objects"] != expect:
                    raise AssertionError(f"restart of {d.name} ({state}) found {got['objects']} objects, not {expect}")
                if t is not None and got["replayed_records"] != t["records"]:
                    raise AssertionError(f"restart of {d.name} ({state}) replayed {got['replayed_records']} records, "
                                         f"not the tail's {t['records']} (a snapshot was taken during the tail)")
                times.append(got["restart_s"])
                raw.append(("restart", "in-process", state, n, rep, f"{got['restart_s']:.6f}", got["objects"]))
            rows.append(SummaryRow.from_spread(spread(times), metric="restart_s", subject="quillcache MasterService",
                                               unit="s", n=len(times), notes=f"{states[state]}; MasterService(data_dir=D) "
                                               "in a fresh forked process until it returns", params={
                                                   "objects": n, "state": state, "start": "in-process",
                                                   "tail_objects": tail if t is not None else 0}))
            if server_ok:
                for rep in range(cfg["restart_reps"]):
                    srv = ServerProcess(d, log_path=work / f"restart-{n}-{state}-{rep}.log")
                    try:
                        found = _served_objects(srv)  # untimed: after the ready line
                    finally:
                        srv.kill()  # SIGKILL: nothing written at exit, the next start sees the same state
                    if found != expect:
                        raise AssertionError(f"restart of {d.name} ({state}) as a server process serves {found} "
                                             f"objects, not {expect}")
                    proc_times.append(srv.ready_s)
                    raw.append(("restart", "process", state, n, rep, f"{srv.ready_s:.6f}", found))
                rows.append(SummaryRow.from_spread(spread(proc_times), metric="restart_s", subject="quillcache server process",
                                                   unit="s", n=len(proc_times), notes=f"{states[state]}; Popen of python -m "
                                                   "quillcache.master until its ready line (interpreter start, imports, "
                                                   "recovery, bind)", params={"objects": n, "state": state,
                                                                             "start": "process",
                                                                             "tail_objects": tail if t is not None else 0}))
        shutil.rmtree(d, ignore_errors=True)
        print(f"[master] restart {n:>9,} objects: " + ", ".join(
            f"{r.params['state']}/{r.params['start']} {r.value * 1e3:.0f} ms" for r in rows if r.params["objects"] == n),
            flush=True)
    return rows


# ============================================================================ 2. SIGKILL study

def _kill_workload(data_dir: str, seed: int, start: int, ack_path: str, ready_fd: int) -> None:
    """Child: the put/get/remove workload of tests/master_kill_child.py; one ``os.write`` per line to ``ack_path``."""
    rng = random.Random(seed)
    svc = MasterService(MasterConfig(alignment_bytes=4096, snapshot_every_records=50, snapshot_growth=0.0,
                                     restart_budget_s=0.0), data_dir=data_dir)
    for seg, node in enumerate("abc"):
        try:
            svc.mount_segment(SegmentDescriptor(node_id=node, segment_id=seg, capacity_bytes=1 << 30))
        except SegmentExistsError:
            pass
    fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(ready_fd, b"R")
    i = start
    while True:
        keys = [f"obj-{i + j}" for j in range(rng.randint(1, 8))]
        i += len(keys)
        res = svc.batch_put_start([PutRequest(key=k, size_bytes=rng.randint(1, 4096),
                                              config=ReplicaConfig(replica_num=rng.randint(1, 3))) for k in keys])
        ok = [(k, r) for k, r in zip(keys, res) if not isinstance(r, Exception)]
        if rng.random() < 0.2 and ok:  # one put left in flight: it must never become readable
            os.write(fd, f"INFLIGHT {ok[-1][0]}\n".encode())
            ok = ok[:-1]
        ends = svc.batch_put_end([k for k, _ in ok])
        acks = "".join(f"ACK {k} " + ",".join(f"{d.segment_id}:{d.offset_bytes}" for d in r.replicas) + "\n"
                       for (k, r), e in zip(ok, ends) if e is None)
        if acks:
            os.write(fd, acks.encode())
        svc.get_replicas([k for k, _ in ok])
        if rng.random() < 0.1 and ok:
            os.write(fd, f"REMOVING {ok[0][0]}\n".encode())  # from here on the object may be gone
            svc.batch_remove([ok[0][0]], force=True)


def _kill_check(data_dir: str, acked: dict, removed: set, inflight: set) -> dict:
    """Recover ``data_dir`` (in a fresh process) and compare with what the killed children acknowledged."""
    svc = MasterService(MasterConfig(alignment_bytes=4096, snapshot_every_records=50, snapshot_growth=0.0,
                                     restart_budget_s=0.0), data_dir=data_dir)
    svc.check_invariants()
    lost, checked = [], 0
    for key, reps in acked.items():
        if key in removed:
            continue
        checked += 1
        try:
            info = svc.object_info(key)
        except Exception as exc:  # noqa: BLE001 - a missing object is a loss, named below
            lost.append(f"{key}: {type(exc).__name__}")
            continue
        got = ",".join(f"{d.segment_id}:{d.offset_bytes}" for d in info.replicas)
        if info.status != ObjectStatus.COMPLETE or got != reps:
            lost.append(f"{key}: {info.status.name} {got} != {reps}")
    pending_visible = inflight_complete = unacked_complete = pending = 0
    for key in svc.keys():
        info = svc.object_info(key)
        if info.status == ObjectStatus.PENDING:
            pending += 1
            visible = not isinstance(svc.get_replicas([key])[0], ObjectNotReadyError)
            indexed = svc.index.locate([residency_key(key)[0]]) != [[]]
            pending_visible += visible or indexed
        else:
            inflight_complete += key in inflight
            unacked_complete += key not in acked and key not in removed
    return {"checked": checked, "lost": len(lost), "lost_first": lost[:5], "pending": pending,
            "pending_visible": pending_visible, "inflight_complete": inflight_complete,
            "unacked_complete": unacked_complete, "recovery_s": svc.recovery_s, "objects": svc.stats().num_objects}


def _kill_study(cfg: dict, work: Path, raw: list) -> list[SummaryRow]:
    rng = random.Random(SEED)
    data_dir, ack_path = work / "kill", work / "kill-acks.log"
    acked: dict[str, str] = {}
    removed: set[str] = set()
    inflight: set[str] = set()
    start = offset = 0
    tot = dict(checked=0, lost=0, pending_visible=0, inflight_complete=0, unacked_complete=0)
    lost_examples: list[str] = []
    t0 = time.monotonic()
    for kill in range(cfg["kills"]):
        r, w = os.pipe()
        seed = rng.getrandbits(32)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                _kill_workload(str(data_dir), seed, start, str(ack_path), w)
            finally:
                os._exit(1)
        os.close(w)
        try:
            if not select.select([r], [], [], 120)[0] or os.read(r, 1) != b"R":
                raise RuntimeError(f"kill {kill}: the workload child never became ready")
            time.sleep(rng.uniform(0.0, cfg["kill_wait_s"]))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
        with open(ack_path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
        complete = data[:data.rfind(b"\n") + 1]  # a line cut by the kill is not an acknowledgement
        offset += len(complete)
        for line in complete.decode().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == "ACK":
                acked[parts[1]] = parts[2]
                start = max(start, int(parts[1].split("-")[1]) + 100)
            elif len(parts) == 2 and parts[0] == "REMOVING":
                removed.add(parts[1])
            elif len(parts) == 2 and parts[0] == "INFLIGHT":
                inflight.add(parts[1])
        start += 1000  # keys of a put killed before its ack line are never reused
        res = _fork_call(_kill_check, str(data_dir), acked, removed, inflight)
        for k in tot:
            tot[k] += res[k]
        tot["unacked_complete"] = res["unacked_complete"]  # distinct objects in the last recovery, not a sum
        lost_examples += res["lost_first"]
        if (kill + 1) % 100 == 0:
            print(f"[master] kill {kill + 1}/{cfg['kills']}: {len(acked):,} acknowledged, {tot['lost']} lost "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
        raw.append(("kill", kill, seed, res["checked"], res["lost"], res["pending"], res["pending_visible"],
                    res["unacked_complete"], f"{res['recovery_s']:.6f}", res["objects"]))
    wall = time.monotonic() - t0
    kills = cfg["kills"]
    notes = (f"{kills} SIGKILLs of a forked master process at seeded random points (0-{cfg['kill_wait_s'] * 1e3:.0f} ms "
             f"into a put/get/remove workload); after each, a fresh process recovers and checks every acknowledged "
             f"object; {wall:.0f} s")
    p = {"kills": kills, "kill_wait_ms": round(cfg["kill_wait_s"] * 1e3)}
    rows = [SummaryRow(metric="kills", subject="quillcache MasterService", value=kills, unit="count", notes=notes,
                       params=p),
            SummaryRow(metric="acknowledged_objects", subject="quillcache MasterService", value=len(acked),
                       unit="count", notes="distinct objects whose put_end was acknowledged", params=p),
            SummaryRow(metric="objects_checked", subject="quillcache MasterService", value=tot["checked"],
                       unit="count", notes="acknowledged objects checked, summed over the restarts", params=p),
            SummaryRow(metric="objects_lost", subject="quillcache MasterService", value=tot["lost"], unit="count",
                       notes=("missing or with other replicas after a restart: " + "; ".join(lost_examples[:3]))
                       if tot["lost"] else "missing or with other replicas after a restart (must be 0)", params=p),
            SummaryRow(metric="half_finished_visible", subject="quillcache MasterService",
                       value=tot["pending_visible"] + tot["inflight_complete"], unit="count",
                       notes="PENDING objects readable or in the residency index, plus puts left in flight that "
                             "came back COMPLETE (must be 0)", params=p),
            SummaryRow(metric="committed_unacknowledged", subject="quillcache MasterService",
                       value=tot["unacked_complete"], unit="count",
                       notes="distinct COMPLETE objects (at the last recovery) whose ack line a kill cut off: committed before "
                             "the kill, allowed",
                       params=p)]
    print(f"[master] kill study: {kills} kills, {len(acked):,} acknowledged objects, {tot['checked']:,} checks, "
          f"{tot['lost']} lost, {tot['pending_visible'] + tot['inflight_complete']} half-finished visible "
          f"({wall:.0f} s)", flush=True)
    return rows


# ============================================================================ 3. operations per second

class _Embedded:
    """A ``MasterService`` in this process; calls go straight to it."""

    def __init__(self, data_dir: Path | None) -> None:
        self.svc = MasterService(MasterConfig(), data_dir=data_dir)
        self.svc.mount_segment(SegmentDescriptor(node_id="bench", segment_id=0, capacity_bytes=QC_SEGMENT_BYTES))

    def run(self, op: str, batch: int, keys: list[str], api: str = "objects") -> tuple[float, int]:
        return _run_calls(self.svc, op, batch, keys, api)

    def close(self) -> None:
        self.svc.close()


class _Remote:
    """The master server process (``python -m quillcache.master``) through ``MasterClient``: over the plain-TCP
    transport (``stream``, what the client prefers) or ZeroMQ; ``server`` shared with another ``_Remote`` (which
    then owns it) or started here."""

    def __init__(self, work: Path, *, stream: bool = True, server: ServerProcess | None = None) -> None:
        from quillcache.master.client import MasterClient

        self.own_server = server is None
        self.server = ServerProcess(work / "rpc-data", log_path=work / "rpc-server.log") if server is None else server
        try:
            self.client = MasterClient(self.server.address, timeout_s=60.0, prefer_stream=stream)
            if self.own_server:
                self.client.mount_segment(SegmentDescriptor(node_id="bench", segment_id=0,
                                                            capacity_bytes=QC_SEGMENT_BYTES))
            self.client.heartbeat("bench")  # the first call: picks the transport
            want = self.server.info.get("stream_address") if stream else self.server.address
            if self.client.address != want:
                raise RuntimeError(f"MasterClient is on {self.client.address}, not the {want} measured here")
        except BaseException:
            if self.own_server:
                self.server.kill()
            raise

    def run(self, op: str, batch: int, keys: list[str], api: str = "objects") -> tuple[float, int]:
        self.client.heartbeat("bench")  # untimed: the server's tick expires a node unseen for client_ttl_s
        return _run_calls(self.client, op, batch, keys, api)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self.own_server:
                self.server.kill(signal.SIGTERM)


def _run_calls(m, op: str, batch: int, keys: list[str], api: str = "objects") -> tuple[float, int]:
    """``op`` over ``keys`` in calls of ``batch`` on a MasterService or a MasterClient: (seconds, bad results).
    ``api`` "columns" (batched put and get_replicas only): the columnar forms, ``batch_put_start_columns`` (sizes
    as one int64 array, built once as a caller holding its sizes in an array would) + ``batch_put_end``, and
    ``get_replicas_columns``; a key failed when the columns name an error for it."""
    pc = time.perf_counter
    if api == "columns":
        return _run_columns(m, op, batch, keys)
    bad = 0
    if batch == 1:
        if op == "put":
            start, end = m.put_start, m.put_end
            t0 = pc()
            for k in keys:
                start(k, SIZE_BYTES)
                end(k)
            return pc() - t0, 0
        call = m.get_replica_list if op == "get_replicas" else m.exist_key
        t0 = pc()
        for k in keys:
            if not call(k):
                bad += 1
        return pc() - t0, bad
    calls = [keys[i:i + batch] for i in range(0, len(keys), batch)]
    t0 = pc()
    for ks in calls:
        if op == "put":
            res = m.batch_put_start([PutRequest(key=k, size_bytes=SIZE_BYTES) for k in ks])
            ends = m.batch_put_end(ks)
            bad += sum(isinstance(x, Exception) for x in res) + sum(e is not None for e in ends)
        elif op == "get_replicas":
            bad += sum(isinstance(x, Exception) or not x for x in m.get_replicas(ks))
        else:
            bad += sum(x is not True for x in m.exists(ks))
    return pc() - t0, bad


def _run_columns(m, op: str, batch: int, keys: list[str]) -> tuple[float, int]:
    if op not in COLUMN_OPS or batch == 1:
        raise ValueError(f"the columnar API has no {op} x{batch} cell")
    pc = time.perf_counter
    bad = 0
    calls = [keys[i:i + batch] for i in range(0, len(keys), batch)]
    sizes = np.full(batch, SIZE_BYTES, dtype=np.int64)
    t0 = pc()
    for ks in calls:
        if op == "put":
            cols = m.batch_put_start_columns(ks, sizes[:len(ks)])
            ends = m.batch_put_end(ks)
            bad += len(cols.errors) + sum(e is not None for e in ends)
        else:
            bad += len(m.get_replicas_columns(ks).errors)
    return pc() - t0, bad


def _cells(cfg: dict, rep: int = 0) -> list[tuple[str, int, int, str]]:
    """(op, batch, keys per repetition, api) in the order repetition ``rep`` runs them: puts first; the batched
    put and get_replicas cells once per API, the two APIs back to back in an order alternating between reps."""
    out = []
    for op in OPS:
        out.append((op, 1, cfg["put_single_calls"] if op == "put" else cfg["single_calls"], "objects"))
        apis = APIS if op in COLUMN_OPS else APIS[:1]
        for api in (apis if rep % 2 == 0 else apis[::-1]):
            out.append((op, BATCH, cfg["batch_calls"] * BATCH, api))
    return out


def _runs(runner, api: str) -> bool:
    """Whether ``runner`` measures cells of ``api``: ours both APIs; Mooncake's client its own calls, once per cell
    (its "objects" cells)."""
    return api in getattr(runner, "apis", APIS) or (api == "objects" and MOONCAKE_API in getattr(runner, "apis", ()))


def _measure(subject: str, runner, cfg: dict, raw: list) -> dict[tuple[str, int], dict]:
    """Every cell ``reps`` times (after a warm-up); ``{(op, batch): {"ops": [...], "notes": str}}``."""
    return _measure_interleaved({subject: runner}, cfg, raw)[subject]


def _measure_interleaved(runners: dict, cfg: dict, raw: list, failed: dict[str, str] | None = None
                         ) -> dict[str, dict[tuple[str, int], dict]]:
    """``_measure`` of several subjects at once: each cell of each repetition runs once per subject, one subject
    after the other (their order alternating between repetitions), so an A/B comparison sees the same moments of
    this machine. Each subject puts its own fresh keys and reads back keys it put. Results are keyed
    ``(op, batch, api)``; a subject with its own API (Mooncake) runs the "objects" cells only, as ``MOONCAKE_API``.
    ``failed`` None: the first error (a call raising, or results that were errors or misses) is raised. A dict: a
    subject that errs gets ``failed[subject]`` = the reason, is left out of every later cell and of the result,
    and the others go on."""
    rng = random.Random(SEED)
    written: dict[str, list[str]] = {s: [] for s in runners}
    live = list(runners)
    counter = [0]

    def fresh(subject: str, n: int) -> list[str]:
        ks = [f"obj-{counter[0] + i:09d}" for i in range(n)]
        counter[0] += n
        written[subject].extend(ks)
        return ks

    def call(subject: str, op: str, batch: int, keys: list[str], own: str):
        """One cell of ``subject``: (seconds, rpcs per call), or None when it failed (then it is dropped)."""
        try:
            secs, bad, extra = _unpack(runners[subject].run(op, batch, keys, own))
            if bad:
                raise AssertionError(f"{subject} {op} batch {batch} ({own}): {bad} of {len(keys)} results were "
                                     f"errors or misses")
        except Exception as exc:
            if failed is None:
                raise
            failed[subject] = f"failed while measuring: {type(exc).__name__}: {exc}"
            print(f"[master] {subject}: {failed[subject]}", flush=True)
            live.remove(subject)
            return None
        return secs, extra

    # warm-up (untimed): connections, code paths; its keys are readable afterwards
    for subject, runner in runners.items():
        for op, batch, n, api in _cells(cfg):
            if subject not in live or not _runs(runner, api):
                continue
            w = written[subject]
            keys = fresh(subject, min(n, 2 * batch if batch > 1 else 50)) if op == "put" \
                else rng.sample(w, min(len(w), 50 if batch == 1 else batch))
            call(subject, op, batch, keys, api if api in getattr(runner, "apis", APIS) else MOONCAKE_API)
    out: dict[str, dict[tuple[str, int], dict]] = {s: {} for s in runners}
    order = list(runners)
    for rep in range(cfg["reps"]):
        for op, batch, n, api in _cells(cfg, rep):
            for subject in (order if rep % 2 == 0 else order[::-1]):
                runner = runners[subject]
                if subject not in live or not _runs(runner, api):
                    continue
                own = api if api in getattr(runner, "apis", APIS) else MOONCAKE_API
                keys = fresh(subject, n) if op == "put" else rng.sample(written[subject], n)
                got = call(subject, op, batch, keys, own)
                if got is None:
                    continue
                secs, extra = got
                cell = out[subject].setdefault((op, batch, own), {"ops": [], "rpcs_per_call": extra})
                cell["ops"].append(n / secs)
                raw.append(("ops", subject, op, batch, own, rep, n, f"{secs:.6f}",
                            extra if extra is not None else ""))
    for subject, runner in runners.items():
        runner.written = written[subject]
    return {s: cells for s, cells in out.items() if s in live}


def _unpack(res) -> tuple[float, int, float | None]:
    if isinstance(res, dict):  # the Mooncake client's reply
        calls = res["calls"]
        return res["seconds"], res["bad"], res["rpcs"] / calls if calls else None
    secs, bad = res
    return secs, bad, None


class _Mooncake:
    def __init__(self) -> None:
        from experiments.master_mooncake import MooncakeMasterRun

        self.run_ = MooncakeMasterRun(segment_bytes=SEGMENT_BYTES).start()

    apis = (MOONCAKE_API,)  # its own client's calls (module docstring)

    def run(self, op: str, batch: int, keys: list[str], api: str = MOONCAKE_API) -> dict:
        return self.run_.run(op, batch, keys, SIZE_BYTES)

    def close(self) -> None:
        self.run_.close()


def _mooncake_restart(runner: "_Mooncake") -> SummaryRow:
    keys = runner.written
    res = runner.run_.restart_master(keys)
    print(f"[master] Mooncake master SIGKILLed and restarted: {res['found']:,} of {len(keys):,} objects found "
          f"({res['errors']} errors)", flush=True)
    return SummaryRow(metric="objects_after_restart", subject=MOONCAKE, value=res["found"], unit="count",
                      notes="mooncake_master SIGKILLed and started again on the same port with its defaults (no "
                            "operation log, no snapshot); its client, still running, asks batch_is_exist of every "
                            "object it had put", params={"objects": len(keys), "state": "sigkill"})


OP_NOTES = {"put": "put_start + put_end of a new object ({how})", "get_replicas": "replica list of an existing "
            "object, read lease granted ({how})", "exists": "existence of an existing object, no lease ({how})"}
HOW = {EMB_LOG: "MasterService methods in-process; state changes written to the log before returning and fsynced "
                "(a put_start with the put_end that follows it: MasterConfig.sync_put_start)",
       EMB_MEM: "MasterService methods in-process, no data dir: nothing durable",
       RPC: "MasterClient over TCP loopback to the server process (data dir: fsynced as embedded; index rows "
            "published after each reply), on its plain-TCP transport "
            "(qtcp://, length-prefixed frames, the client's default); get_replicas, get_replica_list and put_start "
            "travel in the compact forms (native msgpack rows, descriptors rebuilt client-side)",
       RPC_ZMQ: "the same server and MasterClient on the server's ZeroMQ transport (prefer_stream=False), "
                "interleaved with the other subjects cell by cell; compact forms as well",
       MOONCAKE: "MooncakeDistributedStore metadata calls to mooncake_master over TCP loopback; no operation log"}


COLUMNS_NOTE = {"put": "columnar API: batch_put_start_columns (keys, one int64 array of sizes; PutColumns: one array "
                       "per field) + batch_put_end",
                "get_replicas": "columnar API: get_replicas_columns (ReplicaColumns: one array per field)"}


def _acceptance(results: dict) -> list[SummaryRow]:
    """Issue 14's line "batched throughput >= Mooncake's master in the same run", per batched op, API and subject in
    ``ACCEPT_SUBJECTS``: the median ratio to Mooncake's same op and batch; ``holds`` when it is at least 1."""
    base = results.get(MOONCAKE)
    rows: list[SummaryRow] = []
    if base is None:
        return rows
    for subject in ACCEPT_SUBJECTS:
        for (op, batch, api), cell in results.get(subject, {}).items():
            if batch == 1 or op not in COLUMN_OPS:
                continue
            ours, theirs = spread(cell["ops"])["median"], spread(base[(op, batch, MOONCAKE_API)]["ops"])["median"]
            ratio = ours / theirs
            rows.append(SummaryRow(metric="accept_batched_vs_mooncake", subject=subject, value=ratio, unit="ratio",
                                   notes=f"{ours:,.0f} vs Mooncake's {theirs:,.0f} keys/s (medians, same run)",
                                   params={"op": op, "batch": batch, "api": api, "limit": 1.0,
                                           "holds": bool(ratio >= 1.0), "transport": TRANSPORT.get(subject, "tcp")}))
    return rows


TRANSPORT = {EMB_LOG: "in-process", EMB_MEM: "in-process", RPC: "tcp", RPC_ZMQ: "zmq"}


def _ops_study(cfg: dict, work: Path, server: tuple[bool, str], mk: tuple[bool, str, str | None], raw: list
               ) -> tuple[list[SummaryRow], dict[str, str]]:
    """Every subject that starts is measured in ONE interleaved group (``_measure_interleaved``): the embedded
    subjects, the RPC pair and Mooncake's master alike, so every ratio to Mooncake compares the same moments of
    this machine. Each subject starts on its own: one that is not available, cannot start or fails while
    measuring is left out with the reason in ``status`` (and its ``*_available`` row), and the others go on."""
    status: dict[str, str] = {}
    lost_rows: list[SummaryRow] = []
    runners: dict = {}

    def remote_pair() -> dict:
        stream = _Remote(work)
        try:
            return {RPC: stream, RPC_ZMQ: _Remote(work, stream=False, server=stream.server)}
        except BaseException:
            stream.close()
            raise

    makers = {EMB_LOG: lambda: {EMB_LOG: _Embedded(work / "emb-data")}, EMB_MEM: lambda: {EMB_MEM: _Embedded(None)},
              RPC: remote_pair if server[0] else None, MOONCAKE: (lambda: {MOONCAKE: _Mooncake()}) if mk[0] else None}
    unavailable = {RPC: server[1], MOONCAKE: mk[1]}
    t0 = time.monotonic()
    results: dict[str, dict] = {}
    try:
        for subject, make in makers.items():
            if make is None:
                status[subject] = unavailable[subject]
                continue
            try:
                runners.update(make())
            except Exception as exc:  # noqa: BLE001 - the subject is reported as not measured, with the reason
                status[subject] = f"could not start: {type(exc).__name__}: {exc}"
                print(f"[master] {subject}: {status[subject]}", flush=True)
        results = _measure_interleaved(runners, cfg, raw, failed=status)
        if MOONCAKE in results:  # its defaults keep no log: what a restart leaves of what was put
            try:
                lost_rows.append(_mooncake_restart(runners[MOONCAKE]))
            except Exception as exc:  # noqa: BLE001 - its throughput stands; the restart check is named as failed
                status[MOONCAKE_RESTART] = f"its restart check failed: {type(exc).__name__}: {exc}"
                print(f"[master] {MOONCAKE}: {status[MOONCAKE_RESTART]}", flush=True)
    finally:
        for name, runner in reversed(list(runners.items())):  # a shared server's owner (RPC) after its sharer
            try:
                runner.close()
            except Exception as exc:  # noqa: BLE001 - the others are still closed
                print(f"[master] {name}: close failed: {type(exc).__name__}: {exc}", flush=True)
    for name in results:
        print(f"[master] {name}: " + ", ".join(f"{op}/{b}{'/' + a if a == 'columns' else ''} "
                                                f"{spread(c['ops'])['median']:,.0f}"
                                                for (op, b, a), c in results[name].items())
              + f" ops/s (the group: {time.monotonic() - t0:.0f} s)", flush=True)
    rows: list[SummaryRow] = []
    base = results.get(MOONCAKE)
    for subject, cells in results.items():
        for (op, batch, api), cell in cells.items():
            s = spread(cell["ops"])
            b = {} if subject == MOONCAKE or base is None else {
                "baseline": MOONCAKE, "baseline_value": spread(base[(op, batch, MOONCAKE_API)]["ops"])["median"]}
            notes = OP_NOTES[op].format(how=HOW[subject])
            if api == "columns":
                notes += "; " + COLUMNS_NOTE[op]
            if cell["rpcs_per_call"] is not None:
                notes += f"; {cell['rpcs_per_call']:.3g} master RPCs per call, counted from its metrics"
            params = {"op": op, "batch": batch, "size_bytes": SIZE_BYTES, "durable": subject in (EMB_LOG, RPC, RPC_ZMQ),
                      "transport": TRANSPORT.get(subject, "tcp"), "interleaved": len(results) > 1}
            if api != MOONCAKE_API:
                params["api"] = api
            rows.append(SummaryRow.from_spread(s, metric="ops_per_s", subject=subject, unit="ops/s",
                                               n=len(cell["ops"]), notes=notes, params=params, **b))
    rows += _acceptance(results)
    rows += lost_rows
    rows.append(SummaryRow(metric="mooncake_available", subject=MOONCAKE, value=float(MOONCAKE in results),
                           unit="bool", notes=(f"mooncake-transfer-engine {mk[2]} from PyPI: mooncake_master and "
                                               "MooncakeDistributedStore, same run"
                                               + (f"; {status[MOONCAKE_RESTART]}" if MOONCAKE_RESTART in status
                                                  else "") if MOONCAKE in results
                                               else f"not measured: {status.get(MOONCAKE, mk[1])}")))
    rows.append(SummaryRow(metric="rpc_available", subject=RPC, value=float(RPC in results), unit="bool",
                           notes=(server[1] + (f"; {RPC_ZMQ}: not measured: {status[RPC_ZMQ]}" if RPC_ZMQ in status
                                               else "")) if RPC in results
                           else f"not measured: {status.get(RPC, server[1])}"))
    return rows, status


# ============================================================================ 4. failover

def _failover_available() -> tuple[bool, str]:
    ok, why = _server_available()
    if not ok:
        return False, why
    if importlib.util.find_spec("quillcache.master.ha") is None:
        return False, "the master's HA mode (quillcache.master.ha: etcd election, log following) does not exist in this checkout"
    from quillcache.cluster.etcd import ETCD_INSTALL_HINT, find_etcd

    if find_etcd() is None:
        return False, ETCD_INSTALL_HINT
    return True, "etcd on 127.0.0.1; masters started with --etcd"


def _probe_write(address: str, key: str, timeout_s: float) -> bool:
    """One put_start + put_end through ``address`` alone (no retries): True when both were acknowledged."""
    from quillcache.master.client import MasterClient

    try:
        with MasterClient(address, timeout_s=timeout_s, retry_s=0.0) as c:
            c.put_start(key, SIZE_BYTES)
            c.put_end(key)
            return True
    except Exception:  # noqa: BLE001 - not serving yet (NOT_LEADER, a timeout, a refused connection)
        return False


def _one_failover(etcd: str, group: str, ttl_s: int, rep: int, work: Path, raw: list) -> tuple[float, int, int]:
    """Leader + standby; a writer acknowledges puts through the leader; SIGKILL the leader; time until the standby
    acknowledges a write; then check every acknowledged object on it. Returns (seconds, acked, lost)."""
    import threading

    from quillcache.master.client import MasterClient

    extra = ["--etcd", etcd, "--name", group, "--ttl-s", str(ttl_s)]
    leader = ServerProcess(work / f"fo-{group}-a", extra + ["--candidate", "a"], timeout_s=4 * ttl_s + 60,
                           log_path=work / f"fo-{group}-a.log")
    procs = [leader]
    try:
        if leader.info["role"] != "leader":
            raise RuntimeError(f"the first master of {group} came up as {leader.info['role']}")
        standby = ServerProcess(work / f"fo-{group}-b", extra + ["--candidate", "b"], timeout_s=4 * ttl_s + 60,
                                log_path=work / f"fo-{group}-b.log")
        procs.append(standby)
        if standby.info["role"] != "standby":
            raise RuntimeError(f"the second master of {group} came up as {standby.info['role']}")
        acked: dict[str, str] = {}
        with MasterClient(leader.address, timeout_s=2.0, retry_s=0.0) as c:
            c.mount_segment(SegmentDescriptor(node_id="bench", segment_id=0, capacity_bytes=SEGMENT_BYTES))
        stop = threading.Event()

        def writer() -> None:
            i = 0
            with MasterClient(leader.address, timeout_s=1.0, retry_s=0.0) as c:
                while not stop.is_set():
                    keys = [f"fo-{i + j}" for j in range(20)]
                    i += 20
                    try:
                        c.heartbeat("bench")
                        res = c.batch_put_start([PutRequest(key=k, size_bytes=SIZE_BYTES) for k in keys])
                        ends = c.batch_put_end(keys)
                    except Exception:  # noqa: BLE001 - the leader is gone: stop writing
                        return
                    for k, r, e in zip(keys, res, ends):
                        if not isinstance(r, Exception) and e is None:
                            acked[k] = ",".join(f"{d.segment_id}:{d.offset_bytes}" for d in r.replicas)

        th = threading.Thread(target=writer, daemon=True)
        th.start()
        time.sleep(1.0)
        t_kill = time.perf_counter()
        leader.kill()  # SIGKILL
        stop.set()
        th.join(timeout=10)
        deadline = time.monotonic() + 6 * ttl_s + 30
        n = 0
        while not _probe_write(standby.address, f"probe-{rep}-{n}", 0.2):
            n += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"no standby served within {6 * ttl_s + 30} s of the leader's SIGKILL")
            time.sleep(0.02)
        took = time.perf_counter() - t_kill
        lost = 0
        with MasterClient(standby.address, timeout_s=10.0, retry_s=0.0) as c:
            c.heartbeat("bench")
            keys = list(acked)
            for j in range(0, len(keys), 1000):
                for k, reps in zip(keys[j:j + 1000], c.get_replicas(keys[j:j + 1000])):
                    got = None if isinstance(reps, Exception) else ",".join(f"{d.segment_id}:{d.offset_bytes}"
                                                                            for d in reps)
                    lost += got != acked[k]
        raw.append(("failover", ttl_s, rep, f"{took:.6f}", len(acked), lost, n))
        return took, len(acked), lost
    finally:
        for p in procs:
            p.kill()


def _failover_study(cfg: dict, work: Path, raw: list) -> list[SummaryRow]:
    ok, why = _failover_available()
    if not ok:
        return [SummaryRow(metric="failover_available", subject="quillcache HA", value=0.0, unit="bool",
                           notes=f"not measured: {why}")]
    from quillcache.cluster.etcd import EtcdProcess

    rows: list[SummaryRow] = []
    lost_total = acked_total = 0
    try:
        with EtcdProcess() as etcd:
            for ttl_s in cfg["failover_ttls"]:
                times = []
                for rep in range(cfg["failover_reps"]):
                    took, acked, lost = _one_failover(etcd.endpoint, f"study-{ttl_s}-{rep}", ttl_s, rep, work, raw)
                    times.append(took)
                    acked_total += acked
                    lost_total += lost
                rows.append(SummaryRow.from_spread(spread(times), metric="failover_s", subject="quillcache HA",
                                                   unit="s", n=len(times), params={"ttl_s": ttl_s},
                                                   notes="leader SIGKILL to the standby's first acknowledged "
                                                         "put_start + put_end (a probe every 20 ms, each with a 0.2 s timeout); "
                                                         "two masters, "
                                                         "etcd on 127.0.0.1"))
                print(f"[master] failover at TTL {ttl_s} s: " + ", ".join(f"{t:.2f}" for t in times) + " s", flush=True)
    except Exception as exc:  # noqa: BLE001 - reported, the rest of the study stands
        print(f"[master] failover failed: {type(exc).__name__}: {exc}", flush=True)
        return [SummaryRow(metric="failover_available", subject="quillcache HA", value=0.0, unit="bool",
                           notes=f"not measured: failed: {type(exc).__name__}: {exc}")]
    rows.append(SummaryRow(metric="failover_objects_lost", subject="quillcache HA", value=lost_total, unit="count",
                           notes="acknowledged objects missing or with other replicas on the new leader"))
    rows.append(SummaryRow(metric="failover_objects_checked", subject="quillcache HA", value=acked_total,
                           unit="count", notes="objects acknowledged by the old leader before its SIGKILL"))
    rows.append(SummaryRow(metric="failover_available", subject="quillcache HA", value=1.0, unit="bool",
                           notes=why))
    return rows


# ============================================================================ run / plot

def run(quick: bool = False, results_root: str | None = None, *, mooncake: bool = True) -> list[SummaryRow]:
    cfg = QUICK if quick else FULL
    t_start = time.monotonic()
    raw: list[tuple] = []
    server = _server_available()
    work = Path(tempfile.mkdtemp(prefix="quillcache-master-study-"))
    try:
        # fork-based parts first, while this process runs no threads
        rows = _restart_study(cfg, work, _server_process_available(), raw)
        rows += _kill_study(cfg, work, raw)
        if mooncake:
            from experiments.master_mooncake import availability

            mk = availability()
        else:
            mk = (False, "not run (mooncake=False)", None)
        ops_rows, _ = _ops_study(cfg, work, server, mk, raw)
        rows += ops_rows
        rows += _failover_study(cfg, work, raw)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_summary(NAME, rows, results_root, profile="quick" if quick else "full", started_at=t_start)
    headers = {"restart": ("start", "state", "objects", "rep", "seconds", "objects_found"),
               "kill": ("kill", "seed", "objects_checked", "objects_lost", "pending", "pending_visible",
                        "committed_unacknowledged", "recovery_s", "objects"),
               "ops": ("subject", "op", "batch", "api", "rep", "keys", "seconds", "master_rpcs_per_call"),
               "failover": ("ttl_s", "rep", "seconds", "objects_acknowledged", "objects_lost", "probes")}
    for part, header in headers.items():
        write_raw(NAME, f"raw_{part}.csv", header, [r[1:] for r in raw if r[0] == part], results_root)
    return rows


def plot(results_root: str | None = None, out_dir: str = "paper/figures"):
    """``master.png``: ops/s per subject, op, batch and API (log scale; Mooncake's bar, its own calls, beside both
    APIs' groups); restart time against objects."""
    import numpy as np

    import pandas as pd

    from experiments.plotstyle import BASELINE, OURS, PALETTE, figure, save, style_axes
    from quillcache.results import read_summary

    df = read_summary(NAME, results_root)
    fig, (ax1, ax2) = figure(11.0, 3.8, ncols=2)
    ops = df[df["metric"] == "ops_per_s"]
    subjects = [(EMB_MEM, "QuillCache embedded, no log", PALETTE[5]), (EMB_LOG, "QuillCache embedded, log", OURS),
                (RPC, "QuillCache server (RPC, plain TCP)", PALETTE[2]),
                (RPC_ZMQ, "QuillCache server (RPC, ZeroMQ)", PALETTE[4]), (MOONCAKE, "Mooncake master", BASELINE)]
    subjects = [s for s in subjects if (ops["subject"] == s[0]).any()]
    # one group per (op, batch, api); Mooncake's own calls (no api) stand in every group of their op and batch,
    # the baseline of both APIs
    # (results written before both APIs were measured have no api column: their rows are the objects API)
    api = ops["api"] if "api" in ops.columns else pd.Series(np.nan, index=ops.index)
    ops = ops.assign(api=api.where(ops["subject"] == MOONCAKE, api.fillna("objects")).fillna(""))
    have = set(zip(ops["op"], ops["batch"].astype(int), ops["api"]))
    cells = [(op, b, a) for op in OPS for b in sorted({int(x) for x in ops["batch"]}) for a in ("objects", "columns")
             if (op, b, a) in have]
    x = np.arange(len(cells))
    w = 0.8 / max(1, len(subjects))
    for i, (subject, label, colour) in enumerate(subjects):
        sub = ops[ops["subject"] == subject]
        sub = sub.assign(api=sub["api"].replace("", "*")).set_index(["op", "batch", "api"])
        keys = [(o, b, a) if (o, b, a) in sub.index else (o, b, "*") for o, b, a in cells]
        vals = [float(sub.loc[k, "value"]) if k in sub.index else np.nan for k in keys]
        lo = [v - float(sub.loc[k, "p10"]) if k in sub.index else 0 for v, k in zip(vals, keys)]
        hi = [float(sub.loc[k, "p90"]) - v if k in sub.index else 0 for v, k in zip(vals, keys)]
        ax1.bar(x + (i - (len(subjects) - 1) / 2) * w, vals, w, label=label, color=colour,
                yerr=np.clip(np.nan_to_num([lo, hi]), 0, None), capsize=1.5)
    ax1.set_yscale("log")
    ax1.set_xticks(x)
    short = {"get_replicas": "get repl."}
    ax1.set_xticklabels([f"{short.get(o, o)}\nx{b}" + (f"\n{a}" if b > 1 and o in COLUMN_OPS else "")
                         for o, b, a in cells], fontsize=6.5)
    style_axes(ax1, ylabel="objects per second (median, p10-p90)", title="Metadata operations")
    ax1.legend(fontsize=6.5, frameon=False, loc="upper left")
    rs = df[df["metric"] == "restart_s"]
    styles = {("in-process", "clean"): ("-", "o"), ("in-process", "sigkill"): ("--", "s"),
              ("process", "clean"): ("-", "^"), ("process", "sigkill"): ("--", "v")}
    for (start, state), (ls, mark) in styles.items():
        part = rs[(rs["start"] == start) & (rs["state"] == state)].sort_values("objects")
        if len(part):
            ax2.errorbar(part["objects"], part["value"], yerr=np.clip([part["value"] - part["p10"],
                                                                       part["p90"] - part["value"]], 0, None),
                         ls=ls, marker=mark, color=OURS if start == "in-process" else PALETTE[2], capsize=2,
                         label=f"{'MasterService' if start == 'in-process' else 'server process'}, {state}")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    style_axes(ax2, xlabel="objects", ylabel="seconds to serving (median)", title="Restart time")
    ax2.legend(fontsize=6.5, frameon=False)
    return save(fig, Path(out_dir) / "master.png")


def main(argv: list[str] | None = None) -> None:
    bench_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
