"""Master HA through a real etcd (``etcd_fixture``; skipped, saying how to get etcd, when there is none):
several ``python -m quillcache.master --etcd ...`` processes; a leader SIGKILL → a standby serves within
2×TTL with no acknowledged object lost while clients following the leader retry on their own; a leader
SIGSTOPped across an election commits nothing once resumed (and its fenced write is STALE_EPOCH); etcd
down at start → clear errors and retries, then service; a standby too far behind the trimmed log fetches
the leader's snapshot."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from etcd_fixture import etcd, etcd_client, prefix, require_etcd  # noqa: F401
from polling import wait_until

from quillcache.cluster.etcd import EtcdProcess, free_port
from quillcache.master import (MasterConfig, NotLeaderError, ReplicaConfig, SegmentDescriptor, StaleEpochError)
from quillcache.master.client import MasterClient
from quillcache.rpc import RpcTimeoutError

ROOT = Path(__file__).resolve().parents[1]
TTL_S = 2  # etcd's smallest lease


class Master:
    """One HA master process; ``close()`` always kills it."""

    def __init__(self, endpoint: str, prefix: str, data_dir: Path, cid: str, *extra: str, wait: bool = True) -> None:
        self.cid = cid
        self.err_path = Path(f"{data_dir}.stderr")
        self.err = open(self.err_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "quillcache.master", "--data-dir", str(data_dir), "--etcd", endpoint,
             "--name", "m", "--candidate", cid, "--ttl-s", str(TTL_S), "--prefix", prefix, "--tick-s", "0.2", *extra],
            stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        self.info: dict | None = None
        if wait:
            self.read_info(60)

    def read_info(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise AssertionError(f"{self.cid} printed no JSON line in {timeout_s} s; stderr:\n{self.stderr()[-3000:]}")
        self.info = json.loads(line)
        return self.info

    @property
    def address(self) -> str:
        assert self.info is not None
        return self.info["address"]

    def status(self, timeout_s: float = 1.0) -> dict | None:
        try:
            with MasterClient(self.address, timeout_s=timeout_s, retry_s=0) as c:
                return c.master_status()
        except RpcTimeoutError:
            return None

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.err.close()


def seg(node: str, seg_id: int) -> SegmentDescriptor:
    return SegmentDescriptor(node_id=node, segment_id=seg_id, capacity_bytes=1 << 30)


def leader_of(masters: list[Master], exclude: Master | None = None) -> Master | None:
    for m in masters:
        if m is not exclude and m.proc.poll() is None and (s := m.status(0.5)) is not None and s["role"] == "leader":
            return m
    return None


@pytest.fixture
def cluster(etcd, prefix, tmp_path):  # noqa: F811
    started: list[Master] = []

    def start(cid: str, *extra: str, wait: bool = True) -> Master:
        m = Master(etcd.endpoint, prefix, tmp_path / cid, cid, *extra, wait=wait)
        started.append(m)
        return m

    try:
        yield start
    finally:
        for m in started:
            m.close()


class Writer(threading.Thread):
    """put_start + put_end in a loop through a client that follows the leader; ``acked`` = put_end returned."""

    def __init__(self, etcd_endpoint: str, prefix: str, tag: str) -> None:
        super().__init__(daemon=True)
        self.client = MasterClient(etcd=etcd_endpoint, name="m", prefix=prefix, timeout_s=0.5, retry_s=20)
        self.tag = tag
        self.acked: list[str] = []
        self.unknown = 0
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            key = f"{self.tag}-{i}"
            i += 1
            try:
                r = self.client.put_start(key, 100, ReplicaConfig(replica_num=2))
                self.client.put_end(key, put_id=r.put_id)
                self.acked.append(key)
            except RpcTimeoutError:  # a write sent to the dead leader: it may or may not have run
                self.unknown += 1

    def finish(self) -> list[str]:
        self.stop.set()
        self.join(30)
        self.client.close()
        return self.acked


def test_leader_sigkill_standby_serves_within_two_ttls_nothing_lost(etcd, prefix, cluster):  # noqa: F811
    a = cluster("a")
    assert a.info["role"] == "leader"
    b, c = cluster("b"), cluster("c")
    assert b.info["role"] == c.info["role"] == "standby"
    with MasterClient(etcd=etcd.endpoint, name="m", prefix=prefix, timeout_s=0.5, retry_s=20) as admin:
        admin.mount_segment(seg("n0", 0))
        admin.mount_segment(seg("n1", 1))
    writer = Writer(etcd.endpoint, prefix, "w")
    reader_errors: list[BaseException] = []
    reads = [0]
    stop_reading = threading.Event()

    def read_loop() -> None:  # a client following the leader: reads retry on their own across the failover
        with MasterClient(etcd=etcd.endpoint, name="m", prefix=prefix, timeout_s=0.5, retry_s=20) as r:
            while not stop_reading.is_set():
                keys = list(writer.acked[-20:])
                try:
                    got = r.exists(keys)
                    assert got == [True] * len(keys), got
                    reads[0] += 1
                except Exception as e:  # noqa: BLE001 - the test reports any
                    reader_errors.append(e)

    reader = threading.Thread(target=read_loop, daemon=True)
    try:
        writer.start()
        reader.start()
        wait_until(lambda: len(writer.acked) >= 50, 30, "50 acknowledged puts through the leader")
        a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        new = wait_until(lambda: leader_of([b, c], exclude=a), 4 * TTL_S, "a standby leads")
        failover_s = time.monotonic() - killed
        n_before = len(writer.acked)
        wait_until(lambda: len(writer.acked) >= n_before + 30, 20, "puts acknowledged by the new leader")
    finally:
        acked = writer.finish()
        stop_reading.set()
        reader.join(30)
    print(f"leader SIGKILL -> standby serving: {failover_s:.2f} s (TTL {TTL_S} s); {len(acked)} acked puts, "
          f"{writer.unknown} unacknowledged, {reads[0]} reads")
    assert failover_s <= 2 * TTL_S
    assert not reader_errors, reader_errors[:3]
    with MasterClient(new.address, timeout_s=5) as cl:
        assert cl.exists(acked) == [True] * len(acked)  # 0 acknowledged objects lost
        lsn = cl.master_status()["lsn"]
    other = c if new is b else b
    wait_until(lambda: (s := other.status()) is not None and s["lsn"] == lsn, 10, "the other standby follows")
    # the leader record names the plain-TCP address the leader serves (MasterClient through etcd goes there)
    assert other.status()["role"] == "standby" and other.status()["leader"] == new.info["stream_address"]


@pytest.mark.parametrize("transport", ["stream", "zmq"])
def test_leader_paused_across_an_election_commits_nothing(etcd, prefix, cluster, transport):  # noqa: F811
    a = cluster("a")
    b = cluster("b")
    assert a.info["role"] == "leader" and b.info["role"] == "standby"
    # talks to the old leader only, over the transport under test
    pinned = MasterClient(a.address, timeout_s=15, retry_s=0, prefer_stream=transport == "stream")
    try:
        pinned.mount_segment(seg("n0", 0))
        assert pinned.address.startswith("qtcp://" if transport == "stream" else "tcp://"), pinned.address
        r = pinned.put_start("before", 10)
        pinned.put_end("before", put_id=r.put_id)
        a.proc.send_signal(signal.SIGSTOP)
        new = wait_until(lambda: leader_of([b]), 6 * TTL_S, "b leads while a is stopped")
        with MasterClient(new.address, timeout_s=5) as nb:
            r = nb.put_start("after", 10)
            nb.put_end("after", put_id=r.put_id)
        outcome: list[BaseException] = []

        def stale_write() -> None:
            try:
                pinned.put_start("stale", 10)
                pinned.put_end("stale")
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)

        t = threading.Thread(target=stale_write)
        t.start()  # queued at the stopped process
        time.sleep(0.2)
        a.proc.send_signal(signal.SIGCONT)
        t.join(30)
        assert outcome and isinstance(outcome[0], (NotLeaderError, StaleEpochError)), outcome
        print(f"the resumed leader's write: {outcome[0]!r}")
        with MasterClient(new.address, timeout_s=5) as nb:
            assert nb.exists(["before", "after", "stale"]) == [True, True, False]
        # the old leader rejoins as a standby and follows the new one
        wait_until(lambda: (s := a.status()) is not None and s["role"] == "standby" and s["objects"] == 2, 15,
                   "the old leader follows the new one")
    finally:
        a.proc.send_signal(signal.SIGCONT)
        pinned.close()


class _StaleBelief:
    """An election that still believes it leads (a resumed process before it looked at its clock)."""

    is_leader = True

    def __init__(self, election) -> None:
        self._el = election

    def __getattr__(self, name):
        return getattr(self._el, name)


def test_a_deposed_leader_that_believes_it_leads_is_fenced(etcd, etcd_client, prefix, cluster, tmp_path):  # noqa: F811
    from quillcache.master.ha import HaMaster
    from quillcache.master.server import MasterEndpoint

    old = HaMaster(str(tmp_path / "old"), MasterConfig(), etcd=etcd.endpoint, name="m", candidate="old",
                   ttl_s=TTL_S, prefix=prefix)
    try:
        assert old.start("127.0.0.1:1")
        assert old.wait_decided(30) == "leader"
        ep = MasterEndpoint(old)
        ep.mount_segment(seg("n0", 0))
        r = ep.put_start("committed", 10)
        ep.put_end("committed", put_id=r.put_id)
        new = cluster("new")
        assert new.info["role"] == "standby"
        lease = old.election._keeper.lease_id
        old.election = _StaleBelief(old.election)
        etcd_client.revoke(lease)  # its key goes, as when a paused leader's lease expires
        wait_until(lambda: leader_of([new]), 4 * TTL_S, "the standby leads")
        with pytest.raises(StaleEpochError, match="fenced"):
            ep.put_start("stale", 10)  # admitted (it believes it leads): the etcd fence refuses the commit
        with MasterClient(new.address, timeout_s=5) as nc:
            assert nc.exists(["committed", "stale"]) == [True, False]
            r = nc.put_start("next", 10)
            nc.put_end("next", put_id=r.put_id)
        assert old.role == "standby"  # reopened from its data dir: the refused record is gone from memory too
        wait_until(lambda: old.service.exists(["next", "stale"]) == [True, False], 10, "the deposed master follows")
    finally:
        old.close()


def test_etcd_down_at_start_is_a_clear_error_then_service(tmp_path, prefix):  # noqa: F811
    require_etcd()
    port = free_port()
    m = Master(f"127.0.0.1:{port}", prefix, tmp_path / "m", "lonely", wait=False)
    proc = None
    try:
        wait_until(lambda: m.stderr().count("not reachable") >= 2, 15, "repeated clear errors")
        assert m.proc.poll() is None  # no crash
        ready, _, _ = select.select([m.proc.stdout], [], [], 0)
        assert not ready  # not serving yet: it prints its line once it stands by or leads
        proc = EtcdProcess(client_port=port, data_dir=tmp_path / "etcd").start()
        info = m.read_info(30)
        assert info["role"] == "leader"
        err = m.stderr()
        assert f"127.0.0.1:{port}" in err and "retrying" in err and "Traceback" not in err
        with MasterClient(m.address, timeout_s=5) as c:
            c.mount_segment(seg("n0", 0))
        m.proc.send_signal(signal.SIGTERM)  # a clean stop: resigns, snapshots, exits 0
        assert m.proc.wait(20) == 0 and "Traceback" not in m.stderr()
    finally:
        m.close()
        if proc is not None:
            proc.stop()


def test_a_standby_behind_the_trimmed_log_fetches_the_snapshot(etcd, etcd_client, prefix, cluster):  # noqa: F811
    small = ("--snapshot-every-records", "30", "--restart-budget-s", "0", "--log-margin", "5")
    a = cluster("a", *small)
    assert a.info["role"] == "leader"
    keys = [f"k{i}" for i in range(60)]
    with MasterClient(a.address, timeout_s=5) as c:
        c.mount_segment(seg("n0", 0))
        for k in keys:
            r = c.put_start(k, 10)
            c.put_end(k, put_id=r.put_id)
        lsn = c.master_status()["lsn"]

    def oldest_log_group() -> int:
        log_keys = [kv.key for kv in etcd_client.get_prefix(f"{prefix}/master/m/log/")[0]]
        return int(log_keys[0].rsplit("/", 3)[-3])

    # the trim follows the snapshot, which a forked child writes in the background: poll for it
    wait_until(lambda: oldest_log_group() > 1, 15, "the leader trimmed its log in etcd")
    late = cluster("late", *small)  # an empty data dir: lsn 0 is older than the oldest log group
    assert late.info["role"] == "standby"
    wait_until(lambda: (s := late.status()) is not None and s["lsn"] >= lsn, 15, "the late standby catches up")
    assert "snapshot" in late.stderr()
    a.proc.send_signal(signal.SIGKILL)
    wait_until(lambda: leader_of([late]), 4 * TTL_S, "the late standby leads")
    with MasterClient(late.address, timeout_s=5) as c:
        assert c.exists(keys) == [True] * len(keys)
