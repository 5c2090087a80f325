"""The plain-TCP transport (``quillcache.rpc.stream``, ``qtcp://``): the same calls, errors and refusals as the
ZeroMQ transport, its own framing limits (a frame past ``max_frame_bytes`` refused and the connection kept; a
length past ``drop_frame_bytes`` refused and the connection closed), malformed bodies answered while the server
keeps serving, restarts, timeouts, lost connections, NOT_LEADER moves across transports, and close() with
connections open. The idle timeout (idle, stalled, trickling and non-reading peers closed; slots freed; the
goodbye, and a client that reconnects or resends without running anything twice), connections turned away with
a typed refusal, and refusals that quote untrusted fields in bounded form. Servers bind 127.0.0.1 on free ports
and are closed by ``with``; waits poll with deadlines. The target, codec and helpers are ``tests/test_rpc.py``'s."""

from __future__ import annotations

import re
import socket
import struct
import threading
import time

import msgpack
import pytest
from test_rpc import CODEC, DEADLINE_S, METHODS, VALUES, Code, MasterError, Replica, Service, Tier, serve, until

from quillcache.rpc import (PROTOCOL_VERSION, RpcClient, RpcErrorCode, RpcRejectedError, RpcRemoteError,
                            RpcTimeoutError, StreamServer)
from quillcache.rpc.codec import EXT_DATACLASS, EXT_ENUM
from quillcache.rpc.errors import MAX_MESSAGE_CHARS
from quillcache.rpc.stream import HEADER, StreamConnection, split_address

LEN = struct.Struct(">I")


def stream_serve(target: object | None = None, **kw) -> StreamServer:
    return StreamServer(Service() if target is None else target, METHODS, codec=CODEC, **kw)


def raw_connect(server: StreamServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)
    return sock


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def raw_exchange(sock: socket.socket, body: bytes) -> list:
    sock.sendall(LEN.pack(len(body)) + body)
    return read_reply(sock)


def read_reply(sock: socket.socket) -> list:
    (n,) = LEN.unpack(recv_exact(sock, 4))
    return msgpack.unpackb(recv_exact(sock, n), raw=False, ext_hook=lambda c, d: msgpack.unpackb(d, raw=False))


def test_calls_values_and_typed_errors_round_trip():
    with stream_serve() as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        assert server.address.startswith("qtcp://127.0.0.1:")
        for value in VALUES:
            out = client.echo(value)
            assert out == value and type(out) is type(value)
        assert client.add(1, 2, c=3) == 6
        assert client.put_start(b"k", 2).replicas[1] == Replica("node-1", 4096, Tier.DRAM)
        with pytest.raises(MasterError) as info:
            client.get("k1")
        assert info.value.code is Code.NOT_FOUND and info.value.key == "k1"
        with pytest.raises(RpcRemoteError, match="builtins.KeyError"):
            client.plain()
        with pytest.raises(RpcRejectedError, match="UNENCODABLE_RESULT"):
            client.unencodable()
        with pytest.raises(RpcRejectedError, match="method 'nope' is not served here") as info:
            client.call("nope")
        assert info.value.code is RpcErrorCode.UNKNOWN_METHOD
        with pytest.raises(RpcRejectedError, match="BAD_ARGUMENTS: add:"):
            client.add(1, 2, 3)
        big = [f"key-{i}" for i in range(10_000)]
        assert client.echo(big) == big
        assert server.num_refused == 2 and server.num_connections == 1  # UNKNOWN_METHOD, BAD_ARGUMENTS


