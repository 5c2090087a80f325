"""``TransferEngine``'s API on the ``local`` and ``tcp`` backends, and the wire protocol's codecs.

What it shows (issue 13, items 1-3):

- Registering a NumPy buffer, a bytearray, read-only bytes and a ``LocalKvStore``'s segments
  (``register_store``) copies nothing: a transfer reads the owner's current bytes and lands in the
  owner's buffer. Read-only buffers are refused as WRITE targets (local READ destination or remote
  WRITE destination), FAILED at submit.
- ``submit`` → ``wait`` gives one outcome per request, in order; a request with an invalid local or
  remote range (or region, or segment) ends FAILED at submit with a reason naming it and is never sent
  (the tcp server sees no request; the remote bytes stay as they were).
- ``wait(timeout)`` raises ``TransferTimeoutError`` while requests are still running and leaves the
  batch running; the in-flight bound refuses a submit past it and starts none of it; a closed engine
  refuses work; ``unregister_region`` waits for the transfers in flight on the region.
- The backend registry lists tcp, local and rdma; a tcp engine without a secret is a ``ValueError``
  naming the environment variable.
- Protocol frames round-trip (Hypothesis) and every malformed field raises ``ProtocolError`` (never
  ``struct.error`` or anything else); a wrong proof raises ``AuthenticationError``.

The stalls the timeout tests need come from a real peer process paused with SIGSTOP (and always
resumed); every wait is a poll or a blocking call with a deadline.
"""

from __future__ import annotations

import os
import signal
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from polling import wait_stopped as _poll_stopped

from quillcache.registry import UnknownNameError
from quillcache.store.dram import LocalKvStore
from quillcache.store.keys import StoreKey
from quillcache.transfer import (
    BACKENDS,
    SECRET_ENV,
    AuthenticationError,
    Op,
    Outcome,
    ProtocolError,
    RegionError,
    RemoteRegion,
    TransferEngine,
    TransferError,
    TransferRequest,
    TransferTimeoutError,
)
from quillcache.transfer import protocol as P
from quillcache.transfer.peer import PeerProcess, fill_pattern

SECRET = "quillcache-transfer-tests-secret-0123456789"
U32, U64 = (1 << 32) - 1, (1 << 64) - 1


def _engine(backend: str, **kw) -> TransferEngine:
    return TransferEngine(backend, secret=SECRET, **kw) if backend == "tcp" else TransferEngine(backend, **kw)


@pytest.fixture(params=["local", "tcp"])
def pair(request):
    """Two engines of one backend: ``a`` initiates, ``b`` serves."""
    a, b = _engine(request.param), _engine(request.param)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _served_requests(engine: TransferEngine) -> int | None:
    server = getattr(engine.backend, "server", None)
    return None if server is None else server.stats.requests


def _req(op, local, lo, seg, remote, ro, n) -> TransferRequest:
    return TransferRequest(op, getattr(local, "region_id", local), lo, getattr(seg, "segment_id", seg),
                           getattr(remote, "region_id", remote), ro, n)


# ---- registering buffers ----------------------------------------------------------------------------------------

def test_register_numpy_bytearray_and_readonly_bytes_copies_nothing(pair):
    a, b = pair
    served = np.arange(4096, dtype=np.uint32)  # 16 KiB, itemsize 4: registered as its bytes
    landing = bytearray(16384)
    frozen = bytes(range(256)) * 16
    r_served = b.register_region(served, name="served")
    r_frozen = b.register_region(frozen, name="frozen")
    r_landing = a.register_region(landing)
    assert (r_served.length_bytes, r_served.writable) == (served.nbytes, True)
    assert (r_frozen.length_bytes, r_frozen.writable) == (4096, False)
    assert r_landing.length_bytes == 16384 and r_landing.writable
    seg = a.open_segment(b.address)
    assert seg.by_name("frozen") == RemoteRegion(r_frozen.region_id, 4096, "frozen", False)

    served[:] = 0xA5A5A5A5  # changed AFTER registering: a transfer must see the owner's current bytes
    a.read(r_landing, 0, seg, r_served.region_id, 0, served.nbytes)
    assert landing == served.tobytes()
    a.read(r_landing, 100, seg, r_frozen.region_id, 10, 1000)
    assert landing[100:1100] == frozen[10:1010]

    landing[:] = os.urandom(len(landing))
    a.write(r_landing, 0, seg, r_served.region_id, 0, 8192)  # lands in the owner's array itself
    assert served.tobytes()[:8192] == bytes(landing[:8192])


