"""``quillcache.rpc``: codec, frames, error mapping, whitelist, robustness, timeouts, restarts, HA retries.

Every server binds 127.0.0.1 on a free port and is closed by a ``with``; nothing sleeps a fixed time: waits
poll with deadlines. The types below are registered with a test-local ``Codec`` (``CODEC``), not the
process-wide one, except in the one test of the module-level ``register_type``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.rpc import (DEFAULT_CODEC, PROTOCOL_VERSION, Codec, InProcessClient, RpcClient, RpcConnectionError,
                            RpcEncodeError, RpcErrorCode, RpcProtocolError, RpcRejectedError, RpcRemoteError,
                            RpcServer, RpcTimeoutError, register_type)
from quillcache.rpc.codec import EXT_DATACLASS, EXT_TUPLE, MAX_EXT_DEPTH

DEADLINE_S = 10.0


class Code(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    NOT_LEADER = 2


class Tier(enum.Enum):
    DRAM = "dram"
    SSD = "ssd"


@dataclasses.dataclass(frozen=True, slots=True)
class Replica:
    node_id: str
    offset: int
    tier: Tier


@dataclasses.dataclass(frozen=True, kw_only=True)
class PutResult:
    key: bytes
    replicas: tuple[Replica, ...]
    code: Code = Code.OK
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes):
            raise ValueError(f"key must be bytes, got {self.key!r}")


@dataclasses.dataclass
class Derived:
    size: int
    blocks: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.blocks = -(-self.size // 16)


class MasterError(Exception):
    """Like the master's typed errors: a code and a message."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message


class ObjectNotFound(MasterError):  # not registered: comes back as MasterError
    def __init__(self, key: str) -> None:
        super().__init__(Code.NOT_FOUND, f"no object {key!r}")
        self.key = key


class KwOnlyError(Exception):
    code = Code.NOT_FOUND

    def __init__(self, *, what: str) -> None:
        super().__init__(f"bad {what}")
        self.what = what


class Unregistered(enum.Enum):
    X = 1


class StrangeError(Exception):
    def __init__(self) -> None:
        super().__init__("strange")
        self.code = Unregistered.X


CODEC = Codec()
for _cls in (Code, Tier, Replica, PutResult, Derived):
    CODEC.register_type(_cls)
CODEC.register_error(MasterError)
CODEC.register_error(KwOnlyError)


class Service:
    """A target: a few methods, one private, one blocking, one that refuses to be leader."""

    def __init__(self, leader: bool = True) -> None:
        self.leader = leader
        self.release = threading.Event()
        self.num_calls = 0

    def echo(self, value: object) -> object:
        self.num_calls += 1
        return value

    def add(self, a: int, b: int = 0, *, c: int = 0) -> int:
        return a + b + c

    def put_start(self, key: bytes, n: int) -> PutResult:
        if not self.leader:
            raise MasterError(Code.NOT_LEADER, "not the leader")
        return PutResult(key=key, replicas=tuple(Replica(f"node-{i}", i * 4096, Tier.DRAM) for i in range(n)))

    def get(self, key: str) -> bytes:
        raise ObjectNotFound(key)

    def kw_only(self) -> None:
        raise KwOnlyError(what="thing")

    def strange(self) -> None:
        raise StrangeError()

    def plain(self) -> None:
        raise KeyError("missing")

    def wait(self) -> str:
        assert self.release.wait(DEADLINE_S)
        return "released"

    def unencodable(self) -> object:
        return object()

    def _private(self) -> None:
        raise AssertionError("never served")


METHODS = ["echo", "add", "put_start", "get", "kw_only", "strange", "plain", "wait", "unencodable"]


def serve(target: object | None = None, **kw) -> RpcServer:
    return RpcServer(Service() if target is None else target, METHODS, codec=CODEC, **kw)


