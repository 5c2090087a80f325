"""The master's limits against clients that misbehave, and the clients that keep working beside them.

- Batch size: every batch method refuses more than ``MAX_BATCH_KEYS`` keys with INVALID_PARAMS naming the
  method, the count and the limit, before any work (nothing logged, nothing removed); ``MasterClient`` splits
  longer batches into calls under the cap and returns the same per-key results, in order.
- The plain-TCP port's idle timeout: a ``MasterClient`` whose idle connection the server closed goes on on a
  fresh one, and a write is run exactly once (also when it crossed the server's goodbye); a client turned away
  by a saturated plain-TCP port falls back to ZeroMQ at once (the write not reported "may or may not have
  run"), stays there while the port is saturated, and moves back to plain TCP after ``STREAM_RETRY_AFTER_S``.
- Untrusted values in the master's error messages are cut (``MAX_MESSAGE_CHARS``), on their own and per key.

Servers are the master's endpoint behind both transports in this process (as ``run_server`` builds them), on
127.0.0.1 and free ports, always closed; waits poll with deadlines.
"""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager

import numpy as np
import pytest
from polling import wait_until

import quillcache.master.client as client_module
import quillcache.master.server as server_module
from quillcache.master import (InvalidParamsError, MasterConfig, ObjectNotFoundError, PutRequest,
                               SegmentDescriptor)
from quillcache.master.client import MasterClient
from quillcache.master.server import MasterEndpoint, SingleMaster
from quillcache.master.wire import MAX_BATCH_KEYS, NODE_METHODS, SERVICE_METHODS, register_master_types
from quillcache.rpc import RpcClient, RpcServer, StreamServer
from quillcache.rpc.errors import MAX_MESSAGE_CHARS
from quillcache.rpc.stream import StreamConnection

DEADLINE_S = 10.0
IDLE_S = 0.3


def until(predicate, what: str, deadline_s: float = DEADLINE_S):
    return wait_until(predicate, deadline_s, what, poll_s=0.005)


class Master:
    """The master's endpoint served over ZeroMQ and plain TCP in this process (what ``run_server`` builds)."""

    def __init__(self, **stream_kw) -> None:
        register_master_types()
        self.node = SingleMaster.open(None, MasterConfig(defer_index_publish=True))
        self.endpoint = MasterEndpoint(self.node)
        methods = [*SERVICE_METHODS, *NODE_METHODS]
        self.zmq = RpcServer(self.endpoint, methods, name="master", after_reply=self.endpoint.after_reply)
        self.stream = StreamServer(self.endpoint, methods, name="master", after_reply=self.endpoint.after_reply,
                                   **stream_kw)

    def close(self) -> None:
        self.stream.close()
        self.zmq.close()
        self.node.close()


@contextmanager
def serve_master(**stream_kw):
    m = Master(**stream_kw)
    try:
        m.zmq.start()
        m.stream.start()
        m.endpoint.stream_address = m.stream.address
        yield m
    finally:
        m.close()


def seg(i: int) -> SegmentDescriptor:
    return SegmentDescriptor(node_id=f"n{i}", segment_id=i, capacity_bytes=1 << 24, endpoint=f"127.0.0.1:{7000 + i}")


# --- batch size ----------------------------------------------------------------------------------------------


def _oversized_calls(n: int) -> dict[str, tuple[list, dict]]:
    keys = [f"k{i}" for i in range(n)]
    return {
        "get_replicas": ([keys], {}), "get_replicas_compact": ([keys], {}), "get_replicas_columns": ([keys], {}),
        "exists": ([keys], {}), "batch_remove": ([["victim"] + keys[1:]], {"force": True}),
        "batch_put_end": ([keys], {}), "batch_put_revoke": ([keys], {}),
        "batch_put_start": ([[PutRequest(key=k, size_bytes=10) for k in keys]], {}),
        "batch_put_start_returning": ([[PutRequest(key=k, size_bytes=10) for k in keys]], {}),
        "batch_put_start_compact": ([[[k, 10, 1, None, 0, None] for k in keys]], {}),
        "batch_put_start_columns": ([keys, np.full(n, 10, dtype="<i8").tobytes()], {}),
    }