def test_register_refuses_what_it_cannot_serve():
    with TransferEngine("local") as e:
        with pytest.raises(TypeError, match="buffer protocol"):
            e.register_region([1, 2, 3])
        with pytest.raises(RegionError, match="at least one byte"):
            e.register_region(bytearray())
        with pytest.raises(RegionError, match="C-contiguous"):
            e.register_region(np.zeros((8, 8), dtype=np.uint8)[:, ::2])
        with pytest.raises(RegionError, match="read-only"):
            e.register_region(b"frozen bytes", writable=True)
        e.register_region(bytearray(8), name="x")
        with pytest.raises(RegionError, match="already registered"):
            e.register_region(bytearray(8), name="x")
        assert not e.register_region(bytearray(8), writable=False).writable


def test_register_store_serves_every_segment_and_a_stored_block(pair):
    a, b = pair
    store = LocalKvStore(8 << 20, segment_bytes=2 << 20)
    try:
        key = StoreKey(7, b"\x07" * 16)
        block = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8)
        loc = store.put(key, block)
        descs = b.register_store(store)
        assert [d.name for d in descs] == [f"dram-{i}" for i in range(store.num_segments)]
        assert all(d.length_bytes == 2 << 20 and d.writable for d in descs)
        local = np.zeros(1 << 20, dtype=np.uint8)
        r = a.register_region(local)
        seg = a.open_segment(b.address)
        remote = seg.by_name(f"dram-{loc.segment_id}")
        a.read(r, 5, seg, remote.region_id, loc.offset_bytes, loc.size_bytes)  # the block, as the store holds it
        assert local[5:5 + loc.size_bytes].tobytes() == block.tobytes()
        local[:4096] = 0x5A
        last = seg.by_name(f"dram-{store.num_segments - 1}")
        a.write(r, 0, seg, last.region_id, (2 << 20) - 4096, 4096)  # into the store's own memory
        assert store.segment_view(store.num_segments - 1)[-4096:] == b"\x5a" * 4096
        with pytest.raises(TypeError, match="LocalKvStore"):
            b.register_store(bytearray(10))
    finally:
        store.close()


def test_readonly_buffers_are_refused_as_write_targets_at_submit(pair):
    a, b = pair
    frozen_remote = bytes(4096)
    frozen_local = bytes(4096)
    writable_local = bytearray(b"\x11" * 4096)
    rr = b.register_region(frozen_remote)
    rl = a.register_region(frozen_local)
    wl = a.register_region(writable_local)
    seg = a.open_segment(b.address)
    before = _served_requests(b)
    batch = a.submit([_req(Op.WRITE, wl, 0, seg, rr, 0, 4096),   # remote target is read-only
                      _req(Op.READ, rl, 0, seg, rr, 0, 4096)])   # local target is read-only
    statuses = batch.statuses()  # FAILED at submit: no wait needed
    assert [s.outcome for s in statuses] == [Outcome.FAILED, Outcome.FAILED], statuses
    assert f"remote region {rr.region_id}" in statuses[0].reason and "read-only" in statuses[0].reason
    assert f"region {rl.region_id} is read-only" in statuses[1].reason
    assert frozen_remote == bytes(4096) and frozen_local == bytes(4096)
    assert _served_requests(b) == before
    assert a.inflight_requests == 0


# ---- submit, wait, outcomes -------------------------------------------------------------------------------------