def until(predicate, what: str, deadline_s: float = DEADLINE_S):
    """``predicate()``'s first truthy value, polling until the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


VALUES = [None, True, False, 0, -1, 2**63 - 1, -2**63, 2**64 - 1, 1.5, -0.0, math.inf, "", "ключ", b"", b"\x00\xff",
          [], [1, [2, [3]]], {}, {"a": 1, 2: "b", b"k": None}, (), (1, (2, (b"x",))), ((),), Code.NOT_LEADER,
          Tier.SSD, Replica("n", 0, Tier.DRAM),
          PutResult(key=b"k", replicas=(Replica("a", 1, Tier.SSD),), meta={"t": (Code.OK, [Tier.DRAM])}),
          [PutResult(key=b"", replicas=())], {"nested": {"deep": (Replica("z", 2**40, Tier.SSD), [None])}}]


# --- codec ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_codec_round_trips_every_kind(value):
    out = CODEC.decode(CODEC.encode(value))
    assert out == value and type(out) is type(value)


def test_codec_keeps_types_inside_containers_and_derived_fields():
    out = CODEC.decode(CODEC.encode([(1,), {"t": (Code.OK,)}, Derived(33)]))
    assert type(out[0]) is tuple and type(out[1]["t"][0]) is Code and out[2].blocks == 3
    assert CODEC.decode(CODEC.encode(bytearray(b"ab"))) == b"ab"
    assert CODEC.decode(CODEC.encode(memoryview(b"cd"))) == b"cd"
    assert CODEC.decode(CODEC.encode([np.int64(7), np.float64(0.5), np.uint8(3)])) == [7, 0.5, 3]


def test_register_type_is_idempotent_and_refuses_clashes():
    codec = Codec()
    assert codec.register_type(Replica) is Replica
    codec.register_type(Replica)  # the same class under the same tag: a no-op

    @dataclasses.dataclass
    class Replica2:
        x: int

    with pytest.raises(ValueError, match="'Replica' is already taken"):
        codec.register_type(Replica2, name="Replica")
    with pytest.raises(ValueError, match="already registered as 'Replica'"):
        codec.register_type(Replica, name="Other")
    with pytest.raises(TypeError, match="dataclass or an enum"):
        codec.register_type(int)
    with pytest.raises(TypeError, match="exception class"):
        codec.register_error(Replica)


def test_unregistered_values_are_refused_naming_register_type():
    codec = Codec()
    with pytest.raises(RpcEncodeError, match=r"Replica is not registered.*register_type\(Replica\)"):
        codec.encode([Replica("n", 0, Tier.DRAM)])
    with pytest.raises(RpcEncodeError, match="Tier is not registered"):
        codec.encode(Tier.SSD)
    with pytest.raises(RpcEncodeError, match="cannot encode a builtins.object"):
        codec.encode({"x": object()})
    with pytest.raises(RpcEncodeError):
        codec.encode(2**64)
    with pytest.raises(TypeError):  # RpcEncodeError is a TypeError too
        codec.encode({1, 2})


def test_module_level_register_type_uses_the_default_codec():
    @dataclasses.dataclass(frozen=True)
    class DefaultOnly:
        x: int

    register_type(DefaultOnly, name="tests.test_rpc.DefaultOnly")
    assert DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(DefaultOnly(3))) == DefaultOnly(3)
    assert "tests.test_rpc.DefaultOnly" not in CODEC.type_names()


def _ext(code: int, body: object) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(body)))


@pytest.mark.parametrize("data, match", [
    (_ext(EXT_DATACLASS, ["Nope", {}]), "unknown type tag 'Nope'"),
    (_ext(EXT_DATACLASS, ["Replica", {"node_id": "n"}]), r"cannot rebuild Replica from fields \['node_id'\]"),
    (_ext(EXT_DATACLASS, ["PutResult", {"key": "str", "replicas": []}]), "key must be bytes"),
    (_ext(EXT_DATACLASS, ["Code", {}]), "not a dataclass's fields"),
    (_ext(2, ["Code", "MISSING"]), "Code has no member 'MISSING'"),
    (_ext(2, ["Replica", "x"]), "is not an enum"),
    (_ext(9, []), "unknown msgpack extension type 9"),
    (_ext(EXT_TUPLE, {"a": 1}), "tuple extension holds a dict"),
    (b"\xc1", "undecodable"),
    (b"\x92\x01", "undecodable"),
    (b"", "undecodable"),
])
def test_decode_names_what_is_wrong(data, match):
    with pytest.raises(RpcProtocolError, match=match):
        CODEC.decode(data)


def test_decode_refuses_deep_extension_nesting():
    inner = b"\x90"
    for _ in range(MAX_EXT_DEPTH + 1):
        inner = msgpack.packb([msgpack.ExtType(EXT_TUPLE, inner)])
    with pytest.raises(RpcProtocolError, match="nested deeper"):
        CODEC.decode(inner)
    assert CODEC.decode(CODEC.encode(((((),),),))) == ((((),),),)  # the depth counter was reset


# Hypothesis: values the codec promises to carry, named after what they are.
scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=False)
           | st.text(max_size=20) | st.binary(max_size=40) | st.sampled_from(list(Code) + list(Tier)))
replicas = st.builds(Replica, st.text(max_size=8), st.integers(0, 2**63 - 1), st.sampled_from(Tier))
wire_values = st.recursive(
    scalars | replicas,
    lambda inner: (st.lists(inner, max_size=5) | st.lists(inner, max_size=5).map(tuple)
                   | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=5)
                   | st.builds(lambda k, r, m: PutResult(key=k, replicas=tuple(r), meta=m), st.binary(max_size=8),
                               st.lists(replicas, max_size=3), st.dictionaries(st.text(max_size=4), inner,
                                                                               max_size=3))),
    max_leaves=30)


@given(wire_values)
def test_codec_round_trip_property(value):
    assert CODEC.decode(CODEC.encode(value)) == value


@given(st.binary(max_size=200))
def test_random_bytes_decode_raises_only_protocol_errors(data):
    try:
        CODEC.decode(data)
    except RpcProtocolError:
        pass


@given(wire_values, st.data())
def test_damaged_frames_decode_raises_only_protocol_errors(value, data):
    frame = bytearray(CODEC.encode([PROTOCOL_VERSION, 1, "echo", [value], {}]))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    try:
        CODEC.decode(bytes(frame[:cut]))
    except RpcProtocolError:
        pass


# --- calls and errors -------------------------------------------------------------------------------


def test_round_trips_through_a_server_and_attribute_access():
    with serve() as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        for value in VALUES:
            out = client.echo(value)
            assert out == value and type(out) is type(value)
        assert client.call("add", 1, 2, c=3) == 6 and client.add(a=4) == 4
        assert client.invoke("add", [1], {"b": 1}, timeout_s=1.0) == 2
        result = client.put_start(b"key", 2)
        assert result.replicas[1] == Replica("node-1", 4096, Tier.DRAM) and result.code is Code.OK
        assert server.num_refused == 0


def test_registered_errors_come_back_as_themselves():
    with serve() as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        with pytest.raises(MasterError) as info:  # an unregistered subclass: its nearest registered ancestor
            client.get("k1")
        assert type(info.value) is MasterError and info.value.code is Code.NOT_FOUND
        assert info.value.message == "no object 'k1'" and info.value.key == "k1"
        with pytest.raises(KwOnlyError, match="bad thing") as info:  # a constructor that refuses the args
            client.kw_only()
        assert info.value.code is Code.NOT_FOUND and info.value.what == "thing"


def test_other_errors_come_back_as_remote_errors_naming_type_and_message():
    with serve() as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        with pytest.raises(RpcRemoteError, match=r"remote builtins.KeyError: 'missing'") as info:
            client.plain()
        assert info.value.remote_type == "builtins.KeyError" and info.value.code is None
        with pytest.raises(RpcRemoteError) as info:  # a code of an enum the codec does not know: its name
            client.strange()
        assert info.value.code == "Unregistered.X" and "StrangeError" in info.value.remote_type
        with pytest.raises(RpcRejectedError, match="UNENCODABLE_RESULT: unencodable returned") as info:
            client.unencodable()
        assert client.echo(1) == 1  # still serving


def test_whitelist_and_argument_binding():
    with pytest.raises(ValueError, match=r"cannot serve \['_private', 'missing'\]"):
        RpcServer(Service(), ["echo", "_private", "missing"], codec=CODEC)
    with pytest.raises(ValueError, match="non-empty list"):
        RpcServer(Service(), "echo", codec=CODEC)
    with serve() as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        for name in ("_private", "leader", "release", "__init__", "nope"):
            with pytest.raises(RpcRejectedError, match=f"method '{name}' is not served here") as info:
                client.call(name)
            assert info.value.code is RpcErrorCode.UNKNOWN_METHOD
        with pytest.raises(RpcRejectedError, match="BAD_ARGUMENTS: add:") as info:
            client.add(1, 2, 3)
        with pytest.raises(RpcRejectedError, match="BAD_ARGUMENTS"):
            client.add(1, d=2)
        with pytest.raises(AttributeError):
            client._private  # noqa: B018
        assert server.num_refused == 7


# --- robustness -------------------------------------------------------------------------------------


def _raw_exchange(sock: zmq.Socket, frames: list[bytes]) -> list:
    sock.send_multipart(frames)
    assert sock.poll(int(DEADLINE_S * 1000)), "no reply to a malformed frame"
    return msgpack.unpackb(sock.recv(), raw=False, ext_hook=lambda c, d: msgpack.unpackb(d, raw=False))


@pytest.mark.parametrize("frames, rid, code, match", [
    ([b"\xc1garbage"], None, "BAD_FRAME", "undecodable frame"),
    ([b""], None, "BAD_FRAME", "undecodable"),
    ([msgpack.packb({"version": 1})], None, "BAD_FRAME", "got a dict"),
    ([msgpack.packb([])], None, "MISSING_FIELD", "empty request"),
    ([msgpack.packb([2, 7, "echo", [1], {}])], 7, "BAD_VERSION", "protocol version 2 is not spoken"),
    ([msgpack.packb(["1", 7, "echo", [1], {}])], 7, "BAD_VERSION", "version '1'"),
    ([msgpack.packb([1, 8, "echo"])], 8, "MISSING_FIELD", r"lacks field\(s\) \['args', 'kwargs'\]"),
    ([msgpack.packb([1, 9, "echo", [], {}, "extra"])], 9, "BAD_FRAME", "has 6 fields"),
    ([msgpack.packb([1, -1, "echo", [], {}])], None, "BAD_FRAME", "request_id must be an int"),
    ([msgpack.packb([1, 10, 5, [], {}])], 10, "BAD_FRAME", "method must be a str"),
    ([msgpack.packb([1, 11, "echo", {}, {}])], 11, "BAD_FRAME", "args must be an array"),
    ([msgpack.packb([1, 12, "echo", [], {1: 2}])], 12, "BAD_FRAME", "kwargs must be a map with str keys"),
    ([msgpack.packb([1, 13, "nope", [], {}])], 13, "UNKNOWN_METHOD", "'nope' is not served"),
    ([msgpack.packb([1, 14, "echo", [msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["Evil", {}]))], {}])], None, "BAD_FRAME", "'Evil'"),
    ([b"a", b"b"], None, "BAD_FRAME", "a request is one frame, got 2"),
    ([b"\x00" * 5000], None, "FRAME_TOO_LARGE", "frame of 5000 bytes is past the server's max_frame_bytes=4096"),
])
def test_malformed_frames_get_typed_replies_and_the_server_keeps_serving(frames, rid, code, match):
    ctx = zmq.Context.instance()
    with serve(max_frame_bytes=4096) as server, RpcClient(server.address, timeout_s=DEADLINE_S,
                                                          codec=CODEC) as client:
        raw = ctx.socket(zmq.DEALER)
        try:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.address)
            version, reply_id, ok, payload = _raw_exchange(raw, frames)
            assert (version, reply_id, ok) == (PROTOCOL_VERSION, rid, False)
            assert payload["type"] == "RpcRejectedError" and payload["code"] == ["RpcErrorCode", code]
            assert re.search(match, payload["message"]), payload["message"]
            assert _raw_exchange(raw, [msgpack.packb([1, 99, "add", [2, 3], {}])]) == [1, 99, True, 5]
        finally:
            raw.close()
        assert client.add(1, 1) == 2 and server.num_refused == 1


def test_frames_past_the_drop_limit_disconnect_the_peer_and_others_are_served():
    with serve(max_frame_bytes=1024, drop_frame_bytes=4096) as server, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        try:
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(server.address)
            raw.send(b"\x00" * 100_000)
            assert not raw.poll(200), "libzmq should cut a frame past drop_frame_bytes"
        finally:
            raw.close()
        assert client.echo(b"x" * 512) == b"x" * 512
        with pytest.raises(RpcRejectedError, match="FRAME_TOO_LARGE: frame of"):
            client.echo(b"x" * 2000)  # past max_frame_bytes, under the drop limit: a typed reply
        assert client.echo("after") == "after" and server.num_requests == 3


def test_client_refuses_to_send_a_frame_past_its_own_limit():
    with serve() as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC,
                                      max_frame_bytes=1024) as client:
        with pytest.raises(RpcRejectedError, match="past the client's max_frame_bytes=1024"):
            client.echo(b"x" * 2000)
        with pytest.raises(RpcEncodeError, match="Unregistered is not registered"):
            client.echo(Unregistered.X)
        assert server.num_requests == 0 and client.echo(1) == 1


def test_timeout_then_the_client_is_not_stuck():
    service = Service()
    with serve(service) as server, RpcClient(server.address, timeout_s=0.2, codec=CODEC) as client:
        try:
            t0 = time.monotonic()
            with pytest.raises(RpcTimeoutError, match="no reply within 0.2 s"):
                client.wait()
            assert time.monotonic() - t0 < 2.0
        finally:
            service.release.set()
        assert client.echo("next") == "next"  # the late reply of wait() does not answer this call
        assert client.invoke("wait", timeout_s=DEADLINE_S) == "released"


def test_server_restart_on_the_same_port_client_works_again():
    with serve() as first:
        address, port = first.address, first.port
        client = RpcClient(address, timeout_s=0.5, codec=CODEC)
        assert client.echo(1) == 1
    try:
        with pytest.raises(RpcTimeoutError):  # nobody serves: a timeout, not a hang
            client.echo(2)
        with serve(port=port) as second:
            assert second.address == address

            def answered():
                try:
                    return client.echo(3) == 3
                except RpcTimeoutError:
                    return False

            until(answered, "the client to reach the restarted server")
            assert client.add(2, 2) == 4
    finally:
        client.close()
    with pytest.raises(RpcConnectionError, match="closed"):
        client.echo(4)


def test_concurrent_clients_from_threads():
    service = Service()
    errors: list[BaseException] = []
    with serve(service) as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as shared:

        def work(i: int) -> None:
            try:
                with RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as own:
                    for j in range(200):
                        assert own.add(i, j) == i + j
                        assert shared.echo((i, j)) == (i, j)  # one client shared by threads: they take turns
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S * 3)
        assert not errors and not any(t.is_alive() for t in threads)
        assert service.num_calls == 8 * 200


def test_batch_calls_of_ten_thousand_items():
    items = [PutResult(key=i.to_bytes(8, "little"), replicas=(Replica(f"n{i % 7}", i, Tier.SSD),),
                       code=Code(i % 3)) for i in range(10_000)]
    with serve() as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        assert client.echo(items) == items
        keys = [f"key-{i}" for i in range(10_000)]
        assert client.echo(keys) == keys


# --- high availability ------------------------------------------------------------------------------


def test_not_leader_errors_are_retried_on_the_next_address():
    sleeps: list[float] = []
    with serve(Service(leader=False)) as follower, serve(Service(leader=True)) as leader, \
            RpcClient([follower.address, leader.address], timeout_s=DEADLINE_S, codec=CODEC, backoff_s=0.01,
                      sleep=sleeps.append) as client:
        assert client.put_start(b"k", 1).key == b"k"
        assert client.address == leader.address and sleeps == [0.01]
        assert client.put_start(b"k2", 1).key == b"k2" and sleeps == [0.01]  # stays on the leader


def test_leader_finder_is_asked_and_retries_are_bounded():
    calls: list[str] = []
    sleeps: list[float] = []
    with serve(Service(leader=False)) as a, serve(Service(leader=False)) as b, serve(Service()) as c:
        def finder():
            calls.append("find")
            return c.address.removeprefix("tcp://")  # 'host:port' is an address too

        with RpcClient([a.address, b.address], timeout_s=DEADLINE_S, codec=CODEC, leader_finder=finder,
                       sleep=sleeps.append) as client:
            assert client.put_start(b"k", 1).key == b"k" and client.address == c.address and calls == ["find"]
        with RpcClient([a.address, b.address], timeout_s=DEADLINE_S, codec=CODEC, max_retries=3, backoff_s=0.1,
                       max_backoff_s=0.25, sleep=sleeps.append) as client:
            with pytest.raises(MasterError, match="not the leader") as info:
                client.put_start(b"k", 1)
            assert info.value.code is Code.NOT_LEADER
        assert sleeps == [0.05, 0.1, 0.2, 0.25]  # the first client's one retry, then 0.1 doubling, capped
        with RpcClient([a.address, b.address], timeout_s=DEADLINE_S, codec=CODEC, retry_codes=(),
                       sleep=sleeps.append) as client:
            with pytest.raises(MasterError):
                client.put_start(b"k", 1)
        with RpcClient([a.address, c.address], timeout_s=DEADLINE_S, codec=CODEC, retry_codes={Code.NOT_LEADER},
                       leader_finder=lambda: 1 / 0, sleep=sleeps.append) as client:  # a broken finder: rotate
            assert client.put_start(b"k", 1).key == b"k"


def test_a_timeout_moves_the_next_call_to_another_address():
    stuck = Service()
    with serve(stuck) as a, serve() as b, RpcClient([a.address, b.address], timeout_s=0.2, codec=CODEC) as client:
        try:
            with pytest.raises(RpcTimeoutError):
                client.wait()
            assert client.echo("moved") == "moved" and client.address == b.address
        finally:
            stuck.release.set()  # before the server closes: its serving thread is in wait()


# --- embedded ---------------------------------------------------------------------------------------


def test_in_process_client_behaves_like_the_remote_one():
    with InProcessClient(Service(), METHODS, codec=CODEC) as client:
        assert client.put_start(b"k", 2).replicas[0].tier is Tier.DRAM
        assert client.echo((1, [2])) == (1, [2])
        with pytest.raises(MasterError) as info:
            client.get("x")
        assert type(info.value) is MasterError and info.value.code is Code.NOT_FOUND
        with pytest.raises(RpcRemoteError, match="KeyError"):
            client.plain()
        with pytest.raises(RpcRejectedError, match="UNKNOWN_METHOD"):
            client.call("_private")
        with pytest.raises(RpcEncodeError):  # what would fail on the wire fails embedded too
            client.echo(Unregistered.X)
    raw = InProcessClient(Service(), ["echo", "get"], codec=CODEC, roundtrip=False)
    assert raw.echo(Unregistered.X) is Unregistered.X
    with pytest.raises(ObjectNotFound):
        raw.get("x")
    with pytest.raises(ValueError, match="cannot serve"):
        InProcessClient(Service(), ["_private"])


def test_a_type_error_of_the_method_itself_is_not_bad_arguments():
    class Typed:
        def f(self, x: int) -> int:
            return x + "s"  # type: ignore[operator]

    with RpcServer(Typed(), ["f"], codec=CODEC) as server, RpcClient(server.address, codec=CODEC) as client:
        with pytest.raises(RpcRemoteError, match="builtins.TypeError: unsupported operand"):
            client.f(1)
        with pytest.raises(RpcRejectedError, match="BAD_ARGUMENTS: f: missing a required argument: 'x'"):
            client.f()
        assert server.num_refused == 1
