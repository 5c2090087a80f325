"""What a request frame makes a server hold while it decodes (``quillcache.rpc.codec``'s request limits and
``quillcache.rpc.dispatch``'s bound on large frames handled at once; review s34/servers H1): frames that msgpack
would blow up into many times their size (arrays of empty arrays, maps, nested extension values) are refused
``BAD_FRAME`` naming the limit while they decode, with the memory traced during the refusal a small multiple of the
frame; the largest requests the master and a pool node really send still pass; replies are not limited; only
``max_large_decodes`` large frames are decoded at once whatever the number of callers; a refused frame's value is
let go before the refusal waits for the call lock. Servers bind 127.0.0.1 on free ports and are closed by
``with``; waits poll with deadlines."""

from __future__ import annotations

import socket
import struct
import threading
import time
import tracemalloc

import msgpack
import pytest

from quillcache.master.types import PinKind, PutRequest, ReplicaConfig
from quillcache.master.wire import MAX_BATCH_KEYS, encode_sizes, put_rows, register_master_types
from quillcache.rpc import Codec, RpcClient, RpcErrorCode, StreamServer
from quillcache.rpc.codec import EXT_TUPLE
from quillcache.rpc.dispatch import Dispatcher
from quillcache.rpc.wire import encode_request
from tests.test_rpc_stream import recv_exact

LEN = struct.Struct(">I")
DEADLINE_S = 10.0
LARGE = 64 << 10  # the size from which the limits apply (codec.BUDGET_FRAME_BYTES), as a literal on purpose


def _codec() -> Codec:
    return register_master_types(Codec())


class Target:
    """Stands for the master and a pool node: the methods take the batches they take and count them."""

    def batch_put_start(self, requests: list, client_id: str | None = None) -> int:
        return len(requests)

    def batch_put_start_compact(self, rows: list, client_id: str | None = None) -> int:
        return len(rows)

    def batch_put_start_columns(self, keys: list, sizes: bytes, **kwargs) -> int:
        return len(keys)

    def batch_put_end(self, keys: list, put_ids: list | None = None) -> int:
        return len(keys)

    def persist(self, items: list) -> int:
        return len(items)

    def keys(self, n: int) -> list[str]:
        return [f"k{i}" for i in range(n)]

    def echo(self, value: object) -> object:
        return value


METHODS = ["batch_put_start", "batch_put_start_compact", "batch_put_start_columns", "batch_put_end", "persist",
           "keys", "echo"]


def _array(n: int, item: bytes) -> bytes:
    return b"\xdd" + struct.pack(">I", n) + item * n


