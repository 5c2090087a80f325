"""``LocalCluster``: a real pool on this machine: a ``quillcache master`` process, N ``quillcache node``
processes (and an etcd when asked), all on 127.0.0.1 free ports.

Contract:
- ``with LocalCluster(nodes=3) as c:`` starts everything and returns only when every node's segment is
  mounted at the master (polled with a deadline); ``c.store(**kw)`` is a ``PooledStore`` on it (closed with
  the cluster). Children get the transfer secret through ``QUILLCACHE_TRANSFER_SECRET``; their stderr goes
  to ``base_dir/<name>.log`` (quoted in every start error).
- Failure injection on real processes: ``kill_node(i, sig)``, ``restart_node(i)`` (same node id and SSD
  directory: its flushed SSD blocks come back to the pool), ``pause_node(i)``/``resume_node(i)``
  (SIGSTOP/SIGCONT; each returns once ``/proc`` shows every thread of the node stopped / none),
  ``kill_master(sig)``, ``restart_master()`` (same data dir and port, so the nodes and
  stores find it again).
- ``close()`` (also on ``__exit__``, and when ``start`` fails half-way) always stops every child it started,
  paused or not, even when some died (SIGCONT, SIGTERM, then SIGKILL past a deadline), and removes a
  ``base_dir`` it created. No atexit hooks: the caller's ``with``/``finally`` is the guarantee; and
  should this process die without running it (SIGKILL), every master and node child stops by itself
  within a second or so, a paused one included (it polls whether it was re-parented, and the kernel
  wakes a stopped one: ``quillcache.cli.parent``), and the kernel sends an etcd SIGTERM (when
  ``start`` ran in the main thread: ``quillcache.cluster.etcd``). A temporary ``base_dir`` names this
  process and every child started in it; once all of them have exited, the next ``LocalCluster``
  that makes one removes it (``quillcache.cluster.tempdirs``). The
  nodes are stopped together (SIGTERM to all, one shared deadline, then SIGKILL to the rest), then the
  master: ``close`` waits one deadline for all the nodes, not one per node. A ``KeyboardInterrupt``
  (Ctrl-C, or a stop signal the CLI turns into one) during ``start`` stops what was started before it
  propagates. While a child is spawned and recorded, ``HELD_SIGNALS`` are held (in the main thread)
  and sent again right after: a handler raising inside ``Popen`` would lose a started child's pid,
  leaving a process nobody stops.
- ``nodes`` is at most ``MAX_NODES`` (every node is a process of this machine, all booting at once);
  ``quillcache cluster up --nodes`` and ``quillcache replay --cluster`` share the bound.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quillcache.cli.parent import PARENT_ENV
from quillcache.cluster.tempdirs import add_user, make_owned_dir, sweep_stale_dirs
from quillcache.master.client import MasterClient

__all__ = ["MAX_NODES", "ClusterError", "ClusterStatus", "LocalCluster", "NodeProcess", "NodeStatus"]

MiB = 1 << 20
PAGE_BYTES = 4096  # a node's --dram is a whole number of pages (cli.argtypes.size_arg)
MAX_NODES = 16  # node processes one LocalCluster starts at most (they all boot at once on this machine)
TEMP_PREFIX = "quillcache-cluster-"  # a base dir made for the cluster (none given), in tempfile.gettempdir()
STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL, for every child together
# held while a child is spawned and recorded (see the module docstring)
HELD_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class ClusterError(RuntimeError):
    """A child did not start, or the cluster did not reach the state asked for in time."""


@dataclass
class NodeProcess:
    """One ``quillcache node`` child (its addresses change at each restart; its id and SSD dir do not)."""

    index: int
    node_id: str
    ssd_dir: str | None
    proc: subprocess.Popen | None = None
    segment_id: int | None = None
    transfer_address: str | None = None
    control_address: str | None = None
    log_path: Path | None = None  # the child's stderr

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    segment_id: int
    endpoint: str
    capacity_bytes: int
    used_bytes: int


@dataclass(frozen=True)
class ClusterStatus:
    master_address: str
    nodes: tuple[NodeStatus, ...]
    segments: int
    clients: int
    capacity_bytes: int
    used_bytes: int
    objects: int
    pending: int


def status_of(master: MasterClient, address: str) -> ClusterStatus:
    """The pool as the master at ``address`` sees it."""
    nodes = []
    for seg in sorted(master.segments(), key=lambda s: (s.node_id, s.segment_id)):
        used, cap = master.segment_usage(seg.segment_id)
        nodes.append(NodeStatus(seg.node_id, seg.segment_id, seg.endpoint, cap, used))
    st = master.stats()
    return ClusterStatus(address, tuple(nodes), st.num_segments, st.num_clients, st.capacity_bytes, st.used_bytes,
                         st.num_objects, st.num_pending)


def _read_json_line(proc: subprocess.Popen, deadline: float, what: str, log_path: Path) -> dict:
    buf = b""
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            why = "did not report within the deadline" if left <= 0 else f"exited with status {proc.returncode}"
            raise ClusterError(f"{what} {why}; its log {log_path}:\n{_tail(log_path)}")
        r, _, _ = select.select([fd], [], [], min(left, 0.2))
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:
                proc.wait(timeout=5)
                continue
            buf += chunk
    return json.loads(buf.split(b"\n", 1)[0])


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextmanager
def _signals_held() -> Iterator[None]:
    """``HELD_SIGNALS`` are recorded, not handled, inside the block, then the previous handlers are
    restored and each recorded signal is sent to this process again. Outside the main thread (no
    handler runs there) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        for sig in dict.fromkeys(caught):
            os.kill(os.getpid(), sig)


