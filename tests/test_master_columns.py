"""The master's columnar batch forms over the RPC (``batch_put_start_columns``, ``get_replicas_columns``):
a real server process on free ports, both transports (plain TCP and ZeroMQ) and the embedded client
against twin in-process services fed the same operation sequence (Hypothesis: keys with repeats and bad
ones, sizes, replica counts, preferred segments, pins, digests, segments on several nodes); leases as
``get_replicas`` grants them (fake clock); malformed requests over raw connections (INVALID_PARAMS, the
server keeps serving); malformed replies decoded by the client (a protocol error, never a crash)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.master import (ErrorCode, InvalidParamsError, LeaseHeldError, MasterConfig, MasterService, PinKind,
                               PutRequest, ReplicaConfig, SegmentDescriptor)
from quillcache.master.client import MasterClient
from quillcache.master.columns import PutColumns, ReplicaColumns
from quillcache.master.wire import (PUT_FIELDS, REPLICA_FIELDS, decode_columns, decode_sizes, encode_columns,
                                    encode_sizes, register_master_types)
from quillcache.rpc import RpcProtocolError, StreamServer
from quillcache.rpc.codec import DEFAULT_CODEC

ROOT = Path(__file__).resolve().parents[1]
NODES = ("a", "b", "c", "d")
SEG_BYTES = 256 << 20  # far below the eviction watermark for everything the tests put


def segments() -> list[SegmentDescriptor]:
    """Two segments on each of four nodes, each with its own endpoint and region."""
    return [SegmentDescriptor(node_id=node, segment_id=2 * i + j, capacity_bytes=SEG_BYTES,
                              endpoint=f"10.0.0.{i}:{7000 + j}", transport="rdma" if j else "tcp", region_ids=(j + 1,))
            for i, node in enumerate(NODES) for j in range(2)]


class Server:
    """``python -m quillcache.master`` on free ports, no timer ticks (the twins never tick); stopped by ``close()``."""

    def __init__(self, data_dir: Path) -> None:
        self.err = open(f"{data_dir}.stderr", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "quillcache.master", "--data-dir", str(data_dir),
                                      "--port", "0", "--stream-port", "0", "--tick-s", "3600"],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=ROOT,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"the master printed no JSON line; stderr: {Path(self.err.name).read_text()[-2000:]}")
        self.info = json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.proc.stdout.close()
        self.err.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("columns") / "master")
    try:
        yield s
    finally:
        s.close()


# ------------------------------------------------------------------ equality helpers

_NUM = re.compile(r"\d+\.\d+")


def err_key(e: BaseException) -> tuple:
    """An error's class, code and message (clock readings in the message masked: each side has its own)."""
    return type(e), e.code, _NUM.sub("T", e.message)


def cols_key(c: PutColumns | ReplicaColumns) -> tuple:
    arrays = tuple(getattr(c, f).tolist() for f in (PUT_FIELDS if isinstance(c, PutColumns) else REPLICA_FIELDS))
    errors = tuple(sorted((i, err_key(e)) for i, e in c.errors.items()))
    return arrays, errors, tuple(sorted(c.segments.items()))