@pytest.mark.parametrize("body, rid, code, match", [
    (b"\xc1garbage", None, "BAD_FRAME", "undecodable frame"),
    (b"", None, "BAD_FRAME", "undecodable"),
    (msgpack.packb({"version": 1}), None, "BAD_FRAME", "got a dict"),
    (msgpack.packb([2, 7, "echo", [1], {}]), 7, "BAD_VERSION", "protocol version 2 is not spoken"),
    (msgpack.packb([1, 8, "echo"]), 8, "MISSING_FIELD", r"lacks field\(s\) \['args', 'kwargs'\]"),
    (msgpack.packb([1, -1, "echo", [], {}]), None, "BAD_FRAME", "request_id must be an int"),
    (msgpack.packb([1, 12, "echo", [], {1: 2}]), 12, "BAD_FRAME", "kwargs must be a map with str keys"),
    (msgpack.packb([1, 13, "_private", [], {}]), 13, "UNKNOWN_METHOD", "'_private' is not served"),
    (b"\x00" * 5000, None, "FRAME_TOO_LARGE", "frame of 5000 bytes is past the server's max_frame_bytes=4096"),
])
def test_malformed_bodies_get_typed_replies_on_the_same_connection(body, rid, code, match):
    with stream_serve(max_frame_bytes=4096) as server, raw_connect(server) as sock:
        version, reply_id, ok, payload = raw_exchange(sock, body)
        assert (version, reply_id, ok) == (PROTOCOL_VERSION, rid, False)
        assert payload["type"] == "RpcRejectedError" and payload["code"] == ["RpcErrorCode", code]
        assert re.search(match, payload["message"]), payload["message"]
        assert raw_exchange(sock, msgpack.packb([1, 99, "add", [2, 3], {}])) == [1, 99, True, 5]
        assert server.num_refused == 1


def test_a_length_past_the_drop_limit_is_refused_and_only_that_connection_closes():
    with stream_serve(max_frame_bytes=1024, drop_frame_bytes=4096) as server, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        assert client.echo("before") == "before"
        with raw_connect(server) as sock:
            sock.sendall(LEN.pack(2**32 - 1) + b"\x00" * 16)  # claims 4 GiB: never buffered
            _, rid, ok, payload = read_reply(sock)
            assert (rid, ok) == (None, False) and "past the server's drop limit of 4096" in payload["message"]
            assert sock.recv(1) == b"", "the server must close a connection past the drop limit"
        with pytest.raises(RpcRejectedError, match="FRAME_TOO_LARGE: frame of"):
            client.echo(b"x" * 2000)  # past max_frame_bytes, under the drop limit: typed reply, same connection
        assert client.echo("after") == "after"
        until(lambda: server.num_connections == 1, "the dropped connection to be gone")


def test_pipelined_requests_are_answered_in_order():
    with stream_serve() as server, raw_connect(server) as sock:
        bodies = [msgpack.packb([1, i, "add", [i, 1], {}]) for i in range(50)]
        sock.sendall(b"".join(LEN.pack(len(b)) + b for b in bodies))
        assert [read_reply(sock) for _ in bodies] == [[1, i, True, i + 1] for i in range(50)]


def test_a_peer_stalled_mid_frame_does_not_block_others():
    with stream_serve() as server, raw_connect(server) as stalled, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        stalled.sendall(LEN.pack(100) + b"\x93")  # 1 of 100 bytes, then nothing
        assert client.echo("served") == "served"


def test_timeout_lost_connection_and_restart_on_the_same_port():
    service = Service()
    with stream_serve(service) as server, RpcClient(server.address, timeout_s=0.2, codec=CODEC) as client:
        try:
            with pytest.raises(RpcTimeoutError, match="no reply within 0.2 s"):
                client.wait()
        finally:
            service.release.set()
        assert client.echo("next") == "next"  # a fresh connection: the late reply is not read as this one's
    port = server.port
    client = RpcClient(server.address, timeout_s=0.3, codec=CODEC)
    try:
        with pytest.raises(RpcTimeoutError, match="cannot connect"):
            client.echo(1)  # nobody listens: a timeout, not a hang
        with stream_serve(port=port) as second:
            assert client.echo(2) == 2
            second_addr = second.address
        with pytest.raises(RpcTimeoutError):  # the server closed with our connection open
            client.echo(3)
        with stream_serve(port=port) as third:
            assert third.address == second_addr and client.echo(4) == 4
    finally:
        client.close()


def test_not_leader_moves_between_transports():
    sleeps: list[float] = []
    with stream_serve(Service(leader=False)) as follower, serve(Service(leader=True)) as zmq_leader, \
            stream_serve(Service(leader=True)) as stream_leader:
        with RpcClient([follower.address, zmq_leader.address], timeout_s=DEADLINE_S, codec=CODEC, backoff_s=0.01,
                       sleep=sleeps.append) as client:
            assert client.put_start(b"k", 1).key == b"k" and client.address == zmq_leader.address
        with RpcClient([follower.address], timeout_s=DEADLINE_S, codec=CODEC, sleep=sleeps.append,
                       leader_finder=lambda: stream_leader.address) as client:
            assert client.put_start(b"k", 1).key == b"k" and client.address == stream_leader.address


