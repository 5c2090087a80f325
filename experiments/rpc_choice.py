"""Which RPC stack serves the master: pyzmq + msgpack against grpcio, measured on loopback.

Each stack serves the same two methods from a child process (``python -m experiments.rpc_choice
--serve STACK`` prints ``{"port": P}``) over one dict of ``NUM_KEYS`` keys with ``VALUE_BYTES`` values:

- ``get(key)`` -> the value: single-key round trips per second from one client, calls one after another;
- ``batch_get(keys)`` -> the values of ``KEYS_PER_BATCH`` keys: keys per second through batched calls.

Both stacks carry the same msgpack bodies, so only the transport and its Python layers differ:

- ``zmq``: a DEALER client and a ROUTER server, one frame per message, body ``[version, id, method, args, kwargs]``;
- ``grpc``: grpcio's generic handler (``method_handlers_generic_handler`` + ``unary_unary_rpc_method_handler``
  with identity serializers, no ``.proto``), a synchronous channel, the server's default thread pool;
- ``quillcache.rpc``: the package built on the chosen stack (codec, request ids, whitelist, error mapping),
  to show what the layers above the transport cost.

Every cell is the median of ``REPS`` repetitions, each visiting every stack in turn (the spread is printed
beside it). Every client call gives up after ``CALL_TIMEOUT_S`` (a dead server raises, never hangs). grpcio
is not a project dependency: the script looks for it on ``sys.path`` (``pip install --target DIR grpcio`` and
``PYTHONPATH=DIR``) and reports the stack as absent otherwise. Run by hand: ``python -m experiments.rpc_choice``;
it prints its table and writes nothing to ``results/`` (it is not a registered study).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import msgpack

REPS = 5
SINGLE_CALLS = 5_000  # per repetition
BATCH_CALLS = 20  # per repetition
KEYS_PER_BATCH = 1_000
NUM_KEYS = 10_000
VALUE_BYTES = 100
WARMUP_CALLS = 200
CALL_TIMEOUT_S = 30.0  # every client's limit on one call (a dead or stuck server raises, never hangs)
STACKS = ("zmq", "grpc", "quillcache.rpc")


def _keys() -> list[str]:
    return [f"model-7b/tenant-3/block-{i:08d}" for i in range(NUM_KEYS)]


class _Store:
    """What every server serves: a dict lookup, single and batched."""

    def __init__(self) -> None:
        self.data = {k: bytes([i % 251]) * VALUE_BYTES for i, k in enumerate(_keys())}

    def get(self, key: str) -> bytes:
        return self.data[key]

    def batch_get(self, keys: list[str]) -> list[bytes]:
        d = self.data
        return [d[k] for k in keys]


# --- servers (child process) -----------------------------------------------------------------------


def _serve_zmq(store: _Store) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(json.dumps({"port": port}), flush=True)
    methods = {"get": store.get, "batch_get": store.batch_get}
    packb, unpackb = msgpack.packb, msgpack.unpackb
    while True:
        ident, body = sock.recv_multipart(copy=False)
        _v, rid, method, args, kwargs = unpackb(body.buffer)
        sock.send_multipart([ident, packb([1, rid, True, methods[method](*args, **kwargs)])], copy=False)


def _serve_grpc(store: _Store) -> None:
    from concurrent import futures

    import grpc

    def unary(fn):
        return grpc.unary_unary_rpc_method_handler(lambda body, ctx: msgpack.packb(fn(*msgpack.unpackb(body))))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench", {"get": unary(store.get), "batch_get": unary(store.batch_get)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"port": port}), flush=True)
    server.wait_for_termination()


def _serve_quillcache(store: _Store) -> None:
    import threading

    from quillcache.rpc import RpcServer

    with RpcServer(store, ["get", "batch_get"]) as server:
        print(json.dumps({"port": server.port}), flush=True)
        threading.Event().wait()


# --- clients (this process) ------------------------------------------------------------------------


class _ZmqClient:
    def __init__(self, port: int) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(CALL_TIMEOUT_S * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, int(CALL_TIMEOUT_S * 1000))
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.rid = 0

    def call(self, method: str, *args):
        import zmq

        self.rid += 1
        try:
            self.sock.send(msgpack.packb([1, self.rid, method, list(args), {}]))
            _v, rid, ok, value = msgpack.unpackb(self.sock.recv())
        except zmq.Again:
            raise TimeoutError(f"zmq {method}: no reply within {CALL_TIMEOUT_S:g} s (server dead or stuck)") from None
        assert ok and rid == self.rid
        return value

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class _GrpcClient:
    def __init__(self, port: int) -> None:
        import grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(self.channel).result(timeout=CALL_TIMEOUT_S)
        self.stubs = {m: self.channel.unary_unary(f"/bench/{m}") for m in ("get", "batch_get")}

    def call(self, method: str, *args):
        return msgpack.unpackb(self.stubs[method](msgpack.packb(list(args)), timeout=CALL_TIMEOUT_S))

    def close(self) -> None:
        self.channel.close()


class _QuillcacheClient:
    def __init__(self, port: int) -> None:
        from quillcache.rpc import RpcClient

        self.client = RpcClient(f"tcp://127.0.0.1:{port}", timeout_s=CALL_TIMEOUT_S)

    def call(self, method: str, *args):
        return self.client.call(method, *args)

    def close(self) -> None:
        self.client.close()


CLIENTS = {"zmq": _ZmqClient, "grpc": _GrpcClient, "quillcache.rpc": _QuillcacheClient}


def _available(stack: str) -> bool:
    try:
        __import__({"zmq": "zmq", "grpc": "grpc", "quillcache.rpc": "zmq"}[stack])
    except ImportError:
        return False
    return True


class _Peer:
    """One stack's server (a child process) and a client connected to it. If anything fails before
    the peer is ready (the server's start, the client's connection, the warm-up calls), the child is
    killed and reaped before the error propagates: a failed start leaves no server running."""

    def __init__(self, stack: str) -> None:
        self.stack = stack
        self.keys = _keys()
        self.proc = subprocess.Popen([sys.executable, "-m", "experiments.rpc_choice", "--serve", stack],
                                     stdout=subprocess.PIPE, text=True)
        try:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{stack} server exited with {self.proc.wait(30)} before it was ready")
            self.client = CLIENTS[stack](json.loads(line)["port"])
            for i in range(WARMUP_CALLS):
                assert len(self.client.call("get", self.keys[i])) == VALUE_BYTES
        except BaseException:
            self.close()
            raise

    def single_rt_per_s(self, rep: int) -> float:
        keys, call = self.keys, self.client.call
        t0 = time.perf_counter()
        for i in range(SINGLE_CALLS):
            call("get", keys[(rep * SINGLE_CALLS + i) % NUM_KEYS])
        return SINGLE_CALLS / (time.perf_counter() - t0)

    def batch_keys_per_s(self) -> float:
        t0 = time.perf_counter()
        for b in range(BATCH_CALLS):
            lo = (b * KEYS_PER_BATCH) % NUM_KEYS
            assert len(self.client.call("batch_get", self.keys[lo:lo + KEYS_PER_BATCH])) == KEYS_PER_BATCH
        return BATCH_CALLS * KEYS_PER_BATCH / (time.perf_counter() - t0)

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def measure(stacks: list[str]) -> list[dict]:
    """Single-key round trips/s and batched keys/s per stack, medians of ``REPS`` repetitions.

    Every server runs for the whole measurement and each repetition visits every stack in turn, so a
    disturbance of the machine (other processes on its few cores) falls on all stacks alike."""
    peers: list[_Peer] = []
    try:
        for stack in stacks:
            peers.append(_Peer(stack))
        singles: dict[str, list[float]] = {s: [] for s in stacks}
        batches: dict[str, list[float]] = {s: [] for s in stacks}
        for rep in range(REPS):
            for peer in peers:
                singles[peer.stack].append(peer.single_rt_per_s(rep))
                batches[peer.stack].append(peer.batch_keys_per_s())
    finally:
        for peer in peers:
            peer.close()
    return [{"stack": s, "single_rt_per_s": statistics.median(singles[s]), "single_min": min(singles[s]),
             "single_max": max(singles[s]), "batch_keys_per_s": statistics.median(batches[s]),
             "batch_min": min(batches[s]), "batch_max": max(batches[s])} for s in stacks]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.rpc_choice", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", choices=STACKS, help=argparse.SUPPRESS)
    ap.add_argument("--stacks", default=",".join(STACKS))
    args = ap.parse_args(argv)
    if args.serve:
        {"zmq": _serve_zmq, "grpc": _serve_grpc, "quillcache.rpc": _serve_quillcache}[args.serve](_Store())
        return 0
    versions = {"msgpack": msgpack.version}
    stacks = []
    for stack in args.stacks.split(","):
        if stack not in STACKS:
            ap.error(f"unknown stack {stack!r}; known: {list(STACKS)}")
        if _available(stack):
            stacks.append(stack)
        else:
            print(f"{stack}: not importable, skipped")
    rows = measure(stacks)
    import zmq

    versions["pyzmq"] = zmq.__version__
    versions["libzmq"] = zmq.zmq_version()
    try:
        import grpc

        versions["grpcio"] = grpc.__version__
    except ImportError:
        pass
    print(f"loopback, two processes, {REPS} repetitions (median [min-max]); value {VALUE_BYTES} B, "
          f"batch {KEYS_PER_BATCH} keys; versions {versions}")
    print(f"{'stack':<16} {'single-key round trips/s':>32} {'batched keys/s':>36}")
    for r in rows:
        print(f"{r['stack']:<16} {r['single_rt_per_s']:>12,.0f} [{r['single_min']:,.0f}-{r['single_max']:,.0f}]"
              f" {r['batch_keys_per_s']:>16,.0f} [{r['batch_min']:,.0f}-{r['batch_max']:,.0f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