def test_submit_then_wait_gives_one_outcome_per_request_in_order(pair):
    a, b = pair
    remote = np.frombuffer(bytes(range(256)) * 64, dtype=np.uint8).copy()  # 16 KiB
    local = bytearray(16384)
    rr, rl = b.register_region(remote), a.register_region(local)
    seg = a.open_segment(b.address)
    local[8192:12288] = b"\xee" * 4096
    reqs = [_req(Op.READ, rl, 0, seg, rr, 256, 1000),
            _req(Op.WRITE, rl, 8192, seg, rr, 12288, 4096),
            _req(Op.READ, rl, 2000, seg, rr.region_id + 99, 0, 10),      # no such remote region
            _req(Op.READ, rl, 2000, seg.segment_id + 99, rr, 0, 10),     # no such segment
            _req(Op.READ, rl, 4000, seg, rr, 0, 1)]
    batch = a.submit(reqs, timeout_s=10)
    assert len(batch) == 5
    statuses = a.wait(batch, timeout_s=10)
    assert statuses == a.status(batch) == batch.statuses()
    assert [s.outcome for s in statuses] == [Outcome.COMPLETED, Outcome.COMPLETED, Outcome.FAILED,
                                             Outcome.FAILED, Outcome.COMPLETED], statuses
    assert [s.transferred_bytes for s in statuses] == [1000, 4096, 0, 0, 1]
    assert statuses[0].reason == "" and f"no region {rr.region_id + 99}" in statuses[2].reason
    assert f"segment {seg.segment_id + 99} is not open" in statuses[3].reason
    assert bytes(local[:1000]) == remote[256:1256].tobytes() and local[4000] == remote[0]
    assert remote[12288:].tobytes() == b"\xee" * 4096
    assert batch.done and a.inflight_requests == 0
    assert a.submit([]).wait(0) == []


@pytest.mark.parametrize("case", ["local-offset", "local-end", "remote-offset", "remote-end", "local-region"])
def test_an_invalid_range_fails_at_submit_naming_it_and_is_never_sent(pair, case):
    a, b = pair
    remote, local = bytearray(b"\x01" * 4096), bytearray(b"\x02" * 1024)
    rr, rl = b.register_region(remote), a.register_region(local)
    seg = a.open_segment(b.address)
    lo, ro, n, lreg = {"local-offset": (1024, 0, 1, rl.region_id), "local-end": (1000, 0, 25, rl.region_id),
                       "remote-offset": (0, 4096, 1, rl.region_id), "remote-end": (0, 4000, 97, rl.region_id),
                       "local-region": (0, 0, 8, rl.region_id + 50)}[case]
    expected = {"local-offset": "range [1024, 1025) lies outside region",
                "local-end": "range [1000, 1025) lies outside region",
                "remote-offset": "remote range [4096, 4097) lies outside region",
                "remote-end": "remote range [4000, 4097) lies outside region",
                "local-region": f"no region {rl.region_id + 50}"}[case]
    before = _served_requests(b)
    for op in (Op.READ, Op.WRITE):
        batch = a.submit([_req(op, lreg, lo, seg, rr, ro, n)], timeout_s=10)
        (st,) = batch.statuses()  # terminal before wait: decided at submit
        assert st.outcome is Outcome.FAILED and expected in st.reason, (op, st)
        assert batch.wait(0) == [st]
    assert remote == b"\x01" * 4096 and local == b"\x02" * 1024
    assert _served_requests(b) == before
    assert a.inflight_requests == 0


def test_sync_read_and_write_raise_transfererror_naming_the_bad_range(pair):
    a, b = pair
    rr, rl = b.register_region(bytearray(4096)), a.register_region(bytearray(1024))
    seg = a.open_segment(b.address)
    before = _served_requests(b)
    with pytest.raises(TransferError, match=r"remote range \[4000, 4097\) lies outside region"):
        a.read(rl, 0, seg, rr.region_id, 4000, 97)
    with pytest.raises(TransferError, match=r"range \[1000, 1025\) lies outside region"):
        a.write(rl, 1000, seg, rr.region_id, 0, 25)
    with pytest.raises(TransferError, match=f"segment {seg.segment_id + 1} is not open"):
        a.read(rl, 0, seg.segment_id + 1, rr.region_id, 0, 8)
    assert _served_requests(b) == before
    a.write(rl, 0, seg, rr.region_id, 3072, 1024)  # and a good one goes through
    assert a.inflight_requests == 0


def test_malformed_requests_raise_at_submit_and_start_nothing():
    with TransferEngine("local") as a, TransferEngine("local") as b:
        rr, rl = b.register_region(bytearray(64)), a.register_region(bytearray(64))
        seg = a.open_segment(b.address)
        good = _req(Op.READ, rl, 0, seg, rr, 0, 8)
        with pytest.raises(ValueError, match="length_bytes"):
            a.submit([good, _req(Op.READ, rl, 0, seg, rr, 0, 0)])
        with pytest.raises(ValueError, match="local_offset_bytes"):
            a.submit([_req(Op.READ, rl, -1, seg, rr, 0, 8)])
        with pytest.raises(TypeError, match="TransferRequest"):
            a.submit([good, ("READ", 1, 0)])
        with pytest.raises(TypeError, match="Op"):
            a.submit([TransferRequest("READ", rl.region_id, 0, seg.segment_id, rr.region_id, 0, 8)])
        with pytest.raises(ValueError, match="timeout_s"):
            a.submit([good], timeout_s=0)
        assert a.inflight_requests == 0
        assert a.transfer_sync([good])[0].outcome is Outcome.COMPLETED