def test_concurrent_clients_reach_the_target_one_at_a_time():
    class Counting(Service):
        def __init__(self) -> None:
            super().__init__()
            self.inside = 0
            self.overlaps = 0

        def add(self, a: int, b: int = 0, *, c: int = 0) -> int:
            self.inside += 1
            if self.inside != 1:
                self.overlaps += 1
            time.sleep(0)  # let another thread run if it could get in
            self.inside -= 1
            return a + b + c

    service = Counting()
    errors: list[BaseException] = []
    with stream_serve(service) as server:
        def work(i: int) -> None:
            try:
                with RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as own:
                    for j in range(100):
                        assert own.add(i, j) == i + j
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S * 3)
        assert not errors and not any(t.is_alive() for t in threads) and service.overlaps == 0
        until(lambda: server.num_connections == 0, "the clients' connections to close")


def test_addresses_are_checked():
    assert split_address("qtcp://127.0.0.1:80") == ("127.0.0.1", 80)
    assert split_address("qtcp://[::1]:9") == ("::1", 9)
    for bad in ("qtcp://host", "qtcp://:80", "qtcp://h:0", "qtcp://h:x"):
        with pytest.raises(ValueError, match="a stream address is"):
            RpcClient(bad)
    assert HEADER.size == 4


@pytest.mark.parametrize("server_spin_s, client_spin_s", [(0.0, 0.0), (0.0, 1e-4), (1e-4, 0.0), (1e-3, 1e-3)])
def test_polling_before_sleeping_is_only_a_speed_setting(server_spin_s, client_spin_s):
    service = Service()
    with stream_serve(service, spin_s=server_spin_s) as server, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC, spin_s=client_spin_s) as client:
        for i in range(300):
            assert client.add(i, 1) == i + 1
        service.release.set()
        assert client.wait() == "released"  # a reply slower than the poll window: the client sleeps, then reads
        assert [client.echo(i) for i in range(40)] == list(range(40))  # back to polling after its back-off
    with pytest.raises(ValueError, match="spin_s"):
        StreamServer(Service(), METHODS, spin_s=-1.0)


def test_connections_past_the_cap_are_closed_and_the_others_served():
    with stream_serve(max_connections=2) as server, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as a, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as b:
        assert a.echo(1) == 1 and b.echo(2) == 2
        with RpcClient(server.address, timeout_s=1.0, codec=CODEC) as c:
            with pytest.raises(RpcRejectedError, match="TOO_MANY_CONNECTIONS: 2 connections are open") as info:
                c.echo(3)  # a refusal (the request did not run), not a lost connection
            assert info.value.code is RpcErrorCode.TOO_MANY_CONNECTIONS
        assert server.num_turned_away == 1 and a.echo(4) == 4 and b.echo(5) == 5
        a.close()
        until(lambda: server.num_connections == 1, "a's connection to close")
        with RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as d:
            assert d.echo(6) == 6  # a freed slot serves a new client


@pytest.mark.parametrize("transport", ["stream", "zmq"])
def test_after_reply_runs_once_per_reply_after_the_client_has_it(transport):
    """``after_reply`` runs on the serving thread after each reply is sent: the client already holds its answer
    while the hook runs (the hook blocks until the client has read it), and a hook that raises is logged while
    the server goes on serving."""
    answered = threading.Event()
    seen: list[bool] = []
    fail = [False]

    def hook() -> None:
        seen.append(answered.wait(DEADLINE_S))  # the client got the reply before the hook finished
        if fail[0]:
            raise RuntimeError("hook failure (test)")

    make = stream_serve if transport == "stream" else serve
    with make(after_reply=hook) as server, RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        for i in range(3):
            answered.clear()
            assert client.echo(i) == i
            answered.set()
            until(lambda: len(seen) == i + 1, f"hook {i + 1}")
        fail[0] = True
        answered.set()
        assert client.echo("after a failing hook") == "after a failing hook"
        until(lambda: len(seen) == 4, "the failing hook")
        fail[0] = False
        assert client.echo("still serving") == "still serving"
        until(lambda: len(seen) == 5, "hook 5")
    assert seen == [True] * 5


