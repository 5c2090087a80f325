"""The master served over the network: a real server process (``python -m quillcache.master``), every
operation and its batch form through ``MasterClient``, typed errors arriving typed, malformed frames from raw
zmq, a restart over the same data dir (clean and SIGKILL) keeping every completed object, the embedded client,
and the CLI. The single-key round-trip rate is printed (a study number, never asserted)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from quillcache.master import (InvalidParamsError, LeaseHeldError, MasterConfig, MasterService, NeedRemountError,
                               NoSpaceError, ObjectExistsError, ObjectInfo, ObjectNotFoundError, ObjectNotReadyError,
                               ObjectStatus, PinKind, PutRequest, PutStartResult, ReplicaConfig, ReplicaDescriptor,
                               SegmentDescriptor, SegmentExistsError, SegmentNotFoundError)
from quillcache.master.client import MasterClient
from quillcache.rpc import RpcErrorCode, RpcRejectedError, RpcTimeoutError

ROOT = Path(__file__).resolve().parents[1]
SEG_BYTES = 1 << 20


class Server:
    """One ``python -m quillcache.master`` process; always killed by ``close()``."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.err = open(f"{data_dir}.stderr", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "quillcache.master", "--data-dir", str(data_dir), *extra],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"the master printed no JSON line; stderr: {Path(self.err.name).read_text()[-2000:]}")
        self.info = json.loads(line)
        self.address = self.info["address"]

    def terminate(self, timeout_s: float = 20.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.err.close()


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "master")
    try:
        yield s
    finally:
        s.close()


def seg(node: str, seg_id: int, cap: int = SEG_BYTES) -> SegmentDescriptor:
    return SegmentDescriptor(node_id=node, segment_id=seg_id, capacity_bytes=cap, endpoint=f"127.0.0.1:{7000 + seg_id}")


def mount_three(c: MasterClient) -> None:
    for i, node in enumerate("abc"):
        c.mount_segment(seg(node, i))


def test_json_line_and_every_operation_with_its_batch_form(server):
    assert server.info["role"] == "single" and server.info["pid"] == server.proc.pid
    assert server.address.startswith("tcp://127.0.0.1:") and server.info["epoch"] >= 1
    with MasterClient(server.address, timeout_s=5) as c:
        mount_three(c)
        assert sorted(s.segment_id for s in c.segments()) == [0, 1, 2] and c.clients() == ["a", "b", "c"]
        c.heartbeat("a")
        # single-key put
        r = c.put_start("k1", 1000, ReplicaConfig(replica_num=2), pin=PinKind.SOFT, digest=b"d1", client_id="a")
        assert isinstance(r, PutStartResult) and len(r.replicas) == 2 and not r.existing
        assert all(isinstance(d, ReplicaDescriptor) for d in r.replicas)
        assert len({d.node_id for d in r.replicas}) == 2
        assert c.put_start("k1", 1000, digest=b"d1").existing  # same digest while in flight: the same object
        assert c.exists(["k1"]) == [False]
        c.put_end("k1", put_id=r.put_id)
        assert c.exist_key("k1") and c.get_replica_list("k1") == r.replicas
        info = c.object_info("k1")
        assert isinstance(info, ObjectInfo) and info.status is ObjectStatus.COMPLETE and info.pin is PinKind.SOFT
        # batch put
        reqs = [PutRequest(key=f"b{i}", size_bytes=100 + i, config=ReplicaConfig(replica_num=3)) for i in range(5)]
        started = c.batch_put_start(reqs, client_id="b")
        assert all(isinstance(x, PutStartResult) and len(x.replicas) == 3 for x in started)
        assert c.batch_put_end(["b0", "b1", "b2", "nope"], put_ids=[started[0].put_id, None, None, None])[:3] == \
            [None, None, None]
        assert c.batch_put_revoke(["b3", "b4"]) == [None, None]
        assert c.exists(["b0", "b1", "b2", "b3", "b4"]) == [True, True, True, False, False]
        # single revoke
        r2 = c.put_start("gone", 10)
        c.put_revoke("gone", put_id=r2.put_id)
        assert not c.exist_key("gone")
        # batch reads: values and typed per-key errors
        got = c.get_replicas(["k1", "b0", "missing"])
        assert got[0] == r.replicas and len(got[1]) == 3 and isinstance(got[2], ObjectNotFoundError)
        # remove: leased (get_replicas granted a lease) unless forced
        with pytest.raises(LeaseHeldError, match="b0"):
            c.remove("b0")
        c.remove("b0", force=True)
        assert c.batch_remove(["b1", "b2", "missing"], force=True)[:2] == [None, None]
        assert set(c.keys()) == {"k1"}
        used, cap = c.segment_usage(r.replicas[0].segment_id)
        assert used > 0 and cap == SEG_BYTES
        assert c.evict(0) == [] and c.tick().expired_clients == ()
        st = c.stats()
        assert st.num_objects == 1 and st.num_segments == 3 and st.lsn > 0
        c.unmount_segment(2, client_id="c")
        assert sorted(s.segment_id for s in c.segments()) == [0, 1]
        status = c.master_status()
        assert status["role"] == "single" and status["lsn"] == c.stats().lsn
        blob = c.snapshot_bytes()
        assert isinstance(blob, bytes) and blob.startswith(b"QCMSNAP1")