# ---- the in-flight bound, timeouts and unregister, against a paused real peer -----------------------------------


@pytest.fixture
def paused_peer_engine():
    """``(peer, engine, local region, segment)`` with the engine connected; ``pause()`` SIGSTOPs the peer
    (resumed by ``resume()`` and always at teardown)."""
    with PeerProcess(1 << 20, secret=SECRET, seed=11) as peer:
        state = {"stopped": False}

        def pause() -> None:
            os.kill(peer.pid, signal.SIGSTOP)
            state["stopped"] = True
            _poll_stopped(peer.pid)

        def resume() -> None:
            if state["stopped"]:
                os.kill(peer.pid, signal.SIGCONT)
                state["stopped"] = False

        try:
            with TransferEngine("tcp", secret=SECRET, serve=False, max_inflight_requests=4) as engine:
                local = np.zeros(1 << 20, dtype=np.uint8)
                desc = engine.register_region(local)
                seg = engine.open_segment(peer.address)
                engine.read(desc, 0, seg, peer.region_id, 0, 4096)  # the pooled connection is up
                yield peer, engine, local, desc, seg, pause, resume
        finally:
            resume()


def test_wait_timeout_raises_while_requests_run_and_leaves_them_running(paused_peer_engine):
    peer, engine, local, desc, seg, pause, resume = paused_peer_engine
    pause()
    batch = engine.submit([_req(Op.READ, desc, 0, seg, peer.region_id, 0, 65536)], timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="1 of 1 requests still in flight"):
        engine.wait(batch, timeout_s=0.2)
    assert time.monotonic() - t0 >= 0.2
    assert not batch.done and batch.statuses()[0].outcome is Outcome.PENDING
    resume()
    (st,) = engine.wait(batch, timeout_s=20)
    assert st.outcome is Outcome.COMPLETED, st
    assert local[:65536].tobytes() == fill_pattern(1 << 20, 11)[:65536].tobytes()


def test_inflight_bound_refuses_a_submit_past_it_and_starts_none_of_it(paused_peer_engine):
    peer, engine, local, desc, seg, pause, resume = paused_peer_engine
    with pytest.raises(TransferError, match="limit of 4"):
        engine.submit([_req(Op.READ, desc, 0, seg, peer.region_id, 0, 8)] * 5)
    assert engine.inflight_requests == 0
    pause()
    held = engine.submit([_req(Op.READ, desc, i * 4096, seg, peer.region_id, i * 4096, 4096) for i in range(3)],
                         timeout_s=30)
    assert engine.inflight_requests == 3
    with pytest.raises(TransferError, match="3 requests in flight; 2 more would pass the limit of 4"):
        engine.submit([_req(Op.READ, desc, 0, seg, peer.region_id, 0, 8)] * 2)
    assert engine.inflight_requests == 3
    one = engine.submit([_req(Op.READ, desc, 65536, seg, peer.region_id, 0, 8)], timeout_s=30)
    assert engine.inflight_requests == 4
    resume()
    assert all(s.outcome is Outcome.COMPLETED for s in engine.wait(held, 20) + engine.wait(one, 20))
    assert engine.inflight_requests == 0


def test_unregister_waits_for_transfers_in_flight(paused_peer_engine):
    peer, engine, local, desc, seg, pause, resume = paused_peer_engine
    pause()
    batch = engine.submit([_req(Op.READ, desc, 0, seg, peer.region_id, 0, 8192)], timeout_s=30)
    with pytest.raises(RegionError, match=f"region {desc.region_id} still has 1 transfers in flight"):
        engine.unregister_region(desc, timeout_s=0.1)
    seen: dict[str, object] = {}

    def unregister() -> None:
        try:
            engine.unregister_region(desc, timeout_s=20)
            seen["batch_done_at_return"] = batch.done
        except BaseException as e:  # reported by the assertion below
            seen["error"] = e

    t = threading.Thread(target=unregister)
    t.start()
    try:
        resume()
        t.join(30)
        assert not t.is_alive() and "error" not in seen, seen
        assert seen["batch_done_at_return"] is True
        assert batch.statuses()[0].outcome is Outcome.COMPLETED
    finally:
        t.join(30)
    (st,) = engine.submit([_req(Op.READ, desc, 0, seg, peer.region_id, 0, 8)]).statuses()
    assert st.outcome is Outcome.FAILED and f"no region {desc.region_id}" in st.reason


