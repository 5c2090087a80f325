"""A real etcd server for tests and local clusters: ``find_etcd`` and ``EtcdProcess``.

Contract:
- ``find_etcd()`` returns the path of the ``etcd`` binary ($QUILLCACHE_ETCD, then ``PATH``, then
  ``/usr/bin/etcd``) or None; ``ETCD_INSTALL_HINT`` says how to get one (Debian's ``etcd-server``).
- ``EtcdProcess`` starts one single-member etcd on 127.0.0.1 (client and peer ports free ones unless
  given: two distinct ports, chosen while both are held, and chosen again, up to ``PORT_ATTEMPTS`` times,
  when etcd could not bind one because another process took it meanwhile; given ports are never
  changed, and the same port for both is refused), its data in a temporary directory it owns, and
  returns from ``start()`` only when the server
  answers ``/health`` with ``"true"``: it polls with a deadline, waiting on the process itself between
  polls, so an etcd that exits early is reported at once with the tail of its log, and one that never
  gets healthy is killed and reported when the deadline passes. Nothing sleeps a fixed time.
- It is always stopped: ``stop()`` (SIGTERM, then SIGKILL after ``stop_timeout_s``) runs on leaving the
  ``with`` block, on a failed start, and, through a finalizer, at interpreter exit for a process that was
  never stopped. Should this process die without any of that (SIGKILL), the kernel sends etcd SIGTERM
  (``quillcache.cli.parent.kill_on_parent_death``; Linux, when ``start()`` runs in the main thread). A
  temporary data directory names this process and the server; once both have exited, the next
  ``EtcdProcess`` that makes one removes it (``quillcache.cluster.tempdirs``). ``kill()`` is SIGKILL
  at once (a crashed etcd, for tests). ``stop()`` is idempotent.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from quillcache._checks import check_float, check_int
from quillcache.cli.parent import kill_on_parent_death
from quillcache.cluster.tempdirs import add_user, make_owned_dir, sweep_stale_dirs

__all__ = ["ETCD_INSTALL_HINT", "EtcdNotFoundError", "EtcdProcess", "EtcdStartError", "find_etcd", "free_port",
           "free_ports"]

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 3  # starts with freshly chosen ports, when etcd finds one of the chosen ports taken
TEMP_PREFIX = "quillcache-etcd-"  # a data directory made for the server (none given), in tempfile.gettempdir()
ETCD_INSTALL_HINT = ("etcd is not installed: `apt-get install etcd-server` (Debian/Ubuntu; `make test` does it when "
                     "run as root), or set $QUILLCACHE_ETCD to an etcd binary")


class EtcdNotFoundError(FileNotFoundError):
    """No etcd binary; the message says how to get one."""


class EtcdStartError(RuntimeError):
    """etcd exited or did not become healthy in time; the message carries the tail of its log.
    ``port_taken``: it could not bind a port (another process listens there)."""

    def __init__(self, message: str, port_taken: bool = False) -> None:
        super().__init__(message)
        self.port_taken = port_taken


def find_etcd() -> str | None:
    """Path of an etcd binary ($QUILLCACHE_ETCD, ``PATH``, ``/usr/bin/etcd``), or None (see ``ETCD_INSTALL_HINT``)."""
    override = os.environ.get("QUILLCACHE_ETCD")
    if override:
        return override if os.access(override, os.X_OK) else None
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick for port 0)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` DISTINCT TCP ports nobody listens on right now: every socket stays bound until all are
    chosen (the kernel may hand out a port again once its socket is closed)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(check_int("n", n, 1)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class EtcdProcess:
    """One etcd member on ``host``; a context manager that always stops it (see the module contract)."""

    def __init__(self, binary: str | None = None, *, host: str = "127.0.0.1", client_port: int | None = None,
                 peer_port: int | None = None, data_dir: str | os.PathLike | None = None, name: str = "quillcache",
                 start_timeout_s: float = 30.0, stop_timeout_s: float = 5.0,
                 owned_by: str | os.PathLike | None = None) -> None:
        """``owned_by``: a ``quillcache.cluster.tempdirs`` directory the server works in (its ``data_dir``
        is inside it): the server is named there as soon as it is started, so no sweep removes it while
        the server runs."""
        self.binary = binary or find_etcd()
        if self.binary is None:
            raise EtcdNotFoundError(ETCD_INSTALL_HINT)
        self.host = host
        self.client_port = check_int("client_port", client_port, 1, 65535) if client_port is not None else None
        self.peer_port = check_int("peer_port", peer_port, 1, 65535) if peer_port is not None else None
        if client_port is not None and client_port == peer_port:
            raise ValueError(f"client_port and peer_port are both {client_port}: etcd needs two distinct ports")
        self.name = name
        self.start_timeout_s = check_float("start_timeout_s", start_timeout_s, 0.0, lo_open=True)
        self.stop_timeout_s = check_float("stop_timeout_s", stop_timeout_s, 0.0, lo_open=True)
        self._given_dir = Path(data_dir) if data_dir is not None else None
        self._owned_by = Path(owned_by) if owned_by is not None else None
        self._owned_dir: str | None = None
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._log_from = 0

    # -- where it listens --------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL (what ``EtcdClient`` takes)."""
        if self.client_port is None:
            raise RuntimeError("EtcdProcess has not been started")
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path:
        return self._base_dir() / "etcd.log"

    def _base_dir(self) -> Path:
        if self._given_dir is not None:
            return self._given_dir
        if self._owned_dir is None:
            sweep_stale_dirs(TEMP_PREFIX)  # what a SIGKILLed owner left (no stop ran)
            self._owned_dir = str(make_owned_dir(TEMP_PREFIX))
        return Path(self._owned_dir)

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> EtcdProcess:
        if self.running():
            raise RuntimeError(f"etcd at {self.endpoint} is already running (pid {self.pid})")
        pick_client, pick_peer = self.client_port is None, self.peer_port is None
        for attempt in range(1, PORT_ATTEMPTS + 1):
            if pick_client or pick_peer:
                given = {p for p in (self.client_port, self.peer_port) if p is not None}
                ports = [p for p in free_ports(3, self.host) if p not in given]
                if pick_client:
                    self.client_port = ports.pop(0)
                if pick_peer:
                    self.peer_port = ports.pop(0)
            try:
                return self._start_once()
            except EtcdStartError as e:
                if not (pick_client or pick_peer) or not e.port_taken or attempt == PORT_ATTEMPTS:
                    raise
                log.warning("etcd could not bind a port it was given (%s); starting it again on other ports "
                            "(attempt %d of %d)", e.args[0].splitlines()[0], attempt + 1, PORT_ATTEMPTS)
                if pick_client:
                    self.client_port = None
                if pick_peer:
                    self.peer_port = None
        raise AssertionError("unreachable")

    def _start_once(self) -> EtcdProcess:
        base = self._base_dir()
        base.mkdir(parents=True, exist_ok=True)
        assert self.client_port is not None and self.peer_port is not None
        peer_url = f"http://{self.host}:{self.peer_port}"
        cmd = [self.binary, "--name", self.name, "--data-dir", str(base / "data"),
               "--listen-client-urls", self.client_url, "--advertise-client-urls", self.client_url,
               "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
               "--initial-cluster", f"{self.name}={peer_url}", "--initial-cluster-state", "new",
               "--logger", "zap", "--log-level", "warn"]
        with open(self.log_path, "ab") as out:
            self._log_from = out.tell()  # this start's part of the log
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          preexec_fn=kill_on_parent_death(signal.SIGTERM))
        self._finalizer = weakref.finalize(self, _terminate, self._proc, self.stop_timeout_s)
        for d in (self._owned_dir, self._owned_by):  # no sweep removes its data while it runs
            if d is not None:
                add_user(d, self._proc.pid)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        last = "no answer yet"
        while True:
            try:
                with urllib.request.urlopen(f"{self.client_url}/health", timeout=1.0) as resp:
                    body = json.loads(resp.read() or b"{}")
                if body.get("health") == "true":
                    return
                last = f"/health answered {body}"
            except (OSError, urllib.error.URLError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EtcdStartError(f"etcd at {self.endpoint} not healthy after {self.start_timeout_s} s "
                                     f"(last: {last}); log tail:\n{self._log_tail()}")
            try:  # the wait between polls is a wait on the process: an early exit is seen at once
                code = self._proc.wait(timeout=min(0.05, remaining))
            except subprocess.TimeoutExpired:
                continue
            raise EtcdStartError(f"etcd ({self.binary}) exited with status {code} before it was healthy at "
                                 f"{self.endpoint}; log tail:\n{self._log_tail()}", port_taken=self._bind_failed())

    def _bind_failed(self) -> bool:
        """This start's log says a port was taken (etcd's ``bind: address already in use``)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)
                return b"address already in use" in f.read()
        except OSError:
            return False

    def _log_tail(self, n_lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n_lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL now (a crashed etcd); the data directory stays until ``stop()``."""
        if self.running():
            assert self._proc is not None
            self._proc.kill()
            self._proc.wait()

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``stop_timeout_s``) and remove the directory it owns."""
        try:
            if self._proc is not None:
                _terminate(self._proc, self.stop_timeout_s)
        finally:
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
            if self._owned_dir is not None:
                shutil.rmtree(self._owned_dir, ignore_errors=True)
                self._owned_dir = None

    def restart(self) -> EtcdProcess:
        """Stop (keeping the data) and start again on the same ports."""
        if self._proc is not None:
            _terminate(self._proc, self.stop_timeout_s)
        return self.start()

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else "stopped"
        return f"EtcdProcess({self.client_url if self.client_port else 'unstarted'}, {state})"