def test_typed_errors_arrive_typed(server):
    with MasterClient(server.address, timeout_s=5) as c:
        mount_three(c)
        with pytest.raises(SegmentExistsError, match="segment 0 is already mounted"):
            c.mount_segment(seg("z", 0))
        with pytest.raises(SegmentNotFoundError, match="99"):
            c.unmount_segment(99)
        with pytest.raises(ObjectNotFoundError, match="'nope'"):
            c.get_replica_list("nope")
        with pytest.raises(ObjectNotFoundError):
            c.put_end("nope")
        with pytest.raises(InvalidParamsError, match="size_bytes=0"):
            c.put_start("z", 0)
        with pytest.raises(InvalidParamsError, match="size_bytes=-3"):
            c.put_start("z", -3)
        with pytest.raises(NoSpaceError, match="larger than every segment"):
            c.put_start("huge", 4 * SEG_BYTES)
        with pytest.raises(NeedRemountError, match="'ghost'"):
            c.put_start("z", 10, client_id="ghost")
        with pytest.raises(NeedRemountError):
            c.heartbeat("ghost")
        r = c.put_start("p", 10, ReplicaConfig(replica_num=9))  # more replicas than nodes: best effort
        assert len(r.replicas) == 3
        with pytest.raises(ObjectNotReadyError):
            c.get_replica_list("p")
        with pytest.raises(ObjectExistsError, match="being written"):
            c.put_start("p", 10)
        out = c.exists(["p", 7])
        assert out[0] is False and isinstance(out[1], InvalidParamsError)
        # malformed values from the network: typed refusals, never a dead server
        with pytest.raises(InvalidParamsError, match="keys must be a list"):
            c.call("get_replicas", "abc")
        assert all(isinstance(x, InvalidParamsError) for x in c.batch_put_start([1, "x"]))  # per item
        with pytest.raises(InvalidParamsError):
            c.call("put_start", "q", "ten")
        with pytest.raises(InvalidParamsError):
            c.call("mount_segment", "not a segment")
        with pytest.raises(RpcRejectedError) as e:
            c.call("put_start", "q", 1, 2, 3, 4, 5)
        assert e.value.code is RpcErrorCode.BAD_ARGUMENTS
        with pytest.raises(RpcRejectedError) as e:
            c.call("check_invariants")
        assert e.value.code is RpcErrorCode.UNKNOWN_METHOD
        assert c.exist_key("p") is False  # still serving