# ---- lifetime, registry, configuration --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["local", "tcp"])
def test_a_closed_engine_refuses_work(backend):
    peer = _engine(backend)
    e = _engine(backend)
    try:
        rr, rl = peer.register_region(bytearray(64)), e.register_region(bytearray(64))
        seg = e.open_segment(peer.address)
        e.close()
        e.close()  # idempotent
        assert e.closed
        with pytest.raises(TransferError, match="closed"):
            e.register_region(bytearray(8))
        with pytest.raises(TransferError, match="closed"):
            e.open_segment(peer.address)
        with pytest.raises(TransferError, match="closed"):
            e.submit([_req(Op.READ, rl, 0, seg, rr, 0, 8)])
        with pytest.raises(TransferError, match="closed"):
            e.read(rl, 0, seg, rr.region_id, 0, 8)
        assert e.inflight_requests == 0
    finally:
        e.close()
        peer.close()


def test_backend_registry_lists_tcp_local_and_rdma():
    assert {"tcp", "local", "rdma"} <= set(BACKENDS.names())
    with pytest.raises(UnknownNameError, match="rdma") as info:
        TransferEngine("carrier-pigeon")
    assert isinstance(info.value, ValueError) and "local" in str(info.value) and "tcp" in str(info.value)


def test_a_missing_secret_is_a_clear_valueerror(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=f"shared secret.*{SECRET_ENV}"):
        TransferEngine("tcp")
    monkeypatch.setenv(SECRET_ENV, "")
    with pytest.raises(ValueError, match=SECRET_ENV):
        TransferEngine("tcp")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TransferEngine("tcp", secret="short")
    with pytest.raises(TypeError, match="secret must be str or bytes"):
        TransferEngine("tcp", secret=1234567890123456789)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    with TransferEngine("tcp") as e:  # the environment variable is enough
        assert e.address.startswith("127.0.0.1:")


def test_an_unknown_backend_option_is_refused_by_name():
    with pytest.raises(TypeError, match="secret"):
        TransferEngine("local", secret=SECRET)


# ---- the protocol's codecs --------------------------------------------------------------------------------------

_DATA_OPS = st.sampled_from([P.Opcode.READ, P.Opcode.WRITE])
_MAX = 1 << 30


@given(op=_DATA_OPS, rid=st.integers(0, U64), region=st.integers(0, U32), offset=st.integers(0, U64),
       length=st.integers(1, _MAX))
def test_request_frames_round_trip(op, rid, region, offset, length):
    frame = P.encode_request(op, rid, region, offset, length)
    assert len(frame) == P.REQUEST.size == 64
    assert P.decode_request(frame, _MAX) == P.RequestHeader(op, rid, region, offset, length)
    assert P.decode_request(memoryview(bytearray(frame)), _MAX) == P.RequestHeader(op, rid, region, offset, length)


@given(op=st.sampled_from([P.Opcode.LIST, P.Opcode.PING]), rid=st.integers(0, U64))
def test_control_request_frames_round_trip(op, rid):
    assert P.decode_request(P.encode_request(op, rid, 0, 0, 0), 1) == P.RequestHeader(op, rid, 0, 0, 0)


@given(status=st.sampled_from(list(P.Status)), rid=st.integers(0, U64), length=st.integers(0, U64))
def test_response_frames_round_trip(status, rid, length):
    if status is not P.Status.OK:
        length %= P.MAX_REASON_BYTES + 1
    frame = P.encode_response(status, rid, length)
    assert len(frame) == P.RESPONSE.size == 64
    assert P.decode_response(frame) == P.ResponseHeader(status, rid, length)


_REGIONS = st.lists(st.builds(RemoteRegion, st.integers(0, U32), st.integers(0, U64), st.text(max_size=20),
                              st.booleans()), max_size=20)


@given(regions=_REGIONS)
def test_region_lists_round_trip(regions):
    assert P.decode_regions(P.encode_regions(regions)) == tuple(regions)


