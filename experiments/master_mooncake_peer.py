"""The client side of the master study's Mooncake subject (child of ``experiments/master_mooncake.py``).

Runs under the SEPARATE Mooncake virtualenv, so it imports only the standard library and
``mooncake.store``; never ``quillcache``. JSON lines: one command per line on stdin, one reply per line
on the protocol channel (the original stdout; descriptor 1 is pointed at stderr so that whatever the
C++ library prints cannot corrupt it). Every reply carries ``"ok"``; a failure carries ``"error"``.

- ``{"cmd": "setup", "master": "127.0.0.1:P", "segment_bytes": n, "buffer_bytes": n}``: a
  ``MooncakeDistributedStore().setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "",
  master)``: the client registers with the master and mounts one segment of ``segment_bytes``.
- ``{"cmd": "run", "op": "put"|"get_replicas"|"exists", "batch": b, "keys": [..], "size": s}``: the keys
  in calls of ``b`` (wall time around the whole loop, ``time.perf_counter``). Metadata calls only,
  no byte moves:

  ============== ============================================== ==========================================
  op             batch == 1                                     batch > 1
  ============== ============================================== ==========================================
  put            ``batch_put_session_start([k], [s])`` then      ``batch_put_session_start(keys, sizes)`` then
                 ``batch_put_session_end([k])`` (PutStart and   ``batch_put_session_end(keys)``
                 PutEnd of the master, "reserve objects without
                 transfer": the bytes are never written)
  get_replicas   ``get_replica_desc(k)`` (GetReplicaList)         ``batch_get_replica_desc(keys)``
  exists         ``is_exist(k)`` (ExistKey)                       ``batch_is_exist(keys)``
  ============== ============================================== ==========================================

  Reply: ``seconds``, ``bad`` (results that were not success / found / exists) and the first bad one.
- ``{"cmd": "exist", "keys": [..]}``: ``batch_is_exist(keys)`` as is (1, 0, or -1 for an error).
- ``{"cmd": "rusage"}``: this process's CPU seconds so far. ``{"cmd": "exit"}``.

``--check``: import ``mooncake.store`` and print ``{"ok": true, "version": ...}``, then exit.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback


def _version() -> str | None:
    try:
        from importlib.metadata import version

        return version("mooncake-transfer-engine")
    except Exception:  # noqa: BLE001 - informational only
        return None


class Peer:
    def __init__(self) -> None:
        self.store = None

    def setup(self, master: str, segment_bytes: int, buffer_bytes: int) -> dict:
        from mooncake.store import MooncakeDistributedStore  # the Mooncake venv only

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup(..., master={master!r}) returned {rc}")
        return {"version": _version()}

    def run(self, op: str, batch: int, keys: list[str], size: int) -> dict:
        s = self.store
        calls = [keys[i:i + batch] for i in range(0, len(keys), batch)]
        bad = 0
        first_bad = None
        pc = time.perf_counter
        if op == "put":
            if batch == 1:
                start, end = s.batch_put_session_start, s.batch_put_session_end
                sizes1 = [size]
                t0 = pc()
                for ks in calls:
                    a = start(ks, sizes1)
                    b = end(ks)
                    if a[0] != 0 or b[0] != 0:
                        bad += 1
                        first_bad = first_bad or [ks[0], a[0], b[0]]
                wall = pc() - t0
            else:
                sizes = [size] * batch
                t0 = pc()
                for ks in calls:
                    a = s.batch_put_session_start(ks, sizes[:len(ks)])
                    b = s.batch_put_session_end(ks)
                    nb = sum(1 for x in a if x != 0) + sum(1 for x in b if x != 0)
                    if nb:
                        bad += nb
                        first_bad = first_bad or [ks[0], sorted(set(a)), sorted(set(b))]
                wall = pc() - t0
        elif op == "get_replicas":
            if batch == 1:
                get = s.get_replica_desc
                t0 = pc()
                for ks in calls:
                    if not get(ks[0]):
                        bad += 1
                        first_bad = first_bad or ks[0]
                wall = pc() - t0
            else:
                t0 = pc()
                for ks in calls:
                    got = s.batch_get_replica_desc(ks)
                    if len(got) != len(ks):
                        bad += len(ks) - len(got)
                        first_bad = first_bad or [ks[0], len(got)]
                wall = pc() - t0
        elif op == "exists":
            if batch == 1:
                ex = s.is_exist
                t0 = pc()
                for ks in calls:
                    if ex(ks[0]) != 1:
                        bad += 1
                        first_bad = first_bad or ks[0]
                wall = pc() - t0
            else:
                t0 = pc()
                for ks in calls:
                    r = s.batch_is_exist(ks)
                    nb = sum(1 for x in r if x != 1)
                    if nb:
                        bad += nb
                        first_bad = first_bad or [ks[0], sorted(set(r))]
                wall = pc() - t0
        else:
            raise ValueError(f"unknown op {op!r}")
        return {"seconds": wall, "bad": bad, "first_bad": first_bad, "calls": len(calls)}


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything the library prints goes to the log, never into the protocol
    if "--check" in sys.argv:
        try:
            import mooncake.store  # noqa: F401
            proto.write(json.dumps({"ok": True, "version": _version()}) + "\n")
            return 0
        except Exception as exc:  # noqa: BLE001 - the parent reports it
            proto.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
            return 1
    peer = Peer()
    proto.write(json.dumps({"ok": True, "ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            cmd = msg.get("cmd")
            if cmd == "exit":
                proto.write(json.dumps({"ok": True}) + "\n")
                break
            if cmd == "setup":
                out = peer.setup(msg["master"], int(msg["segment_bytes"]), int(msg["buffer_bytes"]))
            elif cmd == "run":
                out = peer.run(msg["op"], int(msg["batch"]), list(msg["keys"]), int(msg["size"]))
            elif cmd == "exist":
                out = {"codes": list(peer.store.batch_is_exist(list(msg["keys"])))}
            elif cmd == "rusage":
                out = {"cpu_s": _cpu_s()}
            else:
                raise ValueError(f"unknown command {cmd!r}")
            proto.write(json.dumps(dict(out, ok=True)) + "\n")
        except Exception as exc:  # noqa: BLE001 - every failure is a reply naming it
            proto.write(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                    "trace": traceback.format_exc(limit=3)}) + "\n")
    proto.flush()
    os._exit(0)  # skip the library's static destructors (they may log or hang after the master is gone)


if __name__ == "__main__":
    sys.exit(main())