def _thread_states(pid: int) -> list[str]:
    """The ``/proc`` state letter of every thread of ``pid`` (empty once the process is gone)."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:  # the state follows the last ')' (names may hold one)
                states.append(fh.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that exited between the listing and the read
            continue
    return states


def _await_state(proc: subprocess.Popen, *, stopped: bool, timeout_s: float) -> None:
    """Poll until every thread of ``proc`` is stopped by a signal (state ``T``), or, with ``stopped``
    false, until none is: a SIGSTOP stops the threads one by one, so the main thread's state alone
    can say stopped too early. Only the process's exit (``poll``) ends the wait otherwise."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        states = _thread_states(proc.pid)
        if states and (all(st == "T" for st in states) if stopped else "T" not in states):
            return
        if time.monotonic() > deadline:
            what = "stop" if stopped else "resume"
            raise TimeoutError(f"pid {proc.pid} did not {what} within {timeout_s:g} s")
        time.sleep(0.001)


def _stop(proc: subprocess.Popen | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    _stop_all([proc], timeout_s)


def _stop_all(procs: list[subprocess.Popen | None], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop every live process of ``procs`` (paused ones too): SIGCONT + SIGTERM to all, wait for all
    until one shared deadline, then SIGKILL those left and reap them; closes their stdout pipes."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        try:
            p.send_signal(signal.SIGCONT)
            p.terminate()
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout_s)
    for p in procs:
        if p is not None and p.stdout is not None:
            p.stdout.close()


class LocalCluster:
    """See the module docstring."""

    def __init__(self, nodes: int = 3, *, dram_bytes: int = 64 * MiB, ssd: bool = False, ssd_bytes: int | None = None,
                 etcd: bool = False, base_dir: str | os.PathLike | None = None, client_ttl_s: float = 3.0,
                 lease_ttl_s: float = 2.0, secret: str | None = None, heartbeat_s: float | None = None,
                 tick_s: float = 0.2, start_timeout_s: float = 60.0) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be an int in [1, {MAX_NODES}], got {nodes!r}")
        self.num_nodes = nodes
        if isinstance(dram_bytes, bool) or not isinstance(dram_bytes, int) or dram_bytes < PAGE_BYTES \
                or dram_bytes % PAGE_BYTES:
            raise ValueError(f"dram_bytes must be an int multiple of {PAGE_BYTES} (what `quillcache node --dram` "
                             f"takes), got {dram_bytes!r}")
        self.dram_bytes = dram_bytes
        self.ssd = bool(ssd)
        self.ssd_bytes = ssd_bytes
        self.use_etcd = bool(etcd)
        self.client_ttl_s = float(client_ttl_s)
        self.lease_ttl_s = float(lease_ttl_s)
        self.heartbeat_s = float(heartbeat_s) if heartbeat_s is not None else self.client_ttl_s / 4
        self.tick_s = float(tick_s)
        self.start_timeout_s = float(start_timeout_s)
        self.secret = secret or secrets.token_hex(16)
        self._given_dir = base_dir
        self.base_dir: Path | None = None
        self._owns_dir = False
        self.master_address: str | None = None
        self.master_port: int | None = None
        self.master_proc: subprocess.Popen | None = None
        self.etcd = None
        self.nodes: list[NodeProcess] = []
        self._stores: list = []
        self._client: MasterClient | None = None
        self._started = False

    @property
    def master_pid(self) -> int | None:
        """The master process's pid (None before it is started)."""
        return self.master_proc.pid if self.master_proc is not None else None

    # ================================================================ start / stop
    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _env(self) -> dict:
        from quillcache.transfer import SECRET_ENV

        env = dict(os.environ)
        env[SECRET_ENV] = self.secret
        env[PARENT_ENV] = str(os.getpid())  # a child stops once this process is gone (cli.parent)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _spawn(self, args: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        log_path = self.base_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "quillcache", *args], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=log, env=self._env(), start_new_session=True)
        if self._owns_dir:  # it works in the temporary base dir: no sweep removes it while the child runs
            add_user(self.base_dir, proc.pid)
        return proc, log_path

    def start(self) -> LocalCluster:
        if self._started:
            return self
        self._started = True
        try:
            if self._given_dir is None:
                sweep_stale_dirs(TEMP_PREFIX)  # what a SIGKILLed cluster left (no close ran)
                self.base_dir = make_owned_dir(TEMP_PREFIX)
                self._owns_dir = True
            else:
                self.base_dir = Path(self._given_dir)
                self.base_dir.mkdir(parents=True, exist_ok=True)
            if self.use_etcd:
                from quillcache.cluster.etcd import EtcdProcess

                self.etcd = EtcdProcess(data_dir=self.base_dir / "etcd",
                                        owned_by=self.base_dir if self._owns_dir else None).start()
            self._start_master(port=0)
            self.nodes = [NodeProcess(i, f"node-{i}", str(self.base_dir / f"ssd-{i}") if self.ssd else None)
                          for i in range(self.num_nodes)]
            for n in self.nodes:  # start all, then read their lines: they boot in parallel
                self._spawn_node(n)
            deadline = time.monotonic() + self.start_timeout_s
            for n in self.nodes:
                self._await_node(n, deadline)
            self.wait_mounted()
        except BaseException:
            self.close()
            raise
        return self

    def _start_master(self, port: int) -> None:
        args = ["master", "--data-dir", str(self.base_dir / "master"), "--port", str(port),
                "--lease-ttl-s", repr(self.lease_ttl_s), "--client-ttl-s", repr(self.client_ttl_s),
                "--tick-s", repr(self.tick_s), "--log-level", "warning"]
        with _signals_held():
            self.master_proc, log_path = self._spawn(args, "master")
        line = _read_json_line(self.master_proc, time.monotonic() + self.start_timeout_s, "quillcache master",
                               log_path)
        self.master_address = line["address"]
        self.master_port = int(self.master_address.rsplit(":", 1)[1])
        if self._client is not None:
            self._client.close()
        self._client = MasterClient(self.master_address, timeout_s=2.0, retry_s=5.0)

    def _spawn_node(self, n: NodeProcess) -> None:
        args = ["node", "--master", self.master_address, "--dram", str(self.dram_bytes), "--node-id", n.node_id,
                "--heartbeat-s", repr(self.heartbeat_s), "--log-level", "warning"]
        if n.ssd_dir is not None:
            args += ["--ssd", n.ssd_dir]
            if self.ssd_bytes is not None:
                args += ["--ssd-size", str(self.ssd_bytes)]
        if self.etcd is not None:
            args += ["--etcd", self.etcd.endpoint]
        with _signals_held():
            n.proc, n.log_path = self._spawn(args, n.node_id)

    def _await_node(self, n: NodeProcess, deadline: float) -> None:
        line = _read_json_line(n.proc, deadline, f"quillcache node {n.node_id}", n.log_path)
        n.segment_id = line["segment_id"]
        n.transfer_address = line["transfer"]
        n.control_address = line["control"]

    def wait_mounted(self, timeout_s: float | None = None) -> None:
        """Poll the master until every live node (by node id) has a segment mounted; refreshes each node's
        ``segment_id`` from the master (a node that remounted after NEED_REMOUNT has a new one)."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.start_timeout_s)
        while True:
            want = {n.node_id for n in self.nodes if n.alive}
            try:
                segs = self._client.segments()
            except Exception:
                segs = []
            by_node = {}
            for seg in segs:
                by_node.setdefault(seg.node_id, []).append(seg.segment_id)
            if want <= set(by_node):
                for n in self.nodes:
                    if n.node_id in by_node and n.segment_id not in by_node[n.node_id]:
                        n.segment_id = max(by_node[n.node_id])
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"nodes {sorted(want - set(by_node))} have no segment mounted at "
                                   f"{self.master_address} in time")
            time.sleep(0.02)

    def close(self) -> None:
        for s in self._stores:
            try:
                s.close()
            except Exception:
                pass
        self._stores.clear()
        _stop_all([n.proc for n in self.nodes])  # first, so they can unmount at the master
        _stop(self.master_proc)
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.etcd is not None:
            try:
                self.etcd.stop()
            except Exception:
                pass
            self.etcd = None
        if self._owns_dir and self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self._owns_dir = False

    # ================================================================ clients
    def store(self, **kwargs):
        """A ``PooledStore`` on this cluster (closed with it)."""
        from quillcache.pool.store import PooledStore

        kwargs.setdefault("lease_ttl_s", self.lease_ttl_s)
        kwargs.setdefault("master_retry_s", 2 * self.client_ttl_s + 5.0)
        s = PooledStore(self.master_address, secret=self.secret, **kwargs)
        self._stores.append(s)
        return s

    def master(self) -> MasterClient:
        """The cluster's own master client (do not close it)."""
        return self._client

    def status(self) -> ClusterStatus:
        return status_of(self._client, self.master_address)

    # ================================================================ failure injection
    def kill_node(self, i: int, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> None:
        n = self.nodes[i]
        if n.alive:
            n.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                n.proc.wait(timeout=timeout_s)

    def pause_node(self, i: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGSTOP node ``i`` and return once the kernel shows every thread of it stopped (signals are
        delivered asynchronously: without the wait, a caller could act on a node that still runs)."""
        proc = self.nodes[i].proc
        proc.send_signal(signal.SIGSTOP)
        _await_state(proc, stopped=True, timeout_s=timeout_s)

    def resume_node(self, i: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGCONT node ``i`` and return once none of its threads is stopped."""
        proc = self.nodes[i].proc
        proc.send_signal(signal.SIGCONT)
        _await_state(proc, stopped=False, timeout_s=timeout_s)

    def restart_node(self, i: int) -> NodeProcess:
        """Stop node ``i`` (if alive) and start it again: same node id and SSD dir; returns once mounted."""
        n = self.nodes[i]
        _stop(n.proc)
        self._spawn_node(n)
        self._await_node(n, time.monotonic() + self.start_timeout_s)
        self.wait_mounted()
        return n

    def kill_master(self, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> None:
        if self.master_proc is not None and self.master_proc.poll() is None:
            self.master_proc.send_signal(sig)
            self.master_proc.wait(timeout=timeout_s)

    def restart_master(self) -> None:
        """Start the master again on its data dir and port (stopping it first if it runs)."""
        _stop(self.master_proc)
        deadline = time.monotonic() + self.start_timeout_s
        while True:  # the port may linger a moment after the old process
            try:
                self._start_master(self.master_port)
                return
            except ClusterError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