def _chunks(item: bytes, per_chunk: int, total_bytes: int) -> bytes:
    """An array of arrays of ``per_chunk`` ``item``: each inner array under any per-array cap."""
    chunk = _array(per_chunk, item)
    return _array(max(1, total_bytes // len(chunk)), chunk)


def _reply(codec: Codec, frame: bytes) -> list:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False, ext_hook=lambda c, d: codec.decode(
        msgpack.packb(msgpack.ExtType(c, d))))


def _handle_traced(dispatcher: Dispatcher, frame: bytes) -> tuple[list, int]:
    """The reply to ``frame`` and the peak of memory traced while it was handled."""
    tracemalloc.start()
    try:
        reply = dispatcher.handle(frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return _reply(dispatcher.codec, reply), peak


def _refusal(reply: list) -> tuple[str, str]:
    assert reply[2] is False, reply
    return reply[3]["attrs"]["code"].value, reply[3]["message"]


# --- frames that decode into many times their size are refused while they decode ---------------------------------

def test_the_reviewers_frame_is_refused_before_it_builds_anything():
    """H1's reproducer: one array of 2^20 empty arrays (1 MiB on the wire, about 64 MiB decoded)."""
    dispatcher = Dispatcher(Target(), METHODS, _codec(), 64 << 20)
    frame = _array(1 << 20, b"\x90")
    reply, peak = _handle_traced(dispatcher, frame)
    code, message = _refusal(reply)
    assert code == "BAD_FRAME" and "max_array_len" in message, message
    assert peak < 4 * len(frame), f"{peak} bytes traced for a frame of {len(frame)}"


@pytest.mark.parametrize("item, per_chunk", [
    (b"\x90", 100_000),  # []: an empty list
    (b"\x91\x90", 50_000),  # [[]]
    (b"\x80", 100_000),  # {}: an empty dict
    (b"\x81\x00\xc0", 30_000),  # {0: None}
])
def test_containers_past_the_frame_budget_are_refused_naming_the_limit(item, per_chunk):
    """Nesting gets around a per-array cap; the budget of containers per frame byte does not."""
    dispatcher = Dispatcher(Target(), METHODS, _codec(), 64 << 20)
    frame = _chunks(item, per_chunk, 1 << 20)
    reply, peak = _handle_traced(dispatcher, frame)
    code, message = _refusal(reply)
    assert code == "BAD_FRAME" and "container units" in message and "BYTES_PER_CONTAINER" in message, message
    assert peak < 24 * len(frame), f"{peak} bytes traced for a frame of {len(frame)} ({peak / len(frame):.0f}x)"


def test_nested_extension_values_past_the_budget_are_refused_naming_the_limit():
    """Each level of nesting unpacks its payload again: 60 tuples around 1 MiB held about 60 copies of it."""
    dispatcher = Dispatcher(Target(), METHODS, _codec(), 64 << 20)
    value = msgpack.packb([b"x" * (1 << 20)], use_bin_type=True)
    for _ in range(60):
        value = msgpack.packb([msgpack.ExtType(EXT_TUPLE, value)])
    frame = msgpack.packb([1, 7, "echo", [msgpack.ExtType(EXT_TUPLE, value)], {}])
    reply, peak = _handle_traced(dispatcher, frame)
    code, message = _refusal(reply)
    assert reply[1] is None and code == "BAD_FRAME" and "EXT_BYTES_FACTOR" in message, message
    assert peak < 16 * len(frame), f"{peak} bytes traced for a frame of {len(frame)} ({peak / len(frame):.0f}x)"


def test_a_well_formed_call_with_hostile_arguments_is_refused_too():
    """The limits hold whatever the request's outer fields: a served method with an argument of 1 MiB of []."""
    dispatcher = Dispatcher(Target(), METHODS, _codec(), 64 << 20)
    frame = msgpack.packb([1, 9, "echo", [msgpack.unpackb(_chunks(b"\x90", 100_000, 1 << 20))], {}])
    code, message = _refusal(_reply(dispatcher.codec, dispatcher.handle(frame)))
    assert code == "BAD_FRAME" and "container units" in message


# --- what the project really sends still passes; replies are not limited ----------------------------------------

def _keys(width: int) -> list[str]:
    return [f"{i:x}".rjust(width, "0") for i in range(MAX_BATCH_KEYS)]


@pytest.mark.parametrize("width", [1, 40])
def test_the_largest_real_requests_pass(width):
    """MAX_BATCH_KEYS keys in each batch form the master serves and in a node's persist, the densest with the
    shortest distinct keys; all of them past the size from which the limits apply."""
    codec = _codec()
    dispatcher = Dispatcher(Target(), METHODS, codec, 64 << 20)
    keys = _keys(width)
    n = len(keys)
    requests = [PutRequest(key=k, size_bytes=i + 1, config=ReplicaConfig(replica_num=2, preferred_segment=3),
                           pin=PinKind.SOFT, digest=b"d" * 16) for i, k in enumerate(keys)]
    calls = [
        ("batch_put_start", [requests], {"client_id": "c"}),
        ("batch_put_start_compact", [put_rows([PutRequest(key=k, size_bytes=1) for k in keys])], {"client_id": "c"}),
        ("batch_put_start_columns", [keys, encode_sizes(list(range(1, n + 1)))],
         {"replica_num": 1, "preferred_segment": None, "pin": PinKind.NONE, "digests": None, "client_id": "c"}),
        ("batch_put_end", [keys], {"put_ids": list(range(n))}),
        ("persist", [[(k, i * 64, 64) for i, k in enumerate(keys)]], {}),
    ]
    for method, args, kwargs in calls:
        frame = encode_request(codec, 5, method, args, kwargs)
        assert len(frame) >= LARGE, (method, len(frame))
        reply = _reply(codec, dispatcher.handle(frame))
        assert reply[2] is True and reply[3] == n, (method, reply[3])


def test_the_per_array_cap_is_well_above_the_largest_batch():
    from quillcache.rpc.codec import MAX_REQUEST_ITEMS
    assert MAX_REQUEST_ITEMS >= 8 * MAX_BATCH_KEYS


def test_replies_and_small_frames_are_not_limited():
    """A client decodes a reply of any shape (``keys()`` of a big master); a frame under the size the limits
    start at decodes as before."""
    codec = _codec()
    with StreamServer(Target(), METHODS, codec=codec) as server, \
            RpcClient(server.address, timeout_s=DEADLINE_S, codec=codec) as client:
        assert len(client.keys(300_000)) == 300_000  # past MAX_REQUEST_ITEMS in one array
        assert client.echo([[]] * 1000) == [[]] * 1000  # one container per byte, in a small frame
    assert codec.decode(_array(300_000, b"\x90")) == [[]] * 300_000


# --- large frames handled at once --------------------------------------------------------------------------------

class SlowCodec(Codec):
    """Counts the decodes under way, and holds each until ``gate`` opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.mu = threading.Lock()
        self.active = 0
        self.peak = 0

    def decode(self, data):
        with self.mu:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            self.gate.wait(DEADLINE_S)
            return super().decode(data)
        finally:
            with self.mu:
                self.active -= 1


def _until(cond, timeout_s: float = DEADLINE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_only_two_large_frames_decode_at_once_whatever_the_callers():
    codec = SlowCodec()
    dispatcher = Dispatcher(Target(), METHODS, codec, 64 << 20)
    frame = encode_request(codec, 1, "echo", ["x" * LARGE], {})
    replies: list[bytes] = []
    threads = [threading.Thread(target=lambda: replies.append(dispatcher.handle(frame))) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        assert _until(lambda: codec.active >= 2)
        assert not _until(lambda: codec.active > 2, 0.5), f"{codec.active} large frames decoding at once"
    finally:
        codec.gate.set()
        for t in threads:
            t.join(DEADLINE_S)
    assert codec.peak == 2
    assert len(replies) == 6 and all(_reply(codec, r)[3] == "x" * LARGE for r in replies)


def test_small_frames_do_not_wait_for_large_ones():
    codec = SlowCodec()
    dispatcher = Dispatcher(Target(), METHODS, codec, 64 << 20)
    big = encode_request(codec, 1, "echo", ["x" * LARGE], {})
    threads = [threading.Thread(target=dispatcher.handle, args=(big,)) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        assert _until(lambda: codec.active == 2)
        small = encode_request(codec, 2, "echo", ["small"], {})
        done = threading.Event()
        out: list[bytes] = []
        threading.Thread(target=lambda: (out.append(dispatcher.handle(small)), done.set())).start()
        assert _until(lambda: codec.active == 3)  # decoding beside the two large ones, not waiting for them
    finally:
        codec.gate.set()
        for t in threads:
            t.join(DEADLINE_S)
    assert done.wait(DEADLINE_S) and _reply(codec, out[0])[3] == "small"


def test_a_refused_frame_lets_go_of_its_value_before_waiting_for_the_lock():
    """A request refused after decoding (here: a wrong version) held its whole value, through the refusal's
    traceback, while it waited for the server's call lock."""
    codec = _codec()
    dispatcher = Dispatcher(Target(), METHODS, codec, 64 << 20)
    frame = msgpack.packb([2, 3, "echo", [[[1, 2, 3, 4, 5, 6, 7]] * 60_000], {}])
    held: list[int] = []

    class Lock:
        def __enter__(self):
            held.append(tracemalloc.get_traced_memory()[0])

        def __exit__(self, *exc):
            return None

    tracemalloc.start()
    try:
        reply = _reply(codec, dispatcher.handle(frame, Lock()))
    finally:
        tracemalloc.stop()
    assert _refusal(reply)[0] == "BAD_VERSION"
    assert held and held[0] < len(frame), f"{held[0]} bytes held when the refusal took the lock"


def test_a_stream_server_refuses_the_reviewers_frame_from_many_connections_and_serves_on():
    codec = _codec()
    frame = _chunks(b"\x90", 100_000, 1 << 20)
    with StreamServer(Target(), METHODS, codec=codec) as server:
        socks = [socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S) for _ in range(4)]
        try:
            for s in socks:
                s.sendall(LEN.pack(len(frame)) + frame)
            for s in socks:
                (n,) = LEN.unpack(recv_exact(s, 4))
                code, message = _refusal(_reply(codec, recv_exact(s, n)))
                assert code == "BAD_FRAME" and "container units" in message
        finally:
            for s in socks:
                s.close()
        with RpcClient(server.address, timeout_s=DEADLINE_S, codec=codec) as client:
            assert client.echo(RpcErrorCode.BAD_FRAME) is RpcErrorCode.BAD_FRAME


