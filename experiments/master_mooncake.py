"""Mooncake's master as a same-run baseline for the master study: ``mooncake_master`` plus its Python client.

The ``mooncake-transfer-engine`` wheel (0.3.13.post1, prepared by :func:`experiments.transfer_mooncake.prepare`
in its own virtualenv: nothing is installed twice) ships the ``mooncake_master`` binary and the
``MooncakeDistributedStore`` client. :class:`MooncakeMasterRun` starts

- ``mooncake_master --rpc_port P --rpc_address 127.0.0.1 --metrics_port M`` (defaults otherwise: no HA, no
  operation log, no snapshot: its metadata lives in memory only), and
- one client process (``experiments/master_mooncake_peer.py`` under the Mooncake venv) that registers with the
  master and mounts one segment, then issues metadata calls only (the peer's docstring lists them:
  ``batch_put_session_start``/``_end`` = PutStart/PutEnd without writing bytes, ``get_replica_desc`` =
  GetReplicaList, ``is_exist`` = ExistKey, and their batch forms). No call moves object bytes.

The master's Prometheus counters (``http://127.0.0.1:M/metrics``) are read around every cell, so the study can
say how many master RPCs a cell caused (``rpcs``): it proves the calls reach the master and that a batch is one
RPC. Timing is done in the client process (wall time around the loop of calls).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from experiments import transfer_mooncake as tm
from quillcache.cluster.etcd import free_port

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "master_mooncake_peer.py"

#: the master RPC counters a metadata call can move (name prefixes of its /metrics)
RPC_COUNTERS = ("master_put_start_requests_total", "master_put_end_requests_total",
                "master_batch_put_start_requests_total", "master_batch_put_end_requests_total",
                "master_get_replica_list_requests_total", "master_batch_get_replica_list_requests_total",
                "master_exist_key_requests_total", "master_batch_exist_key_requests_total")


class MooncakeError(RuntimeError):
    """The Mooncake master or its client failed; the message says how (and where the log is)."""


def availability(workdir: Path | None = None) -> tuple[bool, str, str | None]:
    """(ok, reason, version): the prepared Mooncake venv (``transfer_mooncake.prepare``) and its master binary."""
    workdir = Path(workdir) if workdir is not None else tm.default_workdir()
    av = tm.prepare(workdir)
    if not av.ok:
        return False, av.reason, None
    stamp = tm.read_stamp(workdir)
    binary = Path(stamp["venv_python"]).parent / "mooncake_master"
    if not os.access(binary, os.X_OK):
        return False, f"the prepared Mooncake venv has no mooncake_master binary ({binary.name} missing)", av.version
    return True, f"mooncake-transfer-engine {av.version}: mooncake_master + MooncakeDistributedStore", av.version


def _wait_port(port: int, proc: subprocess.Popen, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class MooncakeMasterRun:
    """A Mooncake master and one metadata client; ``with MooncakeMasterRun(...) as mk: mk.run(op, batch, keys)``."""

    def __init__(self, *, segment_bytes: int, workdir: Path | None = None, timeout_s: float = 60.0,
                 buffer_bytes: int = 16 << 20) -> None:
        self.workdir = Path(workdir) if workdir is not None else tm.default_workdir()
        self.segment_bytes = segment_bytes
        self.buffer_bytes = buffer_bytes
        self.timeout_s = timeout_s
        self.master: subprocess.Popen | None = None
        self.peer: subprocess.Popen | None = None
        self._buf = b""
        self.version: str | None = None

    # -------------------------------------------------------------------------------- lifecycle
    def start(self) -> "MooncakeMasterRun":
        """Start the master and the client; on any failure both are stopped (``close``) before the error is raised,
        so a failed start leaves no process behind (they run in their own sessions and would outlive the study)."""
        try:
            return self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> "MooncakeMasterRun":
        stamp = tm.read_stamp(self.workdir)
        problem = tm._stamp_problem(self.workdir, stamp) if stamp is not None else "Mooncake is not prepared"
        if problem:
            raise MooncakeError(problem)
        env = tm.peer_env(stamp)
        logdir = self.workdir / "logs"
        logdir.mkdir(parents=True, exist_ok=True)
        tag = f"master-{os.getpid()}-{time.time_ns()}"
        self.master_log_path = logdir / f"{tag}-master.log"
        self.peer_log_path = logdir / f"{tag}-client.log"
        self.rpc_port, self.metrics_port = free_port(), free_port()
        binary = str(Path(stamp["venv_python"]).parent / "mooncake_master")
        deadline = time.monotonic() + self.timeout_s
        with open(self.master_log_path, "wb") as log:
            self.master = subprocess.Popen([binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                                            f"--metrics_port={self.metrics_port}"], stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(logdir),
                                           start_new_session=True)
        if not _wait_port(self.rpc_port, self.master, deadline):
            raise MooncakeError(f"mooncake_master did not listen on 127.0.0.1:{self.rpc_port} "
                                f"({self._state(self.master)}); log: {self._tail(self.master_log_path)}")
        with open(self.peer_log_path, "wb") as log:
            self.peer = subprocess.Popen([stamp["venv_python"], str(PEER_SCRIPT)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(logdir),
                                         start_new_session=True)
        self._read(deadline, "startup")
        r = self.request({"cmd": "setup", "master": f"127.0.0.1:{self.rpc_port}", "segment_bytes": self.segment_bytes,
                          "buffer_bytes": self.buffer_bytes})
        self.version = r.get("version")
        return self

    def __enter__(self) -> "MooncakeMasterRun":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.peer is not None and self.peer.poll() is None:
            try:
                self.peer.stdin.write(b'{"cmd": "exit"}\n')
                self.peer.stdin.flush()
                self.peer.wait(timeout=5)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        for proc in (self.peer, self.master):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)  # its own session: that process and nothing else
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        if self.peer is not None:
            for f in (self.peer.stdin, self.peer.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        self.peer = self.master = None

    # -------------------------------------------------------------------------------- calls
    @staticmethod
    def _state(proc: subprocess.Popen | None) -> str:
        if proc is None:
            return "not started"
        rc = proc.poll()
        return "running" if rc is None else f"exited with rc {rc}"

    @staticmethod
    def _tail(path: Path, n: int = 600) -> str:
        try:
            return tm._tail(path.read_text(errors="replace"), n)
        except OSError:
            return ""

    def _fail(self, what: str) -> MooncakeError:
        return MooncakeError(f"Mooncake client (pid {self.peer.pid if self.peer else '?'}): {what} "
                             f"({self._state(self.peer)}; master {self._state(self.master)}); client log: "
                             f"{self._tail(self.peer_log_path)}; master log: {self._tail(self.master_log_path, 300)}")

    def _read(self, deadline: float, what: str) -> dict:
        msg, self._buf = tm.read_reply(self.peer, self._buf, deadline, what, self._fail)
        return msg

    def request(self, msg: dict, timeout_s: float | None = None) -> dict:
        try:
            self.peer.stdin.write((json.dumps(msg) + "\n").encode())
            self.peer.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._fail(f"cannot send {msg.get('cmd')!r}: {exc}") from None
        return self._read(time.monotonic() + (timeout_s or self.timeout_s), msg.get("cmd", "?"))

    def rpc_counts(self) -> dict[str, float]:
        """The master's RPC request counters (``RPC_COUNTERS``) from its metrics endpoint."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode("utf-8", "replace")
        out = {}
        for name in RPC_COUNTERS:
            m = re.search(rf"^{name}(?:{{[^}}]*}})?\s+([0-9.eE+-]+)\s*$", text, re.M)
            out[name] = float(m.group(1)) if m else 0.0
        return out

    def run(self, op: str, batch: int, keys: list[str], size_bytes: int) -> dict:
        """``op`` over ``keys`` in calls of ``batch``; returns the peer's reply plus ``rpcs`` (master RPCs counted)."""
        before = self.rpc_counts()
        r = self.request({"cmd": "run", "op": op, "batch": batch, "keys": keys, "size": size_bytes},
                         timeout_s=max(self.timeout_s, 600.0))
        after = self.rpc_counts()
        r["rpcs"] = int(sum(after.values()) - sum(before.values()))
        return r

    def restart_master(self, keys: list[str], timeout_s: float = 30.0) -> dict:
        """SIGKILL the master and start it again on the same ports (its defaults: no operation log, no snapshot),
        then ask the still-running client which of ``keys`` exist (``batch_is_exist``; retried while it answers
        errors, -1, as the client reconnects). Returns ``found``, ``errors`` and ``listen_s`` (start to listening)."""
        os.killpg(self.master.pid, 9)
        self.master.wait(timeout=10)
        stamp = tm.read_stamp(self.workdir)
        binary = str(Path(stamp["venv_python"]).parent / "mooncake_master")
        t0 = time.perf_counter()
        with open(self.master_log_path, "ab") as log:
            self.master = subprocess.Popen([binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                                            f"--metrics_port={self.metrics_port}"], stdin=subprocess.DEVNULL,
                                           stdout=log, stderr=subprocess.STDOUT, env=tm.peer_env(stamp),
                                           cwd=str(self.master_log_path.parent), start_new_session=True)
        deadline = time.monotonic() + timeout_s
        if not _wait_port(self.rpc_port, self.master, deadline):
            raise MooncakeError(f"mooncake_master did not come back on 127.0.0.1:{self.rpc_port}; log: "
                                f"{self._tail(self.master_log_path)}")
        listen_s = time.perf_counter() - t0
        while True:
            r = self.request({"cmd": "exist", "keys": keys})
            codes = r["codes"]
            errors = sum(1 for c in codes if c < 0)
            if errors < len(codes) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return {"found": sum(1 for c in codes if c == 1), "errors": errors, "asked": len(keys), "listen_s": listen_s}

    def cpu_s(self) -> float:
        return float(self.request({"cmd": "rusage"})["cpu_s"])