@given(secret=st.binary(min_size=16, max_size=64), other=st.binary(min_size=16, max_size=64),
       s_nonce=st.binary(min_size=32, max_size=32), c_nonce=st.binary(min_size=32, max_size=32))
def test_handshake_frames_round_trip_and_a_wrong_secret_is_an_authentication_error(secret, other, s_nonce, c_nonce):
    assert P.decode_hello(P.encode_hello(s_nonce)) == s_nonce
    proof = P.encode_proof(c_nonce, P.client_proof(secret, s_nonce, c_nonce))
    assert P.decode_proof(proof, secret, s_nonce) == c_nonce
    accept = P.encode_accept(P.server_proof(secret, s_nonce, c_nonce))
    assert P.decode_accept(accept, secret, s_nonce, c_nonce) is None
    if other != secret:
        with pytest.raises(AuthenticationError, match="proof does not match"):
            P.decode_proof(proof, other, s_nonce)
        with pytest.raises(AuthenticationError, match="proof does not match"):
            P.decode_accept(accept, other, s_nonce, c_nonce)
    # a proof is bound to both nonces: a recorded one is useless for the next connection
    if s_nonce != c_nonce:
        with pytest.raises(AuthenticationError):
            P.decode_proof(proof, secret, c_nonce)


def _request_fields(frame: bytes) -> list:
    return list(P.REQUEST.unpack(frame))


_REQ_FIELD = {"magic": 0, "version": 1, "opcode": 2, "flags": 3, "request_id": 4, "region": 5, "reserved": 6,
              "offset": 7, "length": 8}


@given(data=st.data(), op=st.sampled_from(list(P.Opcode)),
       field=st.sampled_from(["magic", "version", "opcode", "flags", "reserved", "length", "control_fields",
                              "size"]))
def test_every_malformed_request_field_raises_protocolerror(data, op, field):
    if op in (P.Opcode.READ, P.Opcode.WRITE):
        good = P.encode_request(op, 5, 3, 100, 4096)
    else:
        good = P.encode_request(op, 5, 0, 0, 0)
    f = _request_fields(good)
    if field == "magic":
        f[0] = data.draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != b"QCTR"))
        match = "bad request magic"
    elif field == "version":
        f[1] = data.draw(st.integers(0, 255).filter(lambda v: v != P.PROTOCOL_VERSION))
        match = "unsupported request protocol version"
    elif field == "opcode":
        f[2] = data.draw(st.integers(len(P.Opcode), 255))
        match = "unknown opcode"
    elif field == "flags":
        f[3] = data.draw(st.integers(1, 0xFFFF))
        match = "reserved bits"
    elif field == "reserved":
        f[6] = data.draw(st.integers(1, U32))
        match = "reserved bits"
    elif field == "length":
        if op in (P.Opcode.READ, P.Opcode.WRITE):
            f[8] = data.draw(st.sampled_from([0, 4097, U64]))
            match = "zero-length" if f[8] == 0 else "exceeds the server's limit 4096"
        else:
            f[8] = data.draw(st.integers(1, U64))
            match = "carries region/offset/length"
    elif field == "control_fields":
        if op in (P.Opcode.READ, P.Opcode.WRITE):
            return  # region and offset are free for data requests; the range check is the server's
        which = data.draw(st.sampled_from([5, 7]))
        f[which] = data.draw(st.integers(1, U32))
        match = "carries region/offset/length"
    else:
        frame = good[:data.draw(st.integers(0, 63))] if data.draw(st.booleans()) else good + b"\0"
        with pytest.raises(ProtocolError, match=f"request header is {len(frame)} bytes, expected 64"):
            P.decode_request(frame, 4096)
        return
    with pytest.raises(ProtocolError, match=match):
        P.decode_request(P.REQUEST.pack(*f), 4096)


