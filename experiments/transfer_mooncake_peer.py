"""One side of a Mooncake Transfer Engine run (child of ``experiments/transfer_mooncake.py``).

Runs under the SEPARATE Mooncake virtualenv (``<workdir>/mooncake-venv``), so it imports only the
standard library and ``mooncake.engine``; never ``quillcache``. It speaks JSON lines: one command
per line on stdin, one reply per line on the protocol channel (the original stdout; file
descriptor 1 is pointed at stderr so that anything the C++ library prints cannot corrupt it).

Commands (every reply carries ``"ok"``; a failure carries ``"error"`` with the exact reason):

- ``{"cmd": "setup", "block": B, "slots": S, "fill": "pattern" | "zero", "seed": n}``: initialise
  a ``TransferEngine`` (``initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")``: no metadata
  server), mmap ``S * B`` bytes, fill them (``pattern``: a seeded pseudo-random block per slot,
  its first 8 bytes the slot number; ``zero``: zeros; both touch every page before any timing),
  ``register_memory`` them. Reply: the segment name ``127.0.0.1:<rpc port>`` and the address.
- ``{"cmd": "run", "target": seg, "remote_addr": A, "op": "read"|"write", "batch": n,
  "iters": k}``: ``k`` calls of ``batch_transfer_sync_read|write`` (``transfer_sync_*`` when
  ``n == 1``), block ``i`` of a call between local slot ``i % S`` and remote slot ``i % S``.
  Reply: per-call wall seconds (``lat``: ``time.perf_counter`` around each call), the wall seconds of the
  whole loop (``wall_s``) and this process's CPU seconds (``resource.getrusage`` user + system, all threads)
  over the loop.
- ``{"cmd": "rusage"}``: this process's CPU seconds so far.
- ``{"cmd": "crc"}``: zlib crc32 of every slot.
- ``{"cmd": "exit"}``.

``--check``: import ``mooncake.engine`` and print ``{"ok": true, "version": ...}``, then exit.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import random
import resource
import sys
import time
import traceback
import zlib


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class Peer:
    def __init__(self) -> None:
        self.engine = None
        self.mm: mmap.mmap | None = None
        self.addr = 0
        self.block = 0
        self.slots = 0

    # -- commands -------------------------------------------------------------------------
    def setup(self, block: int, slots: int, fill: str, seed: int) -> dict:
        from mooncake.engine import TransferEngine  # the Mooncake venv only

        try:
            from importlib.metadata import version
            mc_version = version("mooncake-transfer-engine")
        except Exception:  # noqa: BLE001 - the version is informative only
            mc_version = None
        self.engine = TransferEngine()
        rc = self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            return {"ok": False, "error": f"TransferEngine.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') returned {rc}"}
        self.block, self.slots = block, slots
        size = block * slots
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        if fill == "pattern":
            base = random.Random(seed).randbytes(block)
            for s in range(slots):
                off = s * block
                self.mm[off:off + block] = base
                self.mm[off:off + 8] = s.to_bytes(8, "little")
        else:
            ctypes.memset(self.addr, 0, size)  # touch every page before timing
        rc = self.engine.register_memory(self.addr, size)
        if rc != 0:
            return {"ok": False, "error": f"TransferEngine.register_memory(addr, {size}) returned {rc}"}
        port = self.engine.get_rpc_port()
        return {"ok": True, "segment": f"127.0.0.1:{port}", "rpc_port": port, "addr": self.addr,
                "version": mc_version, "pid": os.getpid()}

    def run(self, target: str, remote_addr: int, op: str, batch: int, iters: int) -> dict:
        e, b, s = self.engine, self.block, self.slots
        if e is None:
            return {"ok": False, "error": "run before setup"}
        lat: list[float] = []
        pc = time.perf_counter
        if batch == 1:
            fn = e.transfer_sync_read if op == "read" else e.transfer_sync_write
            loc, rem = self.addr, remote_addr
            cpu0 = _cpu_s()
            start = pc()
            for _ in range(iters):
                t0 = pc()
                rc = fn(target, loc, rem, b)
                lat.append(pc() - t0)
                if rc != 0:
                    return {"ok": False, "error": f"transfer_sync_{op}({target!r}, len={b}) returned {rc} "
                                                  f"after {len(lat) - 1} successful calls"}
        else:
            fn = e.batch_transfer_sync_read if op == "read" else e.batch_transfer_sync_write
            locs = [self.addr + (i % s) * b for i in range(batch)]
            rems = [remote_addr + (i % s) * b for i in range(batch)]
            lens = [b] * batch
            cpu0 = _cpu_s()
            start = pc()
            for _ in range(iters):
                t0 = pc()
                rc = fn(target, locs, rems, lens)
                lat.append(pc() - t0)
                if rc != 0:
                    return {"ok": False, "error": f"batch_transfer_sync_{op}({target!r}, {batch} x {b} B) returned "
                                                  f"{rc} after {len(lat) - 1} successful calls"}
        wall = pc() - start
        return {"ok": True, "lat": lat, "wall_s": wall, "cpu_s": _cpu_s() - cpu0}

    def crc(self) -> dict:
        if self.mm is None:
            return {"ok": False, "error": "crc before setup"}
        mv = memoryview(self.mm)
        out = [zlib.crc32(mv[i * self.block:(i + 1) * self.block]) for i in range(self.slots)]
        mv.release()
        return {"ok": True, "crcs": out}


def check() -> int:
    """``--check``: import the engine and print its version as one JSON line (used by ``prepare``)."""
    from importlib.metadata import version

    from mooncake.engine import TransferEngine  # noqa: F401 - the import is the check

    print(json.dumps({"ok": True, "version": version("mooncake-transfer-engine")}), flush=True)
    return 0


def main() -> int:
    if sys.argv[1:] == ["--check"]:
        return check()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # C++ prints to stdout land in the log, not in the protocol
    sys.stdout = sys.stderr
    peer = Peer()

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    reply({"ok": True, "hello": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
            if cmd == "exit":
                reply({"ok": True})
                break
            if cmd == "rusage":
                reply({"ok": True, "cpu_s": _cpu_s()})
            elif cmd == "setup":
                reply(peer.setup(**msg))
            elif cmd == "run":
                reply(peer.run(**msg))
            elif cmd == "crc":
                reply(peer.crc())
            else:
                reply({"ok": False, "error": f"unknown command {cmd!r}"})
        except Exception as exc:  # noqa: BLE001 - reported to the parent as the reason
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]})
    proto.flush()
    # os._exit: skip the engine's destructors (they may block on peer sockets); the parent reaps us
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