def test_malformed_frames_from_raw_zmq_do_not_hurt(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(server.address)
    try:
        garbage = [b"", b"\xff\xfe\x00garbage", msgpack.packb({"a": 1}), msgpack.packb([99, 1, "stats", [], {}]),
                   msgpack.packb([1, "id", "stats", [], {}]), msgpack.packb([1, 7, "stats"]),
                   msgpack.packb([1, 8, "stats", "notalist", {}]), msgpack.packb([1, 9, "put_start", ["k", 1], {1: 2}]),
                   os.urandom(4096)]
        for frame in garbage:
            sock.send(frame)
            reply = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
            assert reply[2] is False, (frame[:40], reply)  # an error reply, never a crash
        sock.send_multipart([b"two", b"frames"])
        reply = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
        assert reply[2] is False and "one frame" in str(reply[3])
    finally:
        sock.close()
        ctx.term()
    assert server.proc.poll() is None
    with MasterClient(server.address, timeout_s=5) as c:
        assert c.stats().num_objects == 0


def test_restart_keeps_every_completed_object(tmp_path):
    data = tmp_path / "m"
    first = Server(data)
    expected: dict[str, tuple] = {}
    try:
        with MasterClient(first.address, timeout_s=5) as c:
            mount_three(c)
            for i in range(40):
                r = c.put_start(f"k{i}", 500 + i, ReplicaConfig(replica_num=1 + i % 3))
                c.put_end(f"k{i}", put_id=r.put_id)
                expected[f"k{i}"] = r.replicas
            c.put_start("inflight", 64)  # never ended: never visible after the restart
            c.remove("k0", force=True)
            del expected["k0"]
        assert first.terminate() == 0  # SIGTERM: a clean stop (snapshot)
    finally:
        first.close()
    second = Server(data)
    try:
        with MasterClient(second.address, timeout_s=5) as c:
            assert set(c.keys()) == set(expected) | {"inflight"}
            assert c.get_replicas(list(expected)) == list(expected.values())
            assert c.exists(["inflight", "k0"]) == [False, False]
            for i in range(40, 60):  # then more, and a SIGKILL: the log tail keeps them
                r = c.put_start(f"k{i}", 100)
                c.put_end(f"k{i}")
                expected[f"k{i}"] = r.replicas
        second.proc.send_signal(signal.SIGKILL)
        second.proc.wait()
    finally:
        second.close()
    third = Server(data)
    try:
        with MasterClient(third.address, timeout_s=5) as c:
            assert c.get_replicas(list(expected)) == list(expected.values())
            assert len(c.segments()) == 3
    finally:
        third.close()


def test_single_key_round_trips_are_printed(server):
    """A study number (experiments/master_study.py measures it properly): printed, not asserted."""
    with MasterClient(server.address, timeout_s=5) as c:
        mount_three(c)
        c.put_start("k", 100)
        c.put_end("k")
        for _ in range(200):
            c.exist_key("k")
        rates = {}
        for name, call in (("exists", lambda: c.exists(["k"])), ("get_replicas", lambda: c.get_replicas(["k"]))):
            n = 2000
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            rates[name] = n / (time.perf_counter() - t0)
        print("single-key round trips/s from one client: "
              + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items()))


def _wait_stopped(pid: int, deadline_s: float = 10.0) -> None:
    """Poll until every thread of ``pid`` is stopped (state T in /proc)."""
    end = time.monotonic() + deadline_s
    while True:
        states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for t in os.listdir(f"/proc/{pid}/task")]
        if all(st in "Tt" for st in states):
            return
        assert time.monotonic() < end, f"process {pid} did not stop: thread states {states}"
        time.sleep(0.001)


def test_timeout_is_typed_and_a_dead_server_is_not_fatal(tmp_path):
    s = Server(tmp_path / "m")
    try:
        with MasterClient(s.address, timeout_s=0.3, retry_s=0.5) as c:
            assert c.stats().num_objects == 0
            s.proc.send_signal(signal.SIGSTOP)
            _wait_stopped(s.proc.pid)  # a thread polling its socket can answer in the microseconds a stop takes
            with pytest.raises(RpcTimeoutError):
                c.stats()
            s.proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 10
            while True:
                try:
                    assert c.stats().num_objects == 0
                    break
                except RpcTimeoutError:
                    assert time.monotonic() < deadline
    finally:
        s.proc.send_signal(signal.SIGCONT)
        s.close()


def test_embedded_client_has_the_same_api_and_errors(tmp_path):
    with MasterService(MasterConfig(), data_dir=tmp_path / "e") as svc:
        c = MasterClient.embedded(svc)
        mount_three(c)
        r = c.put_start("k", 100, ReplicaConfig(replica_num=2))
        c.put_end("k", put_id=r.put_id)
        assert c.get_replicas(["k", "x"])[0] == r.replicas
        assert isinstance(c.get_replicas(["x"])[0], ObjectNotFoundError)
        assert c.batch_put_end(["x"])[0].code.name == "OBJECT_NOT_FOUND"
        with pytest.raises(InvalidParamsError):
            c.put_start("z", 0)
        assert c.master_status()["role"] == "single"
        c.close()