# --- idle timeout, goodbyes, turned-away connections -------------------------------------------------------

IDLE_S = 0.3  # a test's idle timeout: short, so each test takes about a second


def read_goodbye(sock: socket.socket) -> dict:
    """The goodbye the server sends before closing ``sock`` (request id None), then the end of the stream."""
    sock.settimeout(DEADLINE_S)
    _, rid, ok, payload = read_reply(sock)
    assert (rid, ok) == (None, False), payload
    assert sock.recv(1) == b"", "the server closes the connection after its goodbye"
    return payload


def test_an_idle_connection_gets_a_goodbye_and_is_closed():
    with stream_serve(idle_timeout_s=IDLE_S) as server, raw_connect(server) as sock:
        t0 = time.monotonic()
        payload = read_goodbye(sock)
        assert time.monotonic() - t0 >= IDLE_S * 0.9
        assert payload["code"] == ["RpcErrorCode", "IDLE_TIMEOUT"]
        assert "no request for the server's idle_timeout_s=0.3 s" in payload["message"]
        until(lambda: server.num_connections == 0 and server.num_timed_out == 1, "the slot to be freed")


@pytest.mark.parametrize("how", ["stalled", "trickling"])
def test_a_request_begun_but_not_completed_times_out(how):
    with stream_serve(idle_timeout_s=IDLE_S) as server, raw_connect(server) as sock:
        body = msgpack.packb([1, 1, "echo", ["x" * 100], {}])
        frame = LEN.pack(len(body)) + body
        sock.sendall(frame[:6])
        t0 = time.monotonic()
        if how == "trickling":  # a byte well within each wait, never the whole frame within idle_timeout_s
            sock.setblocking(False)
            for i in range(6, len(frame) - 1):
                try:
                    sock.recv(1, socket.MSG_PEEK)
                    break  # the goodbye is here
                except BlockingIOError:
                    pass
                sock.send(frame[i:i + 1])
                time.sleep(IDLE_S / 10)  # the trickle's pace (not a wait for the server: the loop polls for it)
            sock.setblocking(True)
        payload = read_goodbye(sock)
        assert time.monotonic() - t0 < DEADLINE_S / 2
        assert payload["code"] == ["RpcErrorCode", "IDLE_TIMEOUT"] and "begun but not completed" in payload["message"]
        until(lambda: server.num_connections == 0, "the slot to be freed")
        assert server.num_requests == 0  # the partial request never ran


def test_a_peer_that_reads_none_of_its_reply_is_closed():
    with stream_serve(idle_timeout_s=IDLE_S) as server:
        sock = socket.socket()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the reply cannot fit in the buffers
            sock.connect(("127.0.0.1", server.port))
            body = msgpack.packb([1, 1, "echo", [b"x" * (16 << 20)], {}])
            sock.sendall(LEN.pack(len(body)) + body)
            until(lambda: server.num_timed_out == 1 and server.num_connections == 0, "the non-reader to be closed")
        finally:
            sock.close()


def test_idle_connections_do_not_keep_the_slots_a_new_client_needs():
    with stream_serve(max_connections=2, idle_timeout_s=IDLE_S) as server, \
            raw_connect(server) as idle_a, raw_connect(server) as idle_b:
        until(lambda: server.num_connections == 2, "both idle connections to be served")
        with RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
            with pytest.raises(RpcRejectedError) as info:
                client.echo("turned away")
            assert info.value.code is RpcErrorCode.TOO_MANY_CONNECTIONS
            until(lambda: server.num_connections == 0, "the idle connections to time out")
            assert client.echo("served") == "served"
        assert server.num_timed_out == 2 and server.num_turned_away == 1
        for sock in (idle_a, idle_b):
            assert read_goodbye(sock)["code"] == ["RpcErrorCode", "IDLE_TIMEOUT"]


def test_a_client_reconnects_after_an_idle_close_and_runs_each_call_once():
    service = Service()  # counts the echo calls that ran
    with stream_serve(service, idle_timeout_s=IDLE_S) as server, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        assert client.echo(1) == 1
        until(lambda: server.num_timed_out == 1, "the client's idle connection to be closed")
        assert client.echo(2) == 2  # the goodbye seen before sending: a fresh connection, nothing lost
        assert service.num_calls == 2 and server.num_timed_out == 1


