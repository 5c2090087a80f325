"""Regression tests for reviewed defects of the RPC layer (``quillcache.rpc``): each fails without its fix.

- the plain-TCP server's accept thread survives a failed accept (EMFILE) and a thread that cannot be started;
- an exception whose message UTF-8 cannot carry (or whose ``__str__`` raises) still gets an error reply;
- ``qtcp://`` ``timeout_s`` is a deadline for the reply, not a limit per ``recv``;
- the ``FRAME_TOO_LARGE`` refusal of a frame past the drop limit reaches the client (server drains before closing;
  client takes a reply that arrived whole when its send fails);
- ``InProcessClient`` refuses arguments that do not bind as a server does (``BAD_ARGUMENTS``).
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import pytest

from quillcache.rpc import (DEFAULT_CODEC, InProcessClient, RpcClient, RpcErrorCode, RpcRejectedError, RpcRemoteError,
                            RpcServer, RpcTimeoutError, StreamServer)
from quillcache.rpc import stream as stream_module
from quillcache.rpc.stream import HEADER
from quillcache.rpc.wire import encode_error_reply, encode_ok_reply, error_from_wire, parse_reply


class Pinger:
    def ping(self) -> str:
        return "pong"

    def get(self, key: str) -> str:
        return key

    def put(self, blob: bytes) -> int:
        return len(blob)


def _wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


# --- 1. the accept thread survives EMFILE and a failed thread start ---------------------------------------------


def test_the_accept_thread_survives_emfile_and_serves_afterwards(monkeypatch):
    real_accept = socket.socket.accept
    failed = []

    def accept_out_of_fds(self):  # the server's accept fails 3 times as under fd pressure, then works again
        if threading.current_thread().name.startswith("emfile-stream-accept") and len(failed) < 3:
            failed.append(1)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept_out_of_fds)
    with StreamServer(Pinger(), ["ping"], name="emfile") as srv, RpcClient(srv.address, timeout_s=2.0) as client:
        assert client.ping() == "pong"
        assert len(failed) == 3 and srv.num_accept_errors == 3
        assert srv._accept_thread.is_alive()


def test_close_cuts_the_accept_pause_short(monkeypatch):
    monkeypatch.setattr(stream_module, "_ACCEPT_RETRY_S", 60.0)
    real_accept = socket.socket.accept

    def accept_out_of_fds(self):
        if threading.current_thread().name.startswith("pause-stream-accept"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept_out_of_fds)
    srv = StreamServer(Pinger(), ["ping"], name="pause").start()
    try:
        assert _wait_until(lambda: srv.num_accept_errors >= 1)  # now pausing 60 s
    finally:
        t = time.monotonic()
        srv.close()
    assert time.monotonic() - t < 5.0 and not srv._accept_thread.is_alive()


def test_a_connection_thread_that_cannot_start_is_closed_and_frees_its_slot(monkeypatch):
    real_start = threading.Thread.start
    refused = []

    def start_once_refused(self):
        if self.name.startswith("nothread-stream:") and not refused:
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_refused)
    real_close = socket.socket.close

    def slow_close(self):  # in the accept thread: widens any window between closing and counting (CI saw 0 == 1)
        real_close(self)
        if threading.current_thread().name.startswith("nothread-stream-accept:"):
            time.sleep(0.3)

    monkeypatch.setattr(socket.socket, "close", slow_close)
    with StreamServer(Pinger(), ["ping"], name="nothread", max_connections=1) as srv:
        with RpcClient(srv.address, timeout_s=2.0) as client:
            with pytest.raises(RpcTimeoutError, match="connection lost"):  # its connection was closed unserved
                client.ping()
            assert refused and srv.num_accept_errors == 1
            assert client.ping() == "pong"  # the slot was freed: max_connections=1 would turn this one away
            assert srv._accept_thread.is_alive()


# --- 2. every error gets a reply -----------------------------------------------------------------------------


class Failing:
    def open_file(self, name: bytes) -> None:
        path = name.decode("utf-8", "surrogateescape")  # a non-UTF-8 file name, as os.listdir gives it
        raise ValueError(f"no such file: {path}")

    def broken(self) -> None:
        raise Unprintable("x")

    def ping(self) -> str:
        return "pong"


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


@pytest.mark.parametrize("server_cls", [RpcServer, StreamServer])
def test_an_error_message_utf8_cannot_carry_still_gets_a_reply(server_cls, caplog):
    caplog.set_level(logging.CRITICAL)
    with server_cls(Failing(), ["open_file", "ping"]) as srv, RpcClient(srv.address, timeout_s=2.0) as client:
        with pytest.raises(RpcRemoteError) as info:
            client.open_file(b"/nonexistent/\xff.bin")
        assert info.value.remote_type == "builtins.ValueError"
        assert info.value.message == "no such file: /nonexistent/\\udcff.bin"
        assert client.ping() == "pong"  # and the stream is still in step


@pytest.mark.parametrize("server_cls", [RpcServer, StreamServer])
def test_an_error_whose_str_raises_still_gets_a_reply(server_cls, caplog):
    caplog.set_level(logging.CRITICAL)
    with server_cls(Failing(), ["broken", "ping"]) as srv, RpcClient(srv.address, timeout_s=2.0) as client:
        with pytest.raises(RpcRemoteError, match="could not be sent") as info:
            client.broken()
        assert info.value.remote_type.endswith("Unprintable")
        assert client.ping() == "pong"


def test_encode_error_reply_never_raises_for_what_the_exception_holds():
    for exc in (Unprintable(), ValueError("\ud800 lone"), RpcRejectedError(RpcErrorCode.BAD_FRAME, "\udcff")):
        rid, ok, payload = parse_reply(DEFAULT_CODEC, encode_error_reply(DEFAULT_CODEC, 7, exc))
        assert rid == 7 and not ok
        back = error_from_wire(DEFAULT_CODEC, payload)  # type: ignore[arg-type]
        assert isinstance(back, (RpcRemoteError, RpcRejectedError))


# --- 5. qtcp:// timeout_s is a deadline -----------------------------------------------------------------------


def test_a_trickling_reply_does_not_hold_the_caller_past_timeout_s():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:  # answers one byte every 0.1 s: about 4 s for the whole reply
        conn, _ = listener.accept()
        with conn:
            (n,) = HEADER.unpack(conn.recv(4, socket.MSG_WAITALL))
            rid = DEFAULT_CODEC.decode(conn.recv(n, socket.MSG_WAITALL))[1]
            reply = encode_ok_reply(DEFAULT_CODEC, rid, "x" * 30)
            for b in HEADER.pack(len(reply)) + reply:
                if stop.wait(0.1):
                    return
                try:
                    conn.sendall(bytes([b]))
                except OSError:
                    return

    server = threading.Thread(target=trickle, daemon=True)
    server.start()
    try:
        with RpcClient(f"qtcp://127.0.0.1:{port}", timeout_s=0.5, spin_s=0) as client:
            t = time.monotonic()
            with pytest.raises(RpcTimeoutError, match="no reply within 0.5 s"):
                client.call("anything")
            assert time.monotonic() - t < 1.5
    finally:
        stop.set()
        server.join(5.0)
        listener.close()


# --- 6. the drop-limit refusal reaches the client -------------------------------------------------------------

_BIG = 32 << 20  # past what the socket buffers of both ends hold, so the sender blocks until the server reads


def test_a_frame_past_the_drop_limit_is_refused_to_the_client(monkeypatch, caplog):
    caplog.set_level(logging.CRITICAL)
    monkeypatch.setattr(stream_module, "_DROP_DRAIN_S", 10.0)  # a slow test machine still drains it all
    with StreamServer(Pinger(), ["put"], max_frame_bytes=1024, drop_frame_bytes=4096) as srv:
        with RpcClient(srv.address, timeout_s=10.0, max_frame_bytes=64 << 20) as client:
            with pytest.raises(RpcRejectedError, match="drop limit") as info:
                client.put(b"x" * _BIG)
            assert info.value.code is RpcErrorCode.FRAME_TOO_LARGE


def test_the_server_reads_the_rest_of_a_dropped_frame_before_closing(monkeypatch, caplog):
    """A raw client sends the whole frame: it can (the server drains it), then reads the refusal and the FIN."""
    caplog.set_level(logging.CRITICAL)
    monkeypatch.setattr(stream_module, "_DROP_DRAIN_S", 10.0)
    with StreamServer(Pinger(), ["put"], max_frame_bytes=1024, drop_frame_bytes=4096) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10.0) as sock:
            sock.sendall(HEADER.pack(_BIG) + bytes(_BIG))  # without the drain: a reset before it is all sent
            (n,) = HEADER.unpack(sock.recv(4, socket.MSG_WAITALL))
            _, ok, payload = parse_reply(DEFAULT_CODEC, sock.recv(n, socket.MSG_WAITALL))
            assert not ok and payload["code"] is RpcErrorCode.FRAME_TOO_LARGE  # type: ignore[index]
            assert sock.recv(1) == b""  # then the server's FIN, not a reset


def test_the_client_takes_a_refusal_that_arrived_before_its_send_failed():
    """A server that answers at the length prefix and closes unread (a reset): the client's send fails, and the
    refusal that is already there whole is what it raises."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    refusal = encode_error_reply(DEFAULT_CODEC, None, RpcRejectedError(RpcErrorCode.FRAME_TOO_LARGE, "too big"))

    def refuse_and_reset() -> None:
        conn, _ = listener.accept()
        conn.recv(4, socket.MSG_WAITALL)
        conn.sendall(HEADER.pack(len(refusal)) + refusal)
        conn.close()  # the rest of the frame unread: a reset

    server = threading.Thread(target=refuse_and_reset, daemon=True)
    server.start()
    try:
        with RpcClient(f"qtcp://127.0.0.1:{listener.getsockname()[1]}", timeout_s=10.0,
                       max_frame_bytes=64 << 20) as client:
            with pytest.raises(RpcRejectedError, match="too big") as info:
                client.put(b"x" * _BIG)
            assert info.value.code is RpcErrorCode.FRAME_TOO_LARGE
    finally:
        server.join(5.0)
        listener.close()


