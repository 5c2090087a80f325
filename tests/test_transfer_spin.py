"""The tcp backend's spin-then-block receive (``TcpConfig.spin_us``) and its socket tuning.

What it shows:

- ``TcpConfig`` rejects a bad ``spin_us`` or ``socket_buffer_bytes`` with an error naming the field.
- A spinning ``Channel`` delivers the exact bytes whether they arrive while it polls or only after
  its spin budget is spent (the blocking fallback), through ``recv_into``, ``recv_two`` and
  ``recv_idle_into``.
- A spinning ``Channel`` notices a peer that closes (``ConnectionError``) or resets the connection
  (``OSError``) at once, long before a 1-s spin budget ends, and never waits past a deadline shorter
  than its budget (``socket.timeout``).
- ``tune_socket`` sets ``TCP_NODELAY`` and buffers of at least the asked size; 0 leaves the kernel's.
- End to end (this process against a peer process), ``spin_us=0`` and a 0.2-s spin move the same
  bytes (crc32c); with the long spin on both sides, a peer SIGKILLed mid-batch (kill point drawn from a
  seeded generator) still ends every request within seconds, not at the deadline, and every
  COMPLETED READ holds the peer's bytes.

Sockets are real TCP connections on 127.0.0.1; senders pause (``time.sleep``) only to make bytes
arrive late: that delay is the stimulus, every wait for a result is a call with a deadline.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import threading
import time

import crc32c
import numpy as np
import pytest

from quillcache.transfer import Op, Outcome, TcpConfig, TransferEngine, TransferRequest
from quillcache.transfer.backends.sockets import Channel, tune_socket
from quillcache.transfer.peer import PeerProcess, fill_pattern

# Spin budgets against a peer process: run alone (make test runs `serial` tests after the parallel part).
pytestmark = pytest.mark.serial

SECRET = "quillcache-transfer-spin-tests-secret-0123"
MiB = 1 << 20
LONG_SPIN_US = 1_000_000


@contextlib.contextmanager
def _tcp_pair():
    """A connected (a, b) pair of TCP sockets on 127.0.0.1; both closed on exit."""
    lsock = socket.create_server(("127.0.0.1", 0))
    a = b = None
    try:
        a = socket.create_connection(lsock.getsockname()[:2], timeout=5)
        b, _ = lsock.accept()
        yield a, b
    finally:
        for s in (a, b, lsock):
            if s is not None:
                s.close()


def _send_later(sock: socket.socket, pieces: list[bytes], gap_s: float) -> threading.Thread:
    def run() -> None:
        for p in pieces:
            time.sleep(gap_s)
            sock.sendall(p)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("field, value", [("spin_us", -1), ("spin_us", 1.5), ("spin_us", True),
                                          ("spin_us", 2_000_000), ("socket_buffer_bytes", -1),
                                          ("socket_buffer_bytes", "4M"), ("socket_buffer_bytes", 1 << 31)])
def test_config_rejects_bad_spin_and_buffer_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TcpConfig(**{field: value})


@pytest.mark.parametrize("spin_us", [0, 20, LONG_SPIN_US])
@pytest.mark.parametrize("gap_s", [0.0, 0.02])
def test_a_spinning_channel_receives_exact_bytes_early_or_late(spin_us, gap_s):
    rng = np.random.default_rng(spin_us + int(gap_s * 1000))
    data = rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    with _tcp_pair() as (a, b):
        ch = Channel(b, progress_s=5.0, spin_us=spin_us)
        # recv_into: the body in three late pieces
        t = _send_later(a, [data[:1000], data[1000:200_000], data[200_000:]], gap_s)
        out = bytearray(len(data))
        ch.recv_into(memoryview(out), time.monotonic() + 10)
        t.join(5)
        assert bytes(out) == data
        # recv_two: a 24-byte head and a body arriving in pieces
        head = bytearray(24)
        body = bytearray(len(data))
        t = _send_later(a, [struct.pack("<3Q", 1, 2, 3) + data[:5], data[5:]], gap_s)
        got = ch.recv_two(memoryview(head), memoryview(body), time.monotonic() + 10)
        if got < len(data):
            ch.recv_into(memoryview(body)[got:], time.monotonic() + 10)
        t.join(5)
        assert struct.unpack("<3Q", head) == (1, 2, 3) and bytes(body) == data
        # recv_idle_into: a request header split in two
        t = _send_later(a, [b"x" * 10, b"y" * 30], gap_s)
        frame = bytearray(40)
        ch.recv_idle_into(memoryview(frame), idle_s=5.0)
        t.join(5)
        assert bytes(frame) == b"x" * 10 + b"y" * 30


@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_spinning_channel_notices_a_dead_peer_at_once(how):
    with _tcp_pair() as (a, b):
        ch = Channel(b, progress_s=10.0, spin_us=LONG_SPIN_US)
        if how == "reset":
            a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
        a.sendall(b"partial")
        closer = threading.Timer(0.05, a.close)
        closer.start()
        start = time.monotonic()
        with pytest.raises(ConnectionError if how == "close" else OSError) as err:
            ch.recv_into(memoryview(bytearray(100)), time.monotonic() + 30)
        elapsed = time.monotonic() - start
        closer.join(5)
    assert elapsed < 0.5, f"a {how} took {elapsed:.3f} s to notice with a {LONG_SPIN_US} us spin budget"
    if how == "close":
        assert "after 7 of 100 bytes" in str(err.value)


@pytest.mark.parametrize("which", ["recv_into", "recv_two"])
def test_a_spinning_channel_never_waits_past_its_deadline(which):
    with _tcp_pair() as (a, b):
        ch = Channel(b, progress_s=10.0, spin_us=LONG_SPIN_US)
        start = time.monotonic()
        with pytest.raises(socket.timeout):
            if which == "recv_into":
                ch.recv_into(memoryview(bytearray(10)), start + 0.05)
            else:
                ch.recv_two(memoryview(bytearray(24)), memoryview(bytearray(10)), start + 0.05)
        elapsed = time.monotonic() - start
    assert 0.04 < elapsed < 0.5, f"a 0.05-s deadline ended after {elapsed:.3f} s (spin budget 1 s)"


@pytest.mark.parametrize("buf", [0, 1 << 20])
def test_tune_socket_sets_nodelay_and_the_asked_buffers(buf):
    with _tcp_pair() as (a, _b):
        before = a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        tune_socket(a, TcpConfig(socket_buffer_bytes=buf))
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        rcv, snd = (a.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_RCVBUF, socket.SO_SNDBUF))
    if buf:
        assert rcv >= buf and snd >= buf  # the kernel doubles the asked size (bookkeeping overhead)
    else:
        assert rcv == before


@pytest.mark.parametrize("spin_us", [0, 200_000])
def test_spin_settings_move_the_same_bytes_end_to_end(spin_us):
    seed, n_bytes = 7, 8 * MiB
    config = TcpConfig(spin_us=spin_us)
    expected = fill_pattern(n_bytes, seed)
    local = np.zeros(n_bytes, dtype=np.uint8)
    sizes = [1, 4096, 65536 + 3, MiB, 2 * MiB + 1]
    with PeerProcess(n_bytes, secret=SECRET, seed=seed, extra_args=("--spin-us", str(spin_us))) as peer, \
            TransferEngine("tcp", secret=SECRET, serve=False, config=config) as engine:
        desc = engine.register_region(local)
        seg = engine.open_segment(peer.address)
        off = 0
        for n in sizes:  # synchronous READs, then the same ranges back as one WRITE batch at other offsets
            engine.read(desc, off, seg, peer.region_id, off, n, timeout_s=20)
            assert crc32c.crc32c(memoryview(local)[off:off + n]) == crc32c.crc32c(memoryview(expected)[off:off + n])
            off += n
        half = n_bytes // 2
        batch = engine.run_sync([TransferRequest(Op.WRITE, desc.region_id, 0, seg.segment_id, peer.region_id,
                                                 half, off)], timeout_s=20)
        assert [s.outcome for s in batch.statuses()] == [Outcome.COMPLETED]
        assert peer.ask(f"crc {half} {off}")["crc"] == crc32c.crc32c(memoryview(expected)[:off])


def test_a_peer_sigkilled_mid_batch_is_noticed_by_spinning_threads_long_before_the_deadline():
    seed = 404
    rng = np.random.default_rng(seed)
    spin_us, timeout_s, n = 200_000, 30.0, 400
    peer_bytes = 32 * MiB
    sizes = [int(math.exp(rng.uniform(math.log(4096), math.log(256 * 1024)))) for _ in range(n)]
    local_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    local = np.zeros(int(local_offsets[-1] + sizes[-1]), dtype=np.uint8)
    with PeerProcess(peer_bytes, secret=SECRET, seed=seed, extra_args=("--spin-us", str(spin_us))) as peer, \
            TransferEngine("tcp", secret=SECRET, serve=False, config=TcpConfig(spin_us=spin_us)) as engine:
        expected = fill_pattern(peer_bytes, seed)
        desc = engine.register_region(local)
        seg = engine.open_segment(peer.address)
        reqs = [TransferRequest(Op.READ, desc.region_id, int(local_offsets[i]), seg.segment_id, peer.region_id,
                                int(rng.integers(0, peer_bytes - k + 1)), k) for i, k in enumerate(sizes)]
        kill_after = int(rng.integers(1, n // 4))
        batch = engine.submit(reqs, timeout_s=timeout_s)
        deadline = time.monotonic() + 30
        while sum(s.outcome is Outcome.COMPLETED for s in batch.statuses()) < kill_after:
            assert time.monotonic() < deadline, f"seed {seed}: {kill_after} completions did not come"
            time.sleep(0.0005)
        peer.kill()
        killed_at = time.monotonic()
        statuses = batch.wait(timeout_s + 10)
        waited_s = time.monotonic() - killed_at
    where = f"seed {seed}, killed after {kill_after} completions"
    assert waited_s < 5.0, f"{where}: requests took {waited_s:.1f} s to end after the kill (deadline {timeout_s} s)"
    assert sum(s.outcome is not Outcome.COMPLETED for s in statuses) > 0, f"{where}: the kill affected nothing"
    for req, st in zip(reqs, statuses):
        if st.outcome is Outcome.COMPLETED:
            a, b, k = req.local_offset_bytes, req.remote_offset_bytes, req.length_bytes
            assert crc32c.crc32c(memoryview(local)[a:a + k]) == crc32c.crc32c(memoryview(expected)[b:b + k]), where
        else:
            assert st.outcome in (Outcome.FAILED, Outcome.TIMEOUT) and st.reason, f"{where}: {st}"


def test_fruitless_spins_back_off_so_a_slow_peer_costs_no_spinning_cpu():
    """A peer that always answers after the spin budget (as one sharing this core would): the first two
    waits spin in vain, then the channel stops spinning, so the next waits cost (almost) no CPU."""
    spin_us, late_s = 20_000, 0.04
    with _tcp_pair() as (a, b):
        ch = Channel(b, progress_s=5.0, spin_us=spin_us)
        cpu_s = []
        for i in range(6):
            t = _send_later(a, [bytes([i]) * 8], late_s)
            out = bytearray(8)
            c0 = time.thread_time()
            ch.recv_into(memoryview(out), time.monotonic() + 10)
            cpu_s.append(time.thread_time() - c0)
            t.join(5)
            assert bytes(out) == bytes([i]) * 8
    assert sum(cpu_s[:2]) > 0.02, f"the first waits did not spin: CPU {cpu_s}"
    assert sum(cpu_s[2:]) < 0.01, f"waits after two fruitless spins still spin: CPU {cpu_s}"