def test_a_request_that_crosses_the_goodbye_is_sent_again_once(monkeypatch):
    """The server closes the idle connection just as the client sends (the client's look before sending saw
    nothing yet): the reply is the goodbye, the request never ran, and the client sends it again on a fresh
    connection, where it runs once."""
    service = Service()  # counts the echo calls that ran
    with stream_serve(service, idle_timeout_s=IDLE_S) as server, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client:
        assert client.echo("first") == "first"
        until(lambda: server.num_timed_out == 1, "the client's idle connection to be closed")
        monkeypatch.setattr(StreamConnection, "_peer_done", lambda self: False)  # the goodbye not seen in time
        assert client.echo("second") == "second"
        assert service.num_calls == 2


# --- untrusted fields in refusals -----------------------------------------------------------------------------

BIG = "\x00" * (4 << 20)  # 4 MiB of NULs: repr() would make 16 MiB of it


@pytest.mark.parametrize("body, code, names", [
    (msgpack.packb([BIG, 1, "echo", [], {}]), "BAD_VERSION", "protocol version '\\x00"),
    (msgpack.packb([1, BIG, "echo", [], {}]), "BAD_FRAME", "request_id must be an int"),
    (msgpack.packb([1, 1, BIG, [], {}]), "UNKNOWN_METHOD", "method '\\x00"),
    (msgpack.packb([1, 1, "echo", [msgpack.ExtType(EXT_DATACLASS, msgpack.packb([BIG, {}]))], {}]), "BAD_FRAME",
     "unknown type tag '\\x00"),
    (msgpack.packb([1, 1, "echo", [msgpack.ExtType(EXT_ENUM, msgpack.packb(["Tier", BIG]))], {}]), "BAD_FRAME",
     "Tier has no member '\\x00"),
    (msgpack.packb([1, 1, "echo", [msgpack.ExtType(EXT_DATACLASS, msgpack.packb(["Replica", {BIG: 1}]))], {}]),
     "BAD_FRAME", "cannot rebuild Replica: it has no field"),
    (msgpack.packb([1, 1, "echo", [1], {BIG: 1}]), "BAD_ARGUMENTS", "echo: got an unexpected keyword argument"),
], ids=["version", "request_id", "method", "ext tag", "enum member", "dataclass field", "keyword"])
def test_a_huge_untrusted_field_gets_a_small_refusal_and_a_small_log_line(body, code, names, caplog):
    with stream_serve() as server, raw_connect(server) as sock:
        sock.sendall(LEN.pack(len(body)) + body)
        (n,) = LEN.unpack(recv_exact(sock, 4))
        assert n < 2048, f"a refusal of {n} bytes for a {len(body)}-byte request"
        _, _, ok, payload = msgpack.unpackb(recv_exact(sock, n), raw=False,
                                            ext_hook=lambda c, d: msgpack.unpackb(d, raw=False))
        assert not ok and payload["code"] == ["RpcErrorCode", code]
        assert names in payload["message"] and "(a str of 4194304 characters)" in payload["message"], \
            payload["message"]
        assert raw_exchange(sock, msgpack.packb([1, 9, "add", [2, 3], {}])) == [1, 9, True, 5]  # still serving
    assert all(len(r.getMessage()) < 2048 for r in caplog.records)


class Chatty(Service):
    def shout(self) -> None:
        raise MasterError(Code.NOT_FOUND, "x" * (1 << 20))  # a method's own message, 1 MiB long


def test_an_error_message_past_the_limit_is_cut_on_the_wire():
    with StreamServer(Chatty(), [*METHODS, "shout"], codec=CODEC) as server, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as client, raw_connect(server) as sock:
        body = msgpack.packb([1, 1, "shout", [], {}])
        sock.sendall(LEN.pack(len(body)) + body)
        (n,) = LEN.unpack(recv_exact(sock, 4))
        assert n < 4 * MAX_MESSAGE_CHARS  # the message, and its copies in args and attrs, each cut
        with pytest.raises(MasterError) as info:
            client.shout()
        assert info.value.code is Code.NOT_FOUND and info.value.message.startswith("x" * MAX_MESSAGE_CHARS)
        assert info.value.message.endswith(f"... ({(1 << 20) - MAX_MESSAGE_CHARS} more characters)")