def test_every_batch_method_refuses_more_than_the_cap_before_any_work():
    with serve_master() as m, MasterClient(m.zmq.address, timeout_s=DEADLINE_S, prefer_stream=False) as c, \
            RpcClient(m.stream.address, timeout_s=DEADLINE_S) as raw:
        c.mount_segment(seg(0))
        r = c.put_start("victim", 10)
        c.put_end("victim", put_id=r.put_id)
        lsn = c.stats().lsn
        calls = _oversized_calls(MAX_BATCH_KEYS + 1)
        assert set(calls) == set(server_module._KEYS_ARG)  # every batch method
        for method, (args, kwargs) in calls.items():
            with pytest.raises(InvalidParamsError) as info:
                raw.call(method, *args, **kwargs)  # RpcClient: no splitting on this side
            assert info.value.message.startswith(f"{method}: {MAX_BATCH_KEYS + 1} ") and \
                f"limit of {MAX_BATCH_KEYS} per call (MAX_BATCH_KEYS)" in info.value.message, info.value.message
        assert c.stats().lsn == lsn and c.exists(["victim"]) == [True]  # nothing logged, nothing removed
        at_cap = [f"k{i}" for i in range(MAX_BATCH_KEYS)]
        assert raw.call("exists", at_cap) == [False] * MAX_BATCH_KEYS  # the cap itself is served


@pytest.mark.parametrize("transport", ["stream", "embedded"])
def test_master_client_splits_batches_past_the_cap_and_keeps_the_results(monkeypatch, transport):
    cap = 8
    monkeypatch.setattr(server_module, "MAX_BATCH_KEYS", cap)  # the endpoint refuses more than 8 keys per call
    monkeypatch.setattr(client_module, "MAX_BATCH_KEYS", cap)
    with serve_master() as m:
        c = MasterClient(m.stream.address, timeout_s=DEADLINE_S) if transport == "stream" else \
            MasterClient.embedded(m.node.service)
        try:
            with pytest.raises(InvalidParamsError, match="limit of 8 per call"):
                c._rpc.call("exists", [f"k{i}" for i in range(cap + 1)])  # the cap holds on this endpoint
            c.mount_segment(seg(0))
            keys = [f"k{i}" for i in range(3 * cap - 3)]  # three calls, the last one short
            started = c.batch_put_start([PutRequest(key=k, size_bytes=10) for k in keys])
            assert [type(r).__name__ for r in started] == ["PutStartResult"] * len(keys)
            assert c.batch_put_end(keys, put_ids=[r.put_id for r in started]) == [None] * len(keys)
            assert c.exists([*keys, "missing"]) == [True] * len(keys) + [False]
            got = c.get_replicas(keys)
            assert got == [r.replicas for r in started]
            assert c.get_replicas_columns(keys).to_list() == got
            more = [f"m{i}" for i in range(2 * cap + 1)]
            more[cap + 3] = ""  # an invalid key in the second call: its error lands on its own row
            cols = c.batch_put_start_columns(more, np.full(len(more), 10), replica_num=1)
            assert len(cols) == len(more) and set(cols.errors) == {cap + 3}
            assert isinstance(cols.errors[cap + 3], InvalidParamsError)
            ok = [i for i in range(len(more)) if i != cap + 3]
            assert c.batch_put_revoke([more[i] for i in ok], put_ids=[int(cols.put_ids[i]) for i in ok]) == \
                [None] * len(ok)
            assert c.batch_remove(keys, force=True) == [None] * len(keys)
            assert c.exists(keys) == [False] * len(keys)
            back = c.batch_put_start_returning([PutRequest(key=k, size_bytes=10) for k in keys + ["new"]])
            assert [type(r).__name__ for r in back] == ["StaleObjectError"] * len(keys) + ["PutStartResult"]
            assert c.batch_put_end(["new"], put_ids=[back[-1].put_id]) == [None]
            m.node.service.check_invariants()
        finally:
            c.close()