@given(data=st.data(), field=st.sampled_from(["magic", "version", "status", "reserved", "reason", "size"]))
def test_every_malformed_response_field_raises_protocolerror(data, field):
    good = P.encode_response(P.Status.OUT_OF_RANGE, 9, 10)
    f = list(P.RESPONSE.unpack(good))
    if field == "magic":
        f[0] = data.draw(st.binary(min_size=4, max_size=4).filter(lambda m: m != b"QCTS"))
        match = "bad response magic"
    elif field == "version":
        f[1] = data.draw(st.integers(0, 255).filter(lambda v: v != P.PROTOCOL_VERSION))
        match = "unsupported response protocol version"
    elif field == "status":
        f[2] = data.draw(st.integers(len(P.Status), 255))
        match = "unknown status"
    elif field == "reserved":
        f[3] = data.draw(st.integers(1, 0xFFFF))
        match = "reserved bits"
    elif field == "reason":
        f[5] = data.draw(st.integers(P.MAX_REASON_BYTES + 1, U64))
        match = "exceeds 4096"
    else:
        frame = good[:data.draw(st.integers(0, 63))] if data.draw(st.booleans()) else good + b"\0"
        with pytest.raises(ProtocolError, match="response header is"):
            P.decode_response(frame)
        return
    with pytest.raises(ProtocolError, match=match):
        P.decode_response(P.RESPONSE.pack(*f))


@pytest.mark.parametrize("frame, decode", [
    (P.encode_hello(b"n" * 32), lambda f: P.decode_hello(f)),
    (P.encode_proof(b"c" * 32, b"m" * 32), lambda f: P.decode_proof(f, b"k" * 16, b"n" * 32)),
    (P.encode_accept(b"m" * 32), lambda f: P.decode_accept(f, b"k" * 16, b"n" * 32, b"c" * 32)),
], ids=["hello", "proof", "accept"])
def test_malformed_handshake_frames_raise_protocolerror(frame, decode):
    with pytest.raises(ProtocolError, match="bytes, expected"):
        decode(frame[:-1])
    with pytest.raises(ProtocolError, match="bytes, expected"):
        decode(frame + b"x")
    with pytest.raises(ProtocolError, match="magic"):
        decode(b"XXXX" + frame[4:])
    with pytest.raises(ProtocolError, match="protocol version 1"):  # version 1 peers are refused by name
        decode(frame[:4] + b"\x01" + frame[5:])


@pytest.mark.parametrize("body, match", [
    (b"\xc1", "not msgpack"),                                  # a reserved msgpack byte
    (b"\x92\x01", "not msgpack"),                              # truncated
    (P.msgpack.packb({"a": 1}), "must be a list"),
    (P.msgpack.packb([[1, 2, "x"]]), "malformed region entry"),
    (P.msgpack.packb([[1, -2, "x", True]]), "malformed region entry"),
    (P.msgpack.packb([[1 << 32, 2, "x", True]]), "malformed region entry"),
    (P.msgpack.packb([[True, 2, "x", True]]), "malformed region entry"),
    (P.msgpack.packb([[1, 2, b"x", True]]), "malformed region entry"),
    (P.msgpack.packb([[1, 2, "x", 1]]), "malformed region entry"),
    (P.msgpack.packb([[1, 2.0, "x", True]]), "malformed region entry"),
    (P.msgpack.packb([1]), "malformed region entry"),
])
def test_malformed_region_lists_raise_protocolerror(body, match):
    with pytest.raises(ProtocolError, match=match):
        P.decode_regions(body)


@pytest.mark.parametrize("args", [
    (P.Opcode.READ, -1, 0, 0, 1), (P.Opcode.READ, 1 << 64, 0, 0, 1), (P.Opcode.READ, 1, 1 << 32, 0, 1),
    (P.Opcode.READ, 1, 0, -1, 1), (P.Opcode.READ, 1, 0, 1 << 64, 1), (P.Opcode.READ, 1, 0, 0, 1 << 64),
    (P.Opcode.READ, 1, 0, 0, -5), (256, 1, 0, 0, 1), (-1, 1, 0, 0, 1), (P.Opcode.READ, 1, 0, 0, 1, 1 << 16),
])
def test_encoding_a_field_out_of_its_width_raises_protocolerror_not_struct_error(args):
    with pytest.raises(ProtocolError, match="out of range"):
        P.encode_request(*args)


def test_struct_error_never_escapes_a_decoder():
    for decode, size in ((lambda f: P.decode_request(f, _MAX), 64), (P.decode_response, 64),
                         (P.decode_hello, 64), (lambda f: P.decode_proof(f, b"k" * 16, b"n" * 32), 128),
                         (lambda f: P.decode_accept(f, b"k" * 16, b"n" * 32, b"c" * 32), 64)):
        for n in (0, 1, size - 1, size + 1, 4096):
            with pytest.raises(ProtocolError):
                decode(b"\0" * n)
    assert not isinstance(ProtocolError("x"), struct.error)