# --- 8. InProcessClient refuses arguments as a server does -----------------------------------------------------


@pytest.mark.parametrize("args, kwargs", [((), {}), (("a", "b"), {}), (("a",), {"nope": 1}), ((), {"x" * 200: 1})])
def test_in_process_arguments_that_do_not_bind_are_refused_as_over_the_wire(args, kwargs, caplog):
    caplog.set_level(logging.CRITICAL)
    errors = []
    with RpcServer(Pinger(), ["get"]) as srv, RpcClient(srv.address, timeout_s=2.0) as remote:
        for client in (remote, InProcessClient(Pinger(), ["get"]), InProcessClient(Pinger(), ["get"], roundtrip=False)):
            with pytest.raises(RpcRejectedError) as info:
                client.invoke("get", args, kwargs)
            errors.append((info.value.code, str(info.value)))
    assert errors[0][0] is RpcErrorCode.BAD_ARGUMENTS
    assert errors[0] == errors[1] == errors[2]


def test_in_process_unknown_method_is_refused_as_over_the_wire(caplog):
    caplog.set_level(logging.CRITICAL)
    with RpcServer(Pinger(), ["get"]) as srv, RpcClient(srv.address, timeout_s=2.0) as remote:
        with pytest.raises(RpcRejectedError) as over_the_wire:
            remote.call("ping")
    with pytest.raises(RpcRejectedError) as in_process:
        InProcessClient(Pinger(), ["get"]).call("ping")
    assert str(in_process.value) == str(over_the_wire.value) and "UNKNOWN_METHOD" in str(in_process.value)