def test_master_client_sends_a_batch_past_the_real_cap_in_calls_the_master_accepts():
    with serve_master() as m, MasterClient(m.zmq.address, timeout_s=DEADLINE_S) as c:
        keys = [f"k{i}" for i in range(MAX_BATCH_KEYS + 5)]
        assert c.exists(keys) == [False] * len(keys)
        out = c.get_replicas(keys)
        assert len(out) == len(keys) and all(isinstance(e, ObjectNotFoundError) for e in out)
        assert c.address == m.stream.address


# --- the plain-TCP port: idle connections, saturation -------------------------------------------------------


def test_a_client_whose_idle_connection_was_closed_goes_on_and_writes_once(monkeypatch):
    with serve_master(idle_timeout_s=IDLE_S) as m, MasterClient(m.zmq.address, timeout_s=DEADLINE_S) as c:
        c.mount_segment(seg(0))
        assert c.address == m.stream.address
        until(lambda: m.stream.num_timed_out == 1, "the idle connection to be closed")
        c.mount_segment(seg(1))  # the goodbye seen before sending: a fresh connection
        until(lambda: m.stream.num_timed_out == 2, "the idle connection to be closed again")
        monkeypatch.setattr(StreamConnection, "_peer_done", lambda self: False)  # the goodbye crosses the request
        c.mount_segment(seg(2))  # its reply is the goodbye: never run, so sent again on a fresh connection
        assert c.address == m.stream.address and [s.segment_id for s in c.segments()] == [0, 1, 2]


def test_a_client_turned_away_by_the_plain_tcp_port_falls_back_to_zeromq(monkeypatch):
    retry_after_s = 1.0
    monkeypatch.setattr(client_module, "STREAM_RETRY_AFTER_S", retry_after_s)
    with serve_master(max_connections=1) as m, socket.create_connection(("127.0.0.1", m.stream.port)) as hog:
        until(lambda: m.stream.num_connections == 1, "the hog to take the only slot")
        with MasterClient(m.zmq.address, timeout_s=DEADLINE_S, retry_s=DEADLINE_S) as c:
            t0 = time.monotonic()
            c.mount_segment(seg(0))  # a write, turned away (so not run) on plain TCP: sent over ZeroMQ at once
            assert m.stream.num_turned_away == 1 and c.address == m.zmq.address
            assert [s.segment_id for s in c.segments()] == [0]  # run exactly once
            for _ in range(5):
                assert c.exists(["k"]) == [False]
            if time.monotonic() - t0 < retry_after_s:  # (a machine this slow would rightly try plain TCP again)
                assert m.stream.num_turned_away == 1  # stays on ZeroMQ: no try on plain TCP for every call
            hog.close()
            until(lambda: m.stream.num_connections == 0, "the hog's slot to be freed")
            until(lambda: c.exists(["k"]) == [False] and c.address == m.stream.address,
                  "the client to move back to plain TCP after STREAM_RETRY_AFTER_S")


# --- untrusted values in the master's messages ----------------------------------------------------------------


def test_a_huge_key_gets_a_cut_message_alone_and_in_a_batch():
    big = "\x00" * (1 << 20)
    with serve_master() as m, MasterClient(m.stream.address, timeout_s=DEADLINE_S) as c, \
            RpcClient(m.stream.address, timeout_s=DEADLINE_S) as raw:
        with pytest.raises(ObjectNotFoundError) as info:
            raw.call("get_replica_list", big)  # the plain method: the service's message quotes the key
        assert len(info.value.message) < MAX_MESSAGE_CHARS + 100 and "more characters" in info.value.message
        (err,) = c.get_replicas([big])
        assert isinstance(err, ObjectNotFoundError) and len(err.message) < MAX_MESSAGE_CHARS + 100
        assert c.exists(["still serving"]) == [False]
