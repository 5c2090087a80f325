"""A standalone serving peer: ``python -m quillcache.transfer.peer --bytes N [--seed S] [--port P]``.

It registers one pre-touched region of ``N`` bytes (filled from ``--seed`` with a NumPy generator,
so a client can recompute the expected bytes), serves it on ``127.0.0.1`` over the ``tcp`` backend
with the secret read from ``QUILLCACHE_TRANSFER_SECRET``, and prints one JSON line
``{"address": "host:port", "region_id": …, "bytes": …, "pid": …}`` when it is ready.

Then it reads commands, one per line, from stdin and answers each with one JSON line:
``rusage`` → this process's CPU seconds (user, system); ``crc OFFSET LENGTH`` → the crc32c of that
range of its region (a malformed command or a range outside the region: ``{"error": …}``; the peer
keeps serving); ``stats`` → the server's counters; ``waits`` → its compiled receive-wait
counters (spins, paid, preempted, blocked; summed over open connections). EOF on stdin (or SIGTERM) stops it cleanly.
Tests and the transfer study start it as a real second process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import threading
import signal
import sys

import crc32c
import numpy as np

from quillcache.alloc.buffers import aligned_empty, aligned_zeros
from quillcache.transfer.backends.sockets import TcpConfig
from quillcache.transfer.engine import TransferEngine

__all__ = ["PeerProcess", "fill_pattern", "main"]


def fill_pattern(n_bytes: int, seed: int) -> np.ndarray:
    """The bytes a peer started with ``--seed`` holds: deterministic, so the client can check them."""
    return np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8)


class PeerProcess:
    """A peer in a child process, as a context manager that always kills it (``with PeerProcess(...) as p``).

    ``address`` and ``region_id`` come from its ready line, awaited with a deadline (never a fixed
    sleep); ``ask(command)`` sends one stdin command and returns its JSON answer; ``kill()`` SIGKILLs
    it; ``close()`` ends it (EOF, then SIGKILL past ``timeout_s``) and reaps it.
    """

    def __init__(self, n_bytes: int, *, secret: str, seed: int | None = None, port: int = 0,
                 timeout_s: float = 30.0, extra_args: tuple[str, ...] = ()) -> None:
        args = [sys.executable, "-m", "quillcache.transfer.peer", "--bytes", str(n_bytes), "--port", str(port),
                *extra_args]
        if seed is not None:
            args += ["--seed", str(seed)]
        env = dict(os.environ, QUILLCACHE_TRANSFER_SECRET=secret)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.timeout_s = timeout_s
        try:
            ready = self._line(timeout_s)
        except BaseException:
            self.kill()
            raise
        self.address: str = ready["address"]
        self.region_id: int = ready["region_id"]
        self.pid: int = ready["pid"]

    def _line(self, timeout_s: float) -> dict:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if box and not box[0]:  # EOF: the peer's stdout closed (it exited, or is exiting)
            try:
                code = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(f"peer process (pid {self.proc.pid}) exited (code {code}) without answering")
        if not box:
            raise RuntimeError(f"peer process (pid {self.proc.pid}) gave no answer within {timeout_s} s "
                               f"(exit code {self.proc.poll()})")
        return json.loads(box[0])

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line(self.timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(self.timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _crc_command(region: np.ndarray, args: list[str]) -> dict:
    """``crc OFFSET LENGTH``: the crc32c of exactly that range, or an error naming what is wrong (never a
    shorter range's crc; the peer goes on serving)."""
    try:
        off, n = (int(a) for a in args)
    except ValueError:
        off = n = -1
    if off < 0 or n < 0:
        return {"error": f"crc takes OFFSET LENGTH, two non-negative integers, got {' '.join(args)!r}"}
    if off + n > region.nbytes:
        return {"error": f"crc range [{off}, {off + n}) lies outside the region of {region.nbytes} bytes"}
    return {"crc": crc32c.crc32c(memoryview(region)[off:off + n])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m quillcache.transfer.peer", description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, required=True, help="size of the served region")
    ap.add_argument("--seed", type=int, default=None, help="fill the region from this seed (default: zeros)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--progress-timeout-s", type=float, default=TcpConfig.progress_timeout_s)
    ap.add_argument("--server-idle-timeout-s", type=float, default=TcpConfig.server_idle_timeout_s)
    ap.add_argument("--spin-us", type=int, default=TcpConfig.spin_us,
                    help="how long a receive polls before it blocks (µs; 0: never spin)")
    ap.add_argument("--fast-path", type=int, choices=(0, 1), default=int(TcpConfig.fast_path),
                    help="1: move bytes with the compiled FastChannel where built; 0: the plain-Python Channel")
    ap.add_argument("--congestion-control", default=TcpConfig.congestion_control,
                    help="TCP congestion control of every connection: the first name the kernel accepts ('' : its default)")
    ap.add_argument("--socket-buffer-bytes", type=int, default=TcpConfig.socket_buffer_bytes,
                    help="SO_SNDBUF/SO_RCVBUF of every connection (0: kernel autotuning)")
    args = ap.parse_args(argv)
    if args.bytes <= 0:
        ap.error(f"--bytes must be positive, got {args.bytes}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.seed is None:
        region = aligned_zeros(args.bytes, pretouch=True)  # every page touched now, not during the study
    else:
        region = aligned_empty(args.bytes)
        region[:] = fill_pattern(args.bytes, args.seed)
    config = TcpConfig(progress_timeout_s=args.progress_timeout_s, server_idle_timeout_s=args.server_idle_timeout_s,
                       spin_us=args.spin_us, socket_buffer_bytes=args.socket_buffer_bytes,
                       fast_path=bool(args.fast_path), congestion_control=args.congestion_control)
    with TransferEngine("tcp", port=args.port, config=config) as engine:
        desc = engine.register_region(region, name="peer")
        _answer({"address": engine.address, "region_id": desc.region_id, "bytes": args.bytes, "pid": os.getpid()})
        for line in sys.stdin:
            cmd, *rest = line.split() or [""]
            if cmd == "rusage":
                ru = resource.getrusage(resource.RUSAGE_SELF)
                _answer({"user_s": ru.ru_utime, "system_s": ru.ru_stime})
            elif cmd == "crc":
                _answer(_crc_command(region, rest))
            elif cmd == "stats":
                server = getattr(engine.backend, "server", None)
                _answer(dataclasses.asdict(server.stats) if server is not None else {})
            elif cmd == "waits":
                server = getattr(engine.backend, "server", None)
                _answer(server.wait_counters() if server is not None else {})
            else:
                _answer({"error": f"unknown command {line.strip()!r}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
