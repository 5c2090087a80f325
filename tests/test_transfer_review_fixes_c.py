"""Regression tests for the third transfer review's findings (each fails without its fix).

1. A ``SegmentInfo`` opened on a peer process that has exited names no region of another process that
   serves at the same port afterwards: its READ/WRITE is refused (``no region N``) and the new process's
   memory is untouched (an engine serving at a fixed port numbers its regions from a random id). An engine
   on port 0, and the ``local`` backend, still count from 1. Re-opening the segment (the step a restart now
   needs) succeeds at once even on a stale pooled connection (the LIST is tried again on a fresh one).
2. A WRITE that timed out while the peer was not reading is closed with a reset: the peer sees the
   connection reset (not a clean end), and of the payload only what its receive buffer already held
   lands; what sat in our send buffer is discarded, not delivered later.
3. ``host``/``port`` of the tcp (and rdma) backend are checked, naming the option: a bool, a str, a
   port out of 0..65535, an empty host. ``parse_address`` refuses a port of non-ASCII digits.

Processes and servers are stopped in ``finally`` (context managers); waits are polls with deadlines.
"""

from __future__ import annotations

import logging
import socket
import threading

import crc32c
import numpy as np
import pytest

from polling import wait_until

from quillcache.transfer import Op, Outcome, TcpConfig, TransferEngine, TransferError, TransferRequest
from quillcache.transfer.backends.sockets import tune_socket
from quillcache.transfer.backends.tcp_client import parse_address
from quillcache.transfer.peer import PeerProcess
from quillcache.transfer.types import TransferTimeoutError

SECRET = "quillcache-transfer-tests-secret-0123456789"
MiB = 1 << 20
SERVER_LOG = "quillcache.transfer.server"