def test_cli_registers_the_master_command(tmp_path):
    from quillcache.cli import COMMANDS

    assert "master" in COMMANDS
    out = subprocess.run([sys.executable, "-m", "quillcache", "master", "--help"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0 and "--data-dir" in out.stdout and "--etcd" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "quillcache.master", "--data-dir", str(tmp_path), "--port", "70000"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--port" in bad.stderr and "Traceback" not in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "quillcache.master", "--data-dir", str(tmp_path), "--candidate", "x"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--etcd" in bad.stderr


def test_quillcache_master_serves_like_python_m(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "quillcache", "master", "--data-dir", str(tmp_path / "m")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        info = json.loads(proc.stdout.readline())
        assert info["role"] == "single"
        with MasterClient(info["address"], timeout_s=5) as c:
            assert c.stats().num_objects == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_compact_forms_on_the_wire_and_the_fallback_to_plain_methods(server, tmp_path):
    """MasterClient's reads and puts travel in the compact forms (native msgpack arrays: segment rows named
    once) and come back as the plain methods' values; bad compact rows are per-row typed errors; a server
    that does not serve the compact forms (UNKNOWN_METHOD) gets the plain methods, with the same values."""
    from quillcache.master.server import MasterEndpoint, SingleMaster
    from quillcache.master.wire import COMPACT_METHODS, NODE_METHODS, SERVICE_METHODS
    from quillcache.rpc import InProcessClient

    with MasterClient(server.address, timeout_s=5) as c:
        mount_three(c)
        reqs = [PutRequest(key=f"c{i}", size_bytes=1 + i, config=ReplicaConfig(replica_num=1 + i % 3)) for i in range(9)]
        started = c.batch_put_start(reqs)
        c.batch_put_end([r.key for r in reqs])
        segs, rows = c.call("get_replicas_compact", ["c4", "nope"])
        assert [s[0] for s in segs] == sorted({d.segment_id for d in started[4].replicas})
        assert rows[0][0] == 5 and len(rows[0]) == 1 + 2 * len(started[4].replicas)
        assert c.get_replicas(["c4", "nope"])[0] == started[4].replicas
        assert c.get_replica_list("c8") == started[8].replicas
        _, bad = c.call("batch_put_start_compact", [["x", 1], ["y", 1, 1, None, 7, None], "z", ["ok", 5, 1, None, 0, None]])
        assert [b.code.name for b in bad[:3]] == ["INVALID_PARAMS"] * 3 and bad[3][:3] == [started[-1].put_id + 1, False, 5]
        with pytest.raises(InvalidParamsError, match="rows must be a list"):
            c.call("batch_put_start_compact", "abc")
    with MasterService(MasterConfig(), data_dir=tmp_path / "plain") as svc:
        served = [m for m in (*SERVICE_METHODS, *NODE_METHODS) if m not in COMPACT_METHODS]
        old = MasterClient(_rpc=InProcessClient(MasterEndpoint(SingleMaster(svc)), served))
        mount_three(old)
        r = old.put_start("k", 10, ReplicaConfig(replica_num=2))
        assert not old._compact and len(r.replicas) == 2
        old.put_end("k")
        assert old.get_replicas(["k"]) == [r.replicas] and old.get_replica_list("k") == r.replicas


# --- the plain-TCP transport (qtcp://) ---------------------------------------------------------------


def _stream_exchange(sock, body: bytes) -> list:
    sock.sendall(len(body).to_bytes(4, "big") + body)
    head = _recv_exact(sock, 4)
    return msgpack.unpackb(_recv_exact(sock, int.from_bytes(head, "big")), raw=False, strict_map_key=False)


def _recv_exact(sock, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def test_both_transports_are_served_and_the_client_prefers_plain_tcp(server, tmp_path):
    stream = server.info["stream_address"]
    assert stream.startswith("qtcp://127.0.0.1:") and server.address.startswith("tcp://")
    with MasterClient(server.address, timeout_s=5) as c, \
            MasterClient(server.address, timeout_s=5, prefer_stream=False) as z:
        mount_three(c)
        assert c.address == stream and z.stats().num_objects == 0 and z.address == server.address
        r = c.put_start("k", 100, ReplicaConfig(replica_num=2))
        with pytest.raises(ObjectNotReadyError):
            z.get_replica_list("k")  # the same master behind both transports
        c.put_end("k", put_id=r.put_id)
        assert z.get_replica_list("k") == c.get_replica_list("k") == r.replicas
        assert c.master_status()["stream_address"] == stream
        with pytest.raises(ObjectNotFoundError):
            c.put_end("missing")
        with pytest.raises(InvalidParamsError):
            c.put_start("bad", -1)
    with MasterClient(stream, timeout_s=5) as direct:  # a qtcp:// address is used as it is
        assert direct.exists(["k", "nope"]) == [True, False] and direct.address == stream
    zmq_only = Server(tmp_path / "zmq-only", "--no-stream")
    try:
        assert zmq_only.info["stream_address"] is None
        with MasterClient(zmq_only.address, timeout_s=5) as c:
            mount_three(c)
            assert c.exists(["k"]) == [False] and c.address == zmq_only.address  # stays on ZeroMQ
    finally:
        zmq_only.close()


def test_malformed_frames_on_the_plain_tcp_transport_do_not_hurt(server):
    import socket

    host, port = server.info["stream_address"].removeprefix("qtcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        garbage = [b"", b"\xff\xfe\x00garbage", msgpack.packb({"a": 1}), msgpack.packb([99, 1, "stats", [], {}]),
                   msgpack.packb([1, "id", "stats", [], {}]), msgpack.packb([1, 7, "stats"]),
                   msgpack.packb([1, 8, "stats", "notalist", {}]), msgpack.packb([1, 9, "put_start", ["k", 1], {1: 2}]),
                   msgpack.packb([1, 10, "put_start", ["k", "big"], {}]), msgpack.packb([1, 11, "_secret", [], {}]),
                   os.urandom(4096)]
        for frame in garbage:
            reply = _stream_exchange(sock, frame)
            assert reply[2] is False and isinstance(reply[3]["message"], str), (frame[:40], reply)
        assert _stream_exchange(sock, msgpack.packb([1, 12, "keys", [], {}])) == [1, 12, True, []]
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # past the drop limit (4 x 64 MiB)
        sock.sendall((2**32 - 1).to_bytes(4, "big"))
        head = _recv_exact(sock, 4)
        reply = msgpack.unpackb(_recv_exact(sock, int.from_bytes(head, "big")), raw=False, strict_map_key=False)
        assert reply[2] is False and "drop limit" in reply[3]["message"] and sock.recv(1) == b""
    assert server.proc.poll() is None
    with MasterClient(server.address, timeout_s=5) as c:
        assert c.stats().num_objects == 0 and c.address.startswith("qtcp://")


def test_the_client_finds_the_plain_tcp_port_again_after_a_restart(tmp_path):
    from quillcache.cluster.etcd import free_port

    data, port = tmp_path / "m", free_port()
    first = Server(data, "--port", str(port))
    c = MasterClient(first.address, timeout_s=1, retry_s=30)
    try:
        mount_three(c)
        r = c.put_start("k", 10)
        c.put_end("k", put_id=r.put_id)
        old_stream = c.address
        assert old_stream == first.info["stream_address"]
        assert first.terminate() == 0
        first.close()
        other = next(p for p in iter(free_port, None) if not old_stream.endswith(f":{p}"))
        first = Server(data, "--port", str(port), "--stream-port", str(other))  # same ZeroMQ port, another stream one
        assert first.info["stream_address"] == f"qtcp://127.0.0.1:{other}"
        r = c.put_start("k2", 10)  # a write: its connection refused, so never sent: sent again through ZeroMQ,
        assert c.address == first.info["stream_address"]  # which names the new stream port
        c.put_end("k2", put_id=r.put_id)
        assert c.exists(["k", "k2"]) == [True, True]
    finally:
        c.close()
        first.close()


def test_the_plain_tcp_idle_timeout_is_a_flag(tmp_path):
    import socket

    bad = subprocess.run([sys.executable, "-m", "quillcache.master", "--data-dir", str(tmp_path / "bad"),
                          "--stream-idle-timeout-s", "0"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--stream-idle-timeout-s" in bad.stderr and "Traceback" not in bad.stderr
    s = Server(tmp_path / "m", "--stream-idle-timeout-s", "0.5")
    try:
        host, port = s.info["stream_address"].removeprefix("qtcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # says nothing: closed after 0.5 s
            head = _recv_exact(sock, 4)
            reply = msgpack.unpackb(_recv_exact(sock, int.from_bytes(head, "big")), raw=False,
                                    ext_hook=lambda c, d: msgpack.unpackb(d, raw=False))
            assert reply[1:3] == [None, False] and reply[3]["code"] == ["RpcErrorCode", "IDLE_TIMEOUT"]
            assert "idle_timeout_s=0.5 s" in reply[3]["message"] and sock.recv(1) == b""
        with MasterClient(s.address, timeout_s=5) as c:
            mount_three(c)
            assert c.address == s.info["stream_address"] and len(c.segments()) == 3
    finally:
        s.close()