def outcome(fn, *args, **kwargs):
    """``fn``'s value, or ``err_key`` of the MasterError it raised."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - compared between the sides
        if not hasattr(e, "code"):
            raise
        return err_key(e)


def list_key(values: list) -> list:
    return [err_key(v) if isinstance(v, BaseException) else v for v in values]


# ------------------------------------------------------------------ RPC == embedded == service, to_list == plain

KEYS = st.one_of(st.sampled_from([f"k{i}" for i in range(40)]), st.sampled_from(["", 7, None, "x" * 5000]))
SIZES = st.one_of(st.integers(1, 1 << 16), st.sampled_from([0, -1, 1 << 40, 2**63 - 1]))
DIGESTS = st.one_of(st.none(), st.sampled_from([b"d1", b"d2"]))


@st.composite
def put_calls(draw) -> dict:
    n = draw(st.integers(0, 24))
    keys = draw(st.lists(KEYS, min_size=n, max_size=n))
    sizes = draw(st.lists(SIZES, min_size=n, max_size=n))
    digests = draw(st.one_of(st.none(), st.lists(DIGESTS, min_size=n, max_size=n)))
    return dict(keys=keys, sizes=sizes, replica_num=draw(st.integers(1, 5)),
                preferred_segment=draw(st.one_of(st.none(), st.integers(0, 8))),
                pin=draw(st.sampled_from(list(PinKind))), digests=digests,
                end=draw(st.lists(st.booleans(), min_size=n, max_size=n)),
                as_array=draw(st.booleans()), client_id=draw(st.sampled_from([None, "a", "nobody"])))


class Twins:
    """The server over plain TCP and over ZeroMQ, an embedded client, a columnar service and a plain
    service: every operation goes to all five in the same order, so they hold the same state."""

    def __init__(self, server: Server) -> None:
        self.tcp = MasterClient(server.info["stream_address"], timeout_s=10)
        self.zmq = MasterClient(server.info["address"], timeout_s=10, prefer_stream=False)
        self.emb_svc, self.col, self.plain = (MasterService(MasterConfig()) for _ in range(3))
        self.emb = MasterClient.embedded(self.emb_svc)
        for seg in segments():
            for m in (self.tcp, self.emb, self.col, self.plain):  # tcp and zmq share one server
                m.mount_segment(seg)
        self.remotes = (self.tcp, self.zmq)

    def close(self) -> None:
        for m in (self.tcp, self.zmq, self.emb):
            m.close()
        for s in (self.emb_svc, self.col, self.plain):
            s.close()


@pytest.fixture(scope="module")
def twins(server):
    t = Twins(server)
    try:
        yield t
    finally:
        t.close()


def _plain_requests(call: dict) -> list[PutRequest]:
    digests = call["digests"] or [None] * len(call["keys"])
    cfg = ReplicaConfig(replica_num=call["replica_num"], preferred_segment=call["preferred_segment"])
    return [PutRequest(key=k, size_bytes=s, config=cfg, pin=call["pin"], digest=d)
            for k, s, d in zip(call["keys"], call["sizes"], digests)]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(calls=st.lists(put_calls(), min_size=1, max_size=3), via_zmq=st.booleans())
def test_rpc_columns_equal_the_service_and_the_plain_methods(twins, calls, via_zmq):
    t = twins
    remote = t.zmq if via_zmq else t.tcp
    for call in calls:
        sizes = np.array(call["sizes"], dtype=np.int64) if call["as_array"] and call["sizes"] else call["sizes"]
        kw = dict(replica_num=call["replica_num"], preferred_segment=call["preferred_segment"], pin=call["pin"],
                  digests=call["digests"], client_id=call["client_id"])
        outcomes = [outcome(m.batch_put_start_columns, call["keys"], sizes, **kw) for m in (remote, t.emb, t.col)]
        outcomes.append(outcome(t.plain.batch_put_start, _plain_requests(call), client_id=call["client_id"]))
        if any(isinstance(o, tuple) for o in outcomes):  # refused as a whole (an unregistered client)
            assert len(set(outcomes)) == 1 and isinstance(outcomes[0], tuple), (call, outcomes)
            continue
        got, emb, ref, plain = outcomes
        got.check()
        assert cols_key(got) == cols_key(emb) == cols_key(ref), call
        assert list_key(got.to_list()) == list_key(ref.to_list()) == list_key(plain), call
        for i in range(len(got)):
            res = got.result(i)
            assert (err_key(res) if isinstance(res, BaseException) else res) == list_key([plain[i]])[0]
        ends = [k for k, e, r in zip(call["keys"], call["end"], plain) if e and not isinstance(r, BaseException)
                and not r.existing]
        for m in (remote, t.emb, t.col, t.plain):
            m.batch_put_end(ends)
        reads = list(call["keys"]) + ["never-put", 3]
        got_r = remote.get_replicas_columns(reads)
        emb_r, ref_r = t.emb.get_replicas_columns(reads), t.col.get_replicas_columns(reads)
        plain_r = t.plain.get_replicas(reads)
        got_r.check()
        assert cols_key(got_r) == cols_key(emb_r) == cols_key(ref_r), reads
        assert list_key(got_r.to_list()) == list_key(plain_r), reads


def test_whole_call_refusals_are_the_same_over_rpc_and_in_process(twins):
    for m in (twins.tcp, twins.zmq, twins.emb, twins.col):
        with pytest.raises(InvalidParamsError, match="keys but"):
            m.batch_put_start_columns(["p", "q"], [1])
        with pytest.raises(InvalidParamsError, match="digests"):
            m.batch_put_start_columns(["p"], [1], digests=[b"x", b"y"])
        with pytest.raises(InvalidParamsError, match="keys"):
            m.get_replicas_columns("abc")
    assert twins.tcp.exists(["p", "q"]) == [False, False]  # nothing was put


# ------------------------------------------------------------------ leases

def test_get_replicas_columns_grants_leases_as_get_replicas_does():
    now = [1000.0]
    cfg = MasterConfig(lease_ttl_s=5.0)
    a, b = MasterService(cfg, clock=lambda: now[0]), MasterService(cfg, clock=lambda: now[0])
    ca = MasterClient.embedded(a)
    for svc in (a, b):
        svc.mount_segment(segments()[0])
        svc.batch_put_start([PutRequest(key=k, size_bytes=100) for k in ("x", "y")])
        svc.batch_put_end(["x", "y"])
    now[0] += 1.0
    assert ca.get_replicas_columns(["x", "nope"]).to_list()[0] == b.get_replicas(["x", "nope"])[0]
    for svc in (a, b):
        info = svc.object_info("x")
        assert info.lease_end_s == 1006.0 and info.last_access_s == 1001.0
        assert svc.object_info("y").lease_end_s < 1001.0  # not read: no lease
        with pytest.raises(LeaseHeldError):
            svc.remove("x")
    now[0] += 5.5
    for svc in (a, b):
        svc.remove("x")  # the lease has run out
    ca.close()
    a.close()
    b.close()


# ------------------------------------------------------------------ malformed requests, raw connections

def _stream_call(sock, body: bytes) -> list:
    sock.sendall(len(body).to_bytes(4, "big") + body)
    n = int.from_bytes(_recv_exact(sock, 4), "big")
    return DEFAULT_CODEC.decode(_recv_exact(sock, n))


def _recv_exact(sock, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


BAD_REQUESTS = [
    ("batch_put_start_columns", [["a", "b"], b"\x01" * 12], {}, "not a whole number"),
    ("batch_put_start_columns", [["a"], "not sizes"], {}, "got str"),
    ("batch_put_start_columns", [["a"], {"x": 1}], {}, "got dict"),
    ("batch_put_start_columns", ["a", b"\x00" * 8], {}, "keys must be a list"),
    ("batch_put_start_columns", [["a", "b"], b"\x01" + b"\x00" * 7], {}, "2 keys but 1 sizes"),
    ("batch_put_start_columns", [["a"], [1, 2]], {}, "1 keys but 2 sizes"),
    ("batch_put_start_columns", [["a"], [1]], {"digests": b"d"}, "digests"),
    ("batch_put_start_columns", [["a"], [1]], {"digests": [b"d", None]}, "digests"),
    ("batch_put_start_columns", [], {"keys": ["a"], "sizes": 3}, "got int"),
    ("get_replicas_columns", ["k"], {}, "keys must be a list"),
    ("get_replicas_columns", [{"k": 1}], {}, "keys must be a list"),
]


def _check_refusal(reply: list, rid: int, match: str) -> None:
    assert reply[1] == rid and reply[2] is False, reply
    err = reply[3]
    assert err["code"] == ErrorCode.INVALID_PARAMS and "InvalidParamsError" in err["type"], err
    assert match in err["message"], (match, err["message"])


def test_malformed_requests_are_invalid_params_on_both_transports_and_the_server_keeps_serving(server):
    register_master_types()
    host, port = server.info["stream_address"].removeprefix("qtcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        for rid, (method, args, kwargs, match) in enumerate(BAD_REQUESTS):
            _check_refusal(_stream_call(sock, DEFAULT_CODEC.encode([1, rid, method, args, kwargs])), rid, match)
        ok = _stream_call(sock, DEFAULT_CODEC.encode([1, 99, "get_replicas_columns", [["nope"]], {}]))
        assert ok[2] is True and decode_columns(ok[3], put=False).errors[0].code == ErrorCode.OBJECT_NOT_FOUND
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(server.info["address"])
    try:
        for rid, (method, args, kwargs, match) in enumerate(BAD_REQUESTS):
            sock.send(DEFAULT_CODEC.encode([1, rid, method, args, kwargs]))
            _check_refusal(DEFAULT_CODEC.decode(sock.recv()), rid, match)
        sock.send(msgpack.packb([1, 5, "batch_put_start_columns", [["a"], b"\x01" * 8, 1, 2, 3, 4], {}]))
        reply = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
        assert reply[2] is False  # does not bind: the RPC layer's refusal
    finally:
        sock.close()
        ctx.term()
    assert server.proc.poll() is None
    with MasterClient(server.info["address"], timeout_s=10) as c:
        got = c.batch_put_start_columns(["after-garbage"], [10])
        assert not got.errors and c.batch_put_end(["after-garbage"]) == [None]
        assert c.get_replicas_columns(["after-garbage"]).sizes.tolist() == [10]


# ------------------------------------------------------------------ malformed replies

def _valid_put_reply() -> list:
    svc = MasterService(MasterConfig())
    for seg in segments()[:4]:
        svc.mount_segment(seg)
    cols = svc.batch_put_start_columns(["a", "b", "a", "", "c"], [10, 20, 30, 40, 50], replica_num=2)
    assert len(cols.errors) == 2
    svc.close()
    return encode_columns(cols)


def test_encode_then_decode_is_the_identity():
    reply = _valid_put_reply()
    cols = decode_columns(reply, put=True)
    cols.check()
    assert encode_columns(cols) == reply and not cols.counts.flags.writeable  # views of the reply's bytes
    assert decode_columns(DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(reply)), put=True).to_list() == cols.to_list()


JUNK = st.one_of(st.none(), st.integers(-3, 300), st.text(max_size=3), st.binary(max_size=17),
                 st.lists(st.integers(-1, 9), max_size=5), st.lists(st.lists(st.integers(-1, 9), max_size=5), max_size=3))


@st.composite
def mutated_replies(draw) -> list:
    reply = _REPLY_COPY()
    kind = draw(st.sampled_from(["replace", "truncate", "extend", "drop_item", "add_item", "error_row", "drop_error",
                                 "drop_segment", "segment_row"]))
    if kind == "replace":
        reply[draw(st.integers(0, len(reply) - 1))] = draw(JUNK)
    elif kind in ("truncate", "extend"):
        i = draw(st.integers(2, len(reply) - 1))
        k = draw(st.integers(1, 9))
        reply[i] = reply[i][:-k] if kind == "truncate" else reply[i] + b"\x01" * k
    elif kind == "drop_item":
        del reply[draw(st.integers(0, len(reply) - 1))]
    elif kind == "add_item":
        reply.append(draw(JUNK))
    elif kind == "error_row":
        reply[1] = reply[1] + [draw(st.one_of(JUNK, st.tuples(st.integers(-2, 7), st.integers(-1, 99),
                                                              st.text(max_size=3)).map(list)))]
    elif kind == "drop_error":
        reply[1] = reply[1][1:]
    elif kind == "drop_segment":
        reply[0] = reply[0][1:]
    else:
        row = list(reply[0][0])
        row[draw(st.integers(0, 4))] = draw(JUNK)
        reply[0] = [row, *reply[0][1:]]
    return reply


_REPLY = _valid_put_reply()


def _REPLY_COPY() -> list:
    return [[list(r) for r in _REPLY[0]], [list(r) for r in _REPLY[1]], *_REPLY[2:]]


@settings(max_examples=300, deadline=None)
@given(reply=mutated_replies())
def test_a_malformed_reply_is_a_protocol_error_never_a_crash(reply):
    try:
        cols = decode_columns(reply, put=True)
    except RpcProtocolError as e:
        assert "batch_put_start_columns reply" in str(e)
        return
    cols.check()  # a mutation that still fits the layout decodes to a consistent value
    cols.to_list()


class _BadMaster:
    """A real RPC target whose columnar replies are malformed (what a broken or hostile server sends)."""

    def __init__(self, reply) -> None:
        self.reply = reply

    def batch_put_start_columns(self, keys, sizes, **kwargs):
        return self.reply

    def get_replicas_columns(self, keys):
        return self.reply

    def stats(self):
        return "alive"


@pytest.mark.parametrize("reply", [None, [], [[], []], _REPLY[:-1], [*_REPLY[:2], b"\x01\x02\x03", *_REPLY[3:]],
                                   [[], *_REPLY[1:]], [_REPLY[0], [[0, 4, "x"]], *_REPLY[2:]]],
                         ids=["none", "empty", "short", "one-array-less", "ragged-bytes", "unknown-segment",
                              "error-on-a-row-with-replicas"])
def test_the_client_raises_a_protocol_error_for_a_malformed_reply_from_a_real_server(reply):
    srv = StreamServer(_BadMaster(reply), ["batch_put_start_columns", "get_replicas_columns", "stats"]).start()
    try:
        with MasterClient(srv.address, timeout_s=5, retry_s=0) as c:
            with pytest.raises(RpcProtocolError, match="columns reply"):
                c.batch_put_start_columns(["a"], [1])
            with pytest.raises(RpcProtocolError, match="columns reply"):
                c.get_replicas_columns(["a"])
            assert c.call("stats") == "alive"  # the connection and the client carry on
    finally:
        srv.close()


# ------------------------------------------------------------------ the sizes encoding

@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=20))
def test_int64_sizes_travel_as_raw_bytes_and_come_back_equal(sizes):
    wire = encode_sizes(sizes)
    assert type(wire) is bytes and len(wire) == 8 * len(sizes)
    assert decode_sizes(wire).tolist() == sizes == decode_sizes(encode_sizes(np.array(sizes, dtype=np.int64))).tolist()


@pytest.mark.parametrize("sizes", [[1, 2**64], [1, "2"], [1.5], [True], np.array([2**63], dtype=np.uint64),
                                   np.array([1.0])], ids=["past-int64", "str", "float", "bool", "uint64-big", "floats"])
def test_sizes_that_are_not_int64_go_as_a_list_for_the_master_to_judge(sizes):
    wire = encode_sizes(sizes)
    assert isinstance(wire, list) and decode_sizes(wire) == wire


# ------------------------------------------------------------------ a server without the columnar forms

def test_a_server_without_the_columnar_forms_is_asked_for_the_compact_ones_with_the_same_result():
    from quillcache.master.server import MasterEndpoint, SingleMaster
    from quillcache.master.wire import COLUMNS_METHODS, NODE_METHODS, SERVICE_METHODS
    from quillcache.rpc import InProcessClient

    old_svc, ref = MasterService(MasterConfig()), MasterService(MasterConfig())
    served = [m for m in (*SERVICE_METHODS, *NODE_METHODS) if m not in COLUMNS_METHODS]
    old = MasterClient(_rpc=InProcessClient(MasterEndpoint(SingleMaster(old_svc)), served))
    for seg in segments():
        old.mount_segment(seg)
        ref.mount_segment(seg)
    keys, sizes = ["a", "b", "a", "", "c"], np.array([10, 20, 30, 40, 1 << 40])
    kw = dict(replica_num=2, preferred_segment=3, pin=PinKind.SOFT, digests=[b"x", None, b"x", None, None])
    got = old.batch_put_start_columns(keys, sizes, **kw)
    assert not old._columns and cols_key(got) == cols_key(ref.batch_put_start_columns(keys, sizes, **kw))
    for m in (old, ref):
        m.batch_put_end(["a", "b"])
    assert cols_key(old.get_replicas_columns(keys)) == cols_key(ref.get_replicas_columns(keys))
    with pytest.raises(InvalidParamsError, match="do not match"):
        old.batch_put_start_columns(["a", "b"], [1])
    old.close()
    old_svc.close()
    ref.close()