def _poll(predicate, timeout_s: float, what: str, interval_s: float = 0.005) -> None:
    wait_until(predicate, timeout_s, what, poll_s=interval_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 1: a stale segment reaches another process at the same address ---------------------------------------------

def test_a_segment_of_an_earlier_process_at_the_same_port_names_no_region_of_the_next():
    port = _free_port()
    src = np.full(MiB, 0x5A, dtype=np.uint8)
    with TransferEngine("tcp", secret=SECRET, serve=False) as eng:
        loc = eng.register_region(src)
        with PeerProcess(4 * MiB, secret=SECRET, seed=1, port=port) as old:
            seg = eng.open_segment(old.address)
            stale_id = seg.regions[0].region_id
        with PeerProcess(2 * MiB, secret=SECRET, seed=2, port=port) as new:
            assert new.address == old.address
            before = new.ask(f"crc 0 {2 * MiB}")["crc"]
            with pytest.raises(TransferError, match=f"no region {stale_id}"):
                eng.write(loc, 0, seg, stale_id, MiB, MiB, timeout_s=10)  # the synchronous path
            (st,) = eng.transfer_sync([TransferRequest(Op.WRITE, loc.region_id, 0, seg.segment_id, stale_id, 0,
                                                       MiB)], timeout_s=10)  # the batch path
            assert st.outcome is Outcome.FAILED and f"no region {stale_id}" in st.reason, st
            assert new.ask(f"crc 0 {2 * MiB}")["crc"] == before  # not one byte landed
            assert new.region_id != stale_id
            seg = eng.open_segment(new.address)  # re-opening names the new process's region
            eng.write(loc, 0, seg, new.region_id, MiB, MiB, timeout_s=10)
            assert new.ask(f"crc {MiB} {MiB}")["crc"] == crc32c.crc32c(memoryview(src))


@pytest.mark.parametrize("stop", ["kill", "close"])
def test_re_opening_a_segment_after_a_peer_restart_on_its_port_succeeds_at_once(stop):
    # re-opening is the step a restart now needs (the old region ids name nothing): the pooled connections
    # to the old process are stale and, with no idle probe, the LIST goes out on one; it is tried again
    port = _free_port()
    buf = bytearray(4096)
    with TransferEngine("tcp", secret=SECRET, serve=False, config=TcpConfig(idle_check_s=3600.0)) as eng:
        loc = eng.register_region(buf)
        with PeerProcess(MiB, secret=SECRET, seed=1, port=port) as old:
            seg = eng.open_segment(old.address)
            eng.read(loc, 0, seg, old.region_id, 0, 4096, timeout_s=10)
            old.kill() if stop == "kill" else old.close()
        with PeerProcess(MiB, secret=SECRET, seed=2, port=port) as new:
            seg = eng.open_segment(new.address, timeout_s=10)
            assert [r.region_id for r in seg.regions] == [new.region_id]
            eng.read(loc, 0, seg, new.region_id, 0, 4096, timeout_s=10)
            assert crc32c.crc32c(buf) == new.ask("crc 0 4096")["crc"]


def test_region_ids_start_at_random_only_where_the_engine_serves_at_a_fixed_port():
    port = _free_port()
    ids = []
    for _ in range(2):  # two engines, one after the other, at one address
        with TransferEngine("tcp", secret=SECRET, port=port) as eng:
            assert eng.address.endswith(f":{port}")
            ids.append(eng.register_region(bytearray(64)).region_id)
            assert eng.register_region(bytearray(64)).region_id == ids[-1] + 1
    assert ids[0] != ids[1] and 1 not in ids, ids
    with TransferEngine("tcp", secret=SECRET, port=0) as eng, TransferEngine("local") as local:
        assert eng.register_region(bytearray(64)).region_id == 1
        assert local.register_region(bytearray(64)).region_id == 1
    # asked for (a pool node: its port-0 address may go to a later process), on any backend
    with TransferEngine("local", random_region_ids=True) as a, TransferEngine("local", random_region_ids=True) as b:
        first = a.register_region(bytearray(64)).region_id, b.register_region(bytearray(64)).region_id
    assert first[0] != first[1] and 1 not in first, first


# ---- 2: a timed-out WRITE's connection is reset, its unsent payload dropped --------------------------------------

@pytest.mark.parametrize("fast_path", [True, False], ids=["fast", "plain"])
def test_a_timed_out_write_is_reset_and_its_unsent_payload_never_lands(fast_path, caplog):
    caplog.set_level(logging.DEBUG, logger=SERVER_LOG)
    cfg = TcpConfig(fast_path=fast_path)
    n = 64 * MiB  # far more than the two socket buffers together
    remote = np.zeros(n, dtype=np.uint8)
    src = np.full(n, 0x5A, dtype=np.uint8)
    gate = threading.Event()
    with TransferEngine("tcp", secret=SECRET, config=cfg) as server, \
            TransferEngine("tcp", secret=SECRET, config=cfg, serve=False) as client:
        rdesc = server.register_region(remote)
        checkout = server.regions.checkout

        def stalled_checkout(*args, **kwargs):  # the serving thread stops before taking the WRITE's payload
            if kwargs.get("write"):
                gate.wait(30)
            return checkout(*args, **kwargs)

        server.regions.checkout = stalled_checkout
        srv = server.backend.server
        try:
            loc = client.register_region(src)
            seg = client.open_segment(server.address)
            with pytest.raises(TransferTimeoutError):
                client.write(loc, 0, seg, rdesc.region_id, 0, n, timeout_s=0.5)
        finally:
            gate.set()
        _poll(lambda: not srv._conns, 10, "the server ending the abandoned connection")
        ended = [r.getMessage() for r in caplog.records if r.name == SERVER_LOG and "ended" in r.getMessage()]
        assert ended and "reset" in ended[-1].lower(), ended  # a reset, not a clean end after the whole buffer
        with socket.socket() as probe:  # the most a server-side connection's receive buffer holds
            tune_socket(probe, cfg)
            rcvbuf = probe.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        landed = int(np.count_nonzero(remote))
        assert landed <= rcvbuf, f"{landed} bytes landed, more than the peer's receive buffer of {rcvbuf}"


# ---- 3: host / port checks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("port, error", [(True, TypeError), (False, TypeError), ("8080", TypeError),
                                         (1.5, TypeError), (-1, ValueError), (65536, ValueError),
                                         (70000, ValueError)])
def test_a_bad_port_is_refused_naming_the_option(port, error):
    with pytest.raises(error, match="port"):
        TransferEngine("tcp", secret=SECRET, port=port)


@pytest.mark.parametrize("host, error", [("", ValueError), ("  ", ValueError), (None, TypeError),
                                         (b"127.0.0.1", TypeError), (5, TypeError)])
@pytest.mark.parametrize("backend", ["tcp", "rdma"])
def test_a_bad_host_is_refused_naming_the_option(backend, host, error):
    with pytest.raises(error, match="host"):
        TransferEngine(backend, secret=SECRET, host=host)


def test_every_interface_is_named_explicitly():
    with TransferEngine("tcp", secret=SECRET, host="0.0.0.0", serve=False) as eng:  # accepted; nothing bound
        assert eng.backend.host == "0.0.0.0"


@pytest.mark.parametrize("address", ["127.0.0.1:\u0663\u0663", "127.0.0.1:\uff13\uff13", "127.0.0.1:\u00b2",
                                     "127.0.0.1:3\u0663"])
def test_a_port_of_non_ascii_digits_is_refused(address):
    with pytest.raises(ValueError, match="bad peer address"):
        parse_address(address)
    with TransferEngine("tcp", secret=SECRET, serve=False) as eng:
        with pytest.raises(ValueError, match="bad peer address"):
            eng.open_segment(address, timeout_s=2)
    assert parse_address("127.0.0.1:33") == ("127.0.0.1", 33)
