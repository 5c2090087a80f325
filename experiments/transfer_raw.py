"""The transfer study's ceiling: a raw socket pair between two processes, no protocol beyond a length.

Server (a child process: ``python -m experiments.transfer_raw --bytes N``) holds one pre-touched
buffer, prints ``{"ok": true, "port": P}`` (``RawPeer`` waits for it until its deadline) and serves one connection at a time: each 24-byte request ``<QQQ`` = (op,
offset, length) is answered by ``sendall`` of that range (op 0, READ) or by ``recv_into`` that
range followed by a 1-byte acknowledgement (op 1, WRITE); op 2 answers 16 bytes, its CPU seconds
(user, system) as two doubles; op 3 ends the server. No authentication, no range checks beyond Python's
slicing, no request ids: it is the least any protocol can do over the same loopback. Its sockets
keep the system's congestion control unless ``congestion_control`` names one (both sides).

``RawClient.batch(op, local_view, offsets, length)`` sends every header of a batch at once and
then receives the answers in order (READ data straight into the pre-touched local buffer with
``recv_into``), returning each request's completion time after the batch started.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import struct
import subprocess
import sys
import time

from quillcache.alloc.buffers import aligned_empty

__all__ = ["RawClient", "RawPeer"]

HEADER = struct.Struct("<QQQ")
READ, WRITE, RUSAGE, QUIT = 0, 1, 2, 3


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("raw peer closed the connection")
        got += k


def _congestion(sock: socket.socket, name: str) -> None:
    """Set the TCP congestion control ``name`` ("": keep the system's default)."""
    if name:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())


def serve(n_bytes: int, congestion_control: str = "") -> None:
    buf = aligned_empty(n_bytes, pretouch=True)  # page-aligned like the engine's peer (quillcache.alloc.buffers)
    view = memoryview(buf)
    lsock = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"ok": True, "port": lsock.getsockname()[1]}), flush=True)
    while True:  # one connection at a time, until a QUIT
        conn, _ = lsock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _congestion(conn, congestion_control)
        with conn:
            try:
                if not _serve_one(conn, view):
                    return
            except ConnectionError:
                continue


def _serve_one(conn: socket.socket, view: memoryview) -> bool:
    """Serve one connection; False once asked to quit."""
    head = bytearray(HEADER.size)
    hv = memoryview(head)
    if True:
        while True:
            _recv_into(conn, hv)
            op, off, n = HEADER.unpack(head)
            if op == READ:
                conn.sendall(view[off:off + n])
            elif op == WRITE:
                _recv_into(conn, view[off:off + n])
                conn.sendall(b"\x01")
            elif op == RUSAGE:
                ru = resource.getrusage(resource.RUSAGE_SELF)
                conn.sendall(struct.pack("<dd", ru.ru_utime, ru.ru_stime))
            else:
                return op != QUIT


class RawPeer:
    """The raw server as a child process (context manager; always killed on exit). The constructor waits at most
    ``timeout_s`` for the child's port line; a child that is late, exits or closes its pipe first is killed and
    reaped, and a RuntimeError says which."""

    def __init__(self, n_bytes: int, timeout_s: float = 30.0, congestion_control: str = "") -> None:
        from experiments.transfer_mooncake import read_reply  # the bounded JSON-line read of the study's children

        self.proc = subprocess.Popen([sys.executable, "-m", "experiments.transfer_raw", "--bytes", str(n_bytes),
                                      "--congestion-control", congestion_control], stdout=subprocess.PIPE)
        try:
            msg, _ = read_reply(self.proc, b"", time.monotonic() + timeout_s, "startup", self._fail)
            self.port = msg["port"]
        except BaseException:
            self.close()
            raise

    def _fail(self, what: str) -> RuntimeError:
        rc = self.proc.poll()
        return RuntimeError(f"raw peer (pid {self.proc.pid}): {what} "
                            f"({'still running: killed' if rc is None else f'exited with rc {rc}'})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()

    def __enter__(self) -> "RawPeer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RawClient:
    def __init__(self, port: int, timeout_s: float = 60.0, congestion_control: str = "") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        _congestion(self.sock, congestion_control)
        self.sock.settimeout(None)  # blocking: no poll before each call (the leanest a client can be)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = bytearray(1)

    def batch(self, op: int, local: memoryview, offsets: list[int], length: int) -> list[float]:
        """Move one batch; returns each request's completion time (s) after the batch began."""
        sock = self.sock
        pc = time.perf_counter
        done = []
        t0 = pc()
        if op == READ:
            sock.sendall(b"".join(HEADER.pack(READ, off, length) for off in offsets))
            for off in offsets:
                _recv_into(sock, local[off:off + length])
                done.append(pc() - t0)
        else:
            ack = memoryview(self._ack)
            for off in offsets:
                sock.sendall(HEADER.pack(WRITE, off, length))
                sock.sendall(local[off:off + length])
            for _ in offsets:
                _recv_into(sock, ack)
                done.append(pc() - t0)
        return done

    def rusage(self) -> tuple[float, float]:
        self.sock.sendall(HEADER.pack(RUSAGE, 0, 0))
        out = bytearray(16)
        _recv_into(self.sock, memoryview(out))
        return struct.unpack("<dd", out)

    def close(self) -> None:
        """Hang up; the server goes back to accepting (``RawPeer.close`` ends it)."""
        self.sock.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--congestion-control", default="", help="TCP congestion control ('': the system's default)")
    args = ap.parse_args()
    serve(args.bytes, args.congestion_control)
