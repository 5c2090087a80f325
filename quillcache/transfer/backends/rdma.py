"""The ``rdma`` backend: one-sided RDMA READ/WRITE over RC queue pairs, through ``pyverbs``.

UNVERIFIED: this code has never moved a byte. The machines it was written on have no RDMA device
and cannot run SoftRoCE, so only what needs no device is tested here (the probe, descriptor
building, the QP-information record, the verbs objects that can be built without a device). It is
verified only once ``tests/test_transfer_rdma.py`` runs its device tests on RDMA hardware.

What it does:

- ``start`` probes for ``pyverbs`` and a device (``probe``) and raises ``TransferError`` naming the
  reason when either is missing, so ``TransferEngine("rdma", secret=...)`` fails with that reason
  and leaves nothing running. Otherwise it opens the device (``Context``, ``PD``), starts the TCP
  backend's ``TcpServer`` on ``host:port_tcp`` (the region list with names, and the TCP protocol
  as a fallback path), and a CONTROL listener on ``host:ctrl_port``. Its address is
  ``rdma://HOST:TCP_PORT/CTRL_PORT``.
- Regions are registered as memory regions (``MR(pd, length, access, address=<the buffer's
  address>)``): writable regions with LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE, read-only ones with
  REMOTE_READ only (a LOCAL_WRITE registration would pin read-only pages for writing). The MR set
  follows the ``RegionTable``: it is synced before every QP exchange and every ``execute``, and
  ``unregister`` is wrapped (on that table instance) so a region's MR is deregistered — its rkey
  revoked — BEFORE the region is forgotten; no peer can then write into a buffer its owner
  believes is free.
- The QP information (``rdma_info``: QP number, PSN, LID, GID, MTU and every region's
  id/address/length/rkey) travels over a separate small control socket of this backend, not over a
  new TCP-protocol opcode; it is authenticated with the TCP protocol's HMAC helpers first
  (``rdma_control``). One control connection = one RC QP pair: the serving side creates its QP on
  the first record, brings it to RTS and answers with its own record; a later record on the same
  connection (same QP number and PSN) is a refresh returning its current regions; when the
  connection closes, the server destroys that QP. The initiator keeps it open while it uses the QP
  and checks it (a non-blocking peek) before every ``execute``: a peer that restarted is
  reconnected, not failed.
- Both QPs are RC, created in INIT with ``qp_access_flags`` = LOCAL_WRITE | REMOTE_READ |
  REMOTE_WRITE (the INIT transition is where ibverbs applies them; pyverbs' ``QPAttr`` defaults to
  0, which would refuse every one-sided access), then ``to_rts`` with the peer's QP number and PSN,
  the smaller of the two active MTUs, and a GRH route to the peer's GID when it has one (RoCE),
  else its LID (InfiniBand).
- ``execute``: each item becomes one signalled RDMA READ or WRITE work request (``build_descriptor``
  → ``make_send_wr``: one SGE over the item's local view with the local MR's lkey, the remote
  address and rkey from the peer's record; ``wr_id`` = the item's position in the list), at most
  ``max_send_wr`` in flight; the CQ is polled until every item has its completion, and each item
  ends COMPLETED (IBV_WC_SUCCESS) or FAILED with the completion status's name. A READ is complete
  when its bytes are in the local region; a WRITE when the responder's RC acknowledgement came back,
  which it sends once the data is placed in its memory.
- Deadlines: when an item's deadline passes with its work request outstanding, a single WR cannot
  be cancelled, so the QP is moved to the error state, the flushed completions are drained (up to
  ``drain_timeout_s``), the expired items end TIMEOUT (the others FAILED, flushed) and the peer is
  dropped; the next ``execute`` to it reconnects. An error completion also drops the peer (an RC QP
  in error completes everything after it as flushed).
- ``lanes`` is 1: one QP per peer, and concurrent ``execute`` calls to one peer take turns on it
  (a CQ is polled by one thread at a time, so no thread sees another's completions).

The control listener against peers that do not know the secret: ``acceptor.PreauthAcceptor``, the TCP
server's listener (its docstring states the rules), with the control connections' wording and this
module's logger, counting in ``ctrl_stats``:

- Authentication runs on the accepting thread (``qc-rdma-ctrl:PORT``) without a thread per connection;
  only an authenticated connection gets a thread of its own (``qc-rdma-ctrl-conn:PORT``), which sends
  ACCEPT and then serves its QP. So the control threads are at most one plus ``max_server_connections``
  (and any that have just let their slot go and are ending), however many connections are opened.
- The caps ``max_server_connections`` (authenticated control connections, ``_ctrl``) and
  ``max_preauth_connections`` (authenticating ones, the oldest answered BUSY for a newer one),
  ``auth_timeout_s``, and the rate-limited log of dropped connections are the acceptor's.
- The initiating side tries a BUSY answer again on a fresh connection (``tcp_client.retry_busy``: a
  jittered backoff until its deadline, then it gives up naming the server's reason;
  ``ctrl_stats.busy_retries``).
- ``close`` closes the acceptor (no connection is handed over after it, and every authenticating one is
  closed), then shuts every authenticated connection and joins every thread.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

from quillcache.transfer import rdma_control as C
from quillcache.transfer.backends.acceptor import AcceptorStats, PreauthAcceptor
from quillcache.transfer.backends.sockets import TcpConfig
from quillcache.transfer.backends.tcp import _secret_bytes, check_host
from quillcache.transfer.backends.tcp_client import TcpClient, retry_busy
from quillcache.transfer.backends.tcp_server import TcpServer
from quillcache.transfer.batch import Item
from quillcache.transfer.rdma_info import ZERO_GID, QpInfo, gid_from_str
from quillcache.transfer.rdma_verbs import (
    WC_SUCCESS,
    MrTable,
    RdmaConfig,
    RdmaProbe,
    WorkDescriptor,
    build_descriptor,
    format_rdma_address,
    load_pyverbs,
    make_send_wr,
    parse_rdma_address,
    probe,
    qp_access,
    rts_attr,
    wc_status_name,
)
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import (
    AuthenticationError,
    Outcome,
    ProtocolError,
    RegionError,
    RemoteRegion,
    TransferError,
)

__all__ = ["CtrlStats", "RdmaBackend", "RdmaConfig", "RdmaProbe", "probe"]

log = logging.getLogger("quillcache.transfer.rdma")


@dataclass
class CtrlStats(AcceptorStats):
    """Counters of the control listener (serving side: the acceptor's) and of BUSY answers met when connecting."""

    busy_retries: int = 0     # initiating side: control connections a peer answered BUSY, tried again


# ---- the backend ----------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Peer:
    address: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None
    cq: object = None
    qp: object = None
    local: QpInfo | None = None
    remote: QpInfo | None = None


class RdmaBackend:
    name = "rdma"

    def __init__(self, *, secret: str | bytes, device: str | None = None, port: int = 1, gid_index: int = 0,
                 host: str = "127.0.0.1", port_tcp: int = 0, ctrl_port: int = 0, config: TcpConfig | None = None,
                 rdma_config: RdmaConfig | None = None) -> None:
        self.secret = _secret_bytes(secret)
        self.config = config if config is not None else TcpConfig()
        if not isinstance(self.config, TcpConfig):
            raise TypeError(f"config must be a TcpConfig, got {type(self.config).__name__}")
        self.rdma_config = rdma_config if rdma_config is not None else RdmaConfig()
        if not isinstance(self.rdma_config, RdmaConfig):
            raise TypeError(f"rdma_config must be an RdmaConfig, got {type(self.rdma_config).__name__}")
        if device is not None and (not isinstance(device, str) or not device):
            raise ValueError(f"device must be a non-empty str or None, got {device!r}")
        for name, v, lo, hi in (("port", port, 1, 255), ("gid_index", gid_index, 0, 0xFFFF),
                                ("port_tcp", port_tcp, 0, 65535), ("ctrl_port", ctrl_port, 0, 65535)):
            if type(v) is not int or not lo <= v <= hi:
                raise ValueError(f"{name} must be an int in {lo}..{hi}, got {v!r}")
        self.device, self.port, self.gid_index = device, port, gid_index
        self.host, self.port_tcp, self.ctrl_port = check_host("host", host), port_tcp, ctrl_port
        self.client = TcpClient(self.secret, self.config)
        self.server: TcpServer | None = None
        self.probe_result: RdmaProbe | None = None
        self.address = ""
        self._v: SimpleNamespace | None = None
        self._ctx = self._pd = self._server_cq = None
        self._lid, self._gid, self._mtu = 0, ZERO_GID, 0
        self._mrs: MrTable | None = None
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._acceptor: PreauthAcceptor | None = None
        self._ctrl: dict[socket.socket, threading.Thread] = {}  # authenticated, each with its thread (_lock)
        self.ctrl_stats = CtrlStats()
        self._closing = False

    @property
    def fixed_address(self) -> bool:
        """Whether this backend serves at a port its caller chose, where a later process may serve next (the
        engine then starts its region ids at a random value)."""
        return self.port_tcp != 0 or self.ctrl_port != 0

    # ---- lifetime ---------------------------------------------------------------------------------------------

    def start(self, regions: RegionTable) -> str:
        result = probe(self.device)
        self.probe_result = result
        if not result.available:
            raise TransferError(f"the rdma backend cannot start: {result.reason}")
        v = self._v = load_pyverbs()
        e = v.e
        try:
            dev = self.device or result.devices[0]
            self._ctx = v.device.Context(name=dev)
            pattr = self._ctx.query_port(self.port)
            if pattr.state != e.IBV_PORT_ACTIVE:
                raise TransferError(f"RDMA device {dev} port {self.port} is not active (state {pattr.state})")
            self._lid, self._mtu = int(pattr.lid), int(pattr.active_mtu)
            self._gid = gid_from_str(self._ctx.query_gid(self.port, self.gid_index).gid)
            self._pd = v.pd.PD(self._ctx)
            self._server_cq = v.cq.CQ(self._ctx, self.rdma_config.cq_entries)
            self._mrs = MrTable(v, self._pd, regions)
            self.server = TcpServer(regions, self.secret, self.config, self.host, self.port_tcp)
            self._acceptor = PreauthAcceptor(self.host, self.ctrl_port, self.secret, self.config, self.ctrl_stats,
                                             lock=self._lock, conns=self._ctrl, serve=self._serve_ctrl, log=log,
                                             label="RDMA control", listener="RDMA control listener",
                                             thread_name="qc-rdma-ctrl", conn_thread_name="qc-rdma-ctrl-conn")
            ctrl_port = self._acceptor.port
            self._acceptor.start()
        except v.errors.PyverbsError as err:
            self.close()
            raise TransferError(f"the rdma backend cannot start on {self.device or result.devices[0]}: {err}") from err
        except BaseException:
            self.close()
            raise
        self.address = format_rdma_address(self.server.host, self.server.port, ctrl_port)
        return self.address

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            peers = list(self._peers.values())
            self._peers.clear()
        if self._acceptor is not None:
            self._acceptor.close()  # no control connection is handed over from here on: _ctrl is complete
        with self._lock:
            ctrl = dict(self._ctrl)
        for s in ctrl:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in ctrl.values():
            if t.ident is not None:  # started (one whose start failed is not in the table; never join it)
                t.join(timeout=5)
        for peer in peers:
            with peer.lock:
                self._drop(peer)
        self.client.close()
        if self.server is not None:
            self.server.close()
        if self._mrs is not None:
            self._mrs.close()
        for obj in (self._server_cq, self._pd, self._ctx):
            _close_quietly(obj)
        self._server_cq = self._pd = self._ctx = None

    def _my_info(self, qp_num: int, psn: int) -> QpInfo:
        assert self._mrs is not None
        return QpInfo(qp_num, psn, self._lid, self._gid, self._mtu, self._mrs.keys())

    # ---- queue pairs ------------------------------------------------------------------------------------------

    def _new_qp(self, cq: object) -> object:
        v, cfg = self._v, self.rdma_config
        assert v is not None
        e = v.e
        cap = v.qp.QPCap(max_send_wr=cfg.max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        attr = v.qp.QPAttr(port_num=self.port)
        attr.qp_access_flags = qp_access(e)  # applied by the RESET→INIT transition QP() performs
        return v.qp.QP(self._pd, init, attr)

    def _to_rts(self, qp: object, local: QpInfo, remote: QpInfo) -> None:
        assert self._v is not None
        qp.to_rts(rts_attr(self._v, port_num=self.port, gid_index=self.gid_index, local=local, remote=remote,
                           config=self.rdma_config))  # type: ignore[attr-defined]

    def _send_info(self, sock: socket.socket, info: QpInfo, deadline: float | None) -> None:
        C.send_info(sock, info, self.config.progress_timeout_s, deadline)

    def _recv_info(self, sock: socket.socket, deadline: float | None, first_s: float | None = None) -> QpInfo:
        return C.recv_info(sock, self.config.progress_timeout_s, self.rdma_config.max_regions, deadline, first_s)

    # serving side: the acceptor accepts, challenges and checks proofs (module docstring)

    def ctrl_connections(self) -> int:
        """Authenticated control connections held (at most ``max_server_connections``)."""
        with self._lock:
            return len(self._ctrl)

    def preauth_connections(self) -> int:
        """Control connections still authenticating (at most ``max_preauth_connections``)."""
        return 0 if self._acceptor is None else self._acceptor.authenticating()

    # one thread per authenticated control connection (the acceptor adds it to _ctrl and starts it)

    def _serve_ctrl(self, sock: socket.socket, peer: tuple, accept: bytes) -> None:
        cfg = self.config
        qp = None
        first: QpInfo | None = None
        try:
            sock.setblocking(True)
            C.tune(sock)
            C.send_all(sock, accept, cfg.auth_timeout_s)
            psn = secrets.randbits(24)
            while True:
                # no idle timeout: RDMA traffic never touches this connection, and closing it kills the QP
                theirs = self._recv_info(sock, None, first_s=C.CTRL_IDLE_S)
                if first is None:
                    first = theirs
                    qp = self._new_qp(self._server_cq)
                elif (theirs.qp_num, theirs.psn) != (first.qp_num, first.psn):
                    raise ProtocolError(f"QP info changed on one control connection: QP {first.qp_num} PSN "
                                        f"{first.psn} became QP {theirs.qp_num} PSN {theirs.psn}")
                self._mrs.sync()
                mine = self._my_info(int(qp.qp_num), psn)  # type: ignore[union-attr]
                if theirs is first:
                    self._to_rts(qp, mine, theirs)
                self._send_info(sock, mine, None)
        except ProtocolError as err:  # from a peer that proved the secret: rare, and worth a line each
            log.warning("closing RDMA control connection from %s: %s", peer, err)
        except ConnectionError as err:
            log.debug("RDMA control connection from %s ended: %s", peer, err)
        except OSError as err:
            if not self._closing:
                log.info("RDMA control connection from %s failed: %s", peer, err)
        except Exception as err:  # a verbs failure: this peer's QP only
            log.warning("RDMA control connection from %s: %s: %s", peer, type(err).__name__, err)
        finally:
            _close_quietly(qp)
            sock.close()
            with self._lock:
                self._ctrl.pop(sock, None)

    # initiating side

    def _peer(self, address: str) -> _Peer:
        with self._lock:
            if self._closing:
                raise TransferError("the transfer engine is closed")
            peer = self._peers.get(address)
            if peer is None:
                peer = self._peers[address] = _Peer(address)
            return peer

    def _connect(self, peer: _Peer, deadline: float) -> None:
        """Open the control connection, exchange QP records and bring a fresh QP to RTS (peer.lock held).

        A peer that answers BUSY is tried again on a fresh connection with a jittered backoff until ``deadline``
        (then ``socket.timeout`` naming its reason: ``retry_busy``)."""
        assert self._v is not None
        cfg = self.config
        host, _, ctrl = parse_rdma_address(peer.address)

        def connect() -> socket.socket:
            if self._closing:
                raise TransferError("the transfer engine is closed")
            return C.connect_peer(host, ctrl, self.secret, connect_timeout_s=cfg.connect_timeout_s,
                                  auth_timeout_s=cfg.auth_timeout_s, progress_s=cfg.progress_timeout_s,
                                  deadline=deadline)

        sock = retry_busy(connect, C.Busy, deadline, self.ctrl_stats, log)
        try:
            peer.sock = sock
            peer.cq = self._v.cq.CQ(self._ctx, self.rdma_config.cq_entries)
            peer.qp = self._new_qp(peer.cq)
            self._mrs.sync()
            peer.local = self._my_info(int(peer.qp.qp_num), secrets.randbits(24))  # type: ignore[attr-defined]
            self._send_info(sock, peer.local, deadline)
            peer.remote = self._recv_info(sock, deadline)
            self._to_rts(peer.qp, peer.local, peer.remote)
        except BaseException:
            self._drop(peer)
            sock.close()
            raise

    def _refresh(self, peer: _Peer, deadline: float) -> None:
        """Re-send our record on the same QP and take the peer's current regions (peer.lock held)."""
        assert peer.sock is not None and peer.local is not None
        self._mrs.sync()
        peer.local = self._my_info(peer.local.qp_num, peer.local.psn)
        self._send_info(peer.sock, peer.local, deadline)
        peer.remote = self._recv_info(peer.sock, deadline)

    def _drop(self, peer: _Peer) -> None:
        _close_quietly(peer.qp)
        _close_quietly(peer.cq)
        if peer.sock is not None:
            peer.sock.close()
        peer.sock = peer.qp = peer.cq = None
        peer.local = peer.remote = None

    # ---- the Backend contract ---------------------------------------------------------------------------------

    def lanes(self, address: str) -> int:
        return 1

    def open_segment(self, address: str, timeout_s: float) -> tuple[RemoteRegion, ...]:
        host, tcp_port, _ = parse_rdma_address(address)
        tcp_address = f"[{host}]:{tcp_port}" if ":" in host else f"{host}:{tcp_port}"
        regions = self.client.list_regions(tcp_address, timeout_s)  # names, lengths, writability
        deadline = time.monotonic() + timeout_s
        peer = self._peer(address)
        with peer.lock:
            try:
                if peer.qp is not None and not C.alive(peer.sock):
                    self._drop(peer)  # the peer restarted or dropped us: its QP is gone
                if peer.qp is None:
                    self._connect(peer, deadline)
                else:
                    self._refresh(peer, deadline)
            except (ProtocolError, AuthenticationError):
                self._drop(peer)
                raise
            except OSError as err:
                self._drop(peer)
                raise TransferError(f"cannot reach the RDMA control port of {address}: {err}") from err
            except Exception as err:
                self._drop(peer)
                raise TransferError(f"cannot connect a queue pair to {address}: {type(err).__name__}: {err}") from err
        return regions

    def execute(self, address: str, items: list[Item]) -> None:
        try:
            peer = self._peer(address)
        except TransferError as err:
            for it in items:
                it.finish(Outcome.FAILED, str(err))
            return
        with peer.lock:
            self._execute_locked(peer, items)

    def _execute_locked(self, peer: _Peer, items: list[Item]) -> None:
        live = []
        for it in items:
            if it.remaining_s() <= 0:
                it.finish(Outcome.TIMEOUT, "deadline passed before the request was posted")
            else:
                live.append(it)
        if not live:
            return
        deadline = max(it.deadline_s for it in live)
        try:
            if peer.qp is not None and not C.alive(peer.sock):
                log.info("the control connection to %s closed; reconnecting its queue pair", peer.address)
                self._drop(peer)
            if peer.qp is None:
                self._connect(peer, deadline)
            else:
                self._mrs.sync()
        except socket.timeout as err:
            for it in live:
                it.finish(Outcome.TIMEOUT, f"could not connect a queue pair to {peer.address} before the "
                                           f"deadline: {err}")
            return
        except Exception as err:
            for it in live:
                it.finish(Outcome.FAILED, f"cannot connect a queue pair to {peer.address}: "
                                          f"{type(err).__name__}: {err}")
            return
        assert peer.remote is not None
        if any(peer.remote.region(rid) is None for rid in {it.request.remote_region for it in live}):
            try:  # a region the peer registered after our last exchange
                self._refresh(peer, deadline)
            except Exception as err:
                self._drop(peer)
                for it in live:
                    it.finish(Outcome.FAILED, f"cannot refresh {peer.address}'s regions: {type(err).__name__}: {err}")
                return
        work: deque[tuple[int, Item, WorkDescriptor]] = deque()
        remote_keys = {r.region_id: r for r in peer.remote.regions}
        for pos, it in enumerate(live):
            req = it.request
            local = self._mrs.local(req.local_region)  # type: ignore[union-attr]
            remote = remote_keys.get(req.remote_region)
            try:
                if local is None:
                    raise RegionError(f"local region {req.local_region} has no memory region registered")
                if remote is None:
                    raise RegionError(f"{peer.address} has no memory region for region {req.remote_region}")
                work.append((pos, it, build_descriptor(it, local, remote)))
            except RegionError as err:
                it.finish(Outcome.FAILED, str(err))
        if work:
            self._post_and_poll(peer, work)

    def _post_and_poll(self, peer: _Peer, work: deque[tuple[int, Item, WorkDescriptor]]) -> None:
        v, cfg = self._v, self.rdma_config
        assert v is not None
        qp, cq = peer.qp, peer.cq
        pending: dict[int, Item] = {}
        broken = ""
        idle = 0
        while work or pending:
            while work and not broken and len(pending) < cfg.max_send_wr:
                pos, it, desc = work.popleft()
                if it.remaining_s() <= 0:
                    it.finish(Outcome.TIMEOUT, "deadline passed before the request was posted")
                    continue
                wr = make_send_wr(v, desc, pos)
                try:
                    qp.post_send(wr)  # type: ignore[attr-defined]
                except Exception as err:
                    it.finish(Outcome.FAILED, f"post_send failed: {err}")
                    broken = f"post_send failed: {err}"
                    continue
                finally:
                    wr.close()  # type: ignore[attr-defined]
                pending[pos] = it
            if broken:
                for _, it, _ in work:
                    it.finish(Outcome.FAILED, f"not posted: the queue pair to {peer.address} failed ({broken})")
                work.clear()
            if not pending:
                break
            try:
                n, wcs = cq.poll(num_entries=min(len(pending), 64))  # type: ignore[attr-defined]
            except Exception as err:
                broken = f"poll_cq failed: {err}"
                break
            for wc in wcs:
                it = pending.pop(int(wc.wr_id), None)
                if it is None:
                    log.warning("completion for unknown work request %s from %s", wc.wr_id, peer.address)
                    continue
                if wc.status == WC_SUCCESS:
                    it.finish(Outcome.COMPLETED, transferred_bytes=it.request.length_bytes)
                else:
                    name = wc_status_name(wc.status)
                    it.finish(Outcome.FAILED, f"{it.request.op.name} completed with {name} "
                                              f"(vendor error {wc.vendor_err:#x})")
                    if not broken:
                        broken = f"completion {name}"
            if n:
                idle = 0
                continue
            now = time.monotonic()
            if any(it.deadline_s <= now for it in pending.values()):
                self._reset(peer, pending, why="deadline passed with the work request outstanding")
                broken = broken or "a request timed out"
                break
            idle += 1
            if idle > cfg.spin_polls:
                time.sleep(cfg.poll_sleep_s)
        if pending:  # poll failed: state unknown
            self._reset(peer, pending, why=broken or "the completion queue failed")
        if broken:
            log.info("dropping the queue pair to %s: %s", peer.address, broken)
            self._drop(peer)

    def _reset(self, peer: _Peer, pending: dict[int, Item], why: str) -> None:
        """Move the QP to ERROR, drain its completions, destroy it, THEN finish what was outstanding.

        A work request that cannot be cancelled may still move bytes until its QP is in error (or
        destroyed), so no outstanding item is finished — and its local range released to the
        engine — before the QP is gone. A request whose completion turns out to be a success
        during the drain ends COMPLETED; the rest TIMEOUT when their own deadline passed, else FAILED.
        """
        v = self._v
        assert v is not None
        done: dict[int, int] = {}
        try:
            attr = v.qp.QPAttr(qp_state=v.e.IBV_QPS_ERR)
            peer.qp.modify(attr, v.e.IBV_QP_STATE)  # type: ignore[attr-defined]
            end = time.monotonic() + self.rdma_config.drain_timeout_s
            while len(done) < len(pending) and time.monotonic() < end:
                n, wcs = peer.cq.poll(num_entries=64)  # type: ignore[attr-defined]
                for wc in wcs:
                    done[int(wc.wr_id)] = int(wc.status)
                if not n:
                    time.sleep(self.rdma_config.poll_sleep_s)
        except Exception as err:
            log.warning("resetting the queue pair to %s failed: %s", peer.address, err)
        undrained = len(pending) - sum(1 for pos in pending if pos in done)
        if undrained:
            log.warning("%d work requests to %s had no completion after the reset; destroying the queue pair",
                        undrained, peer.address)
        self._drop(peer)
        now = time.monotonic()
        for pos, it in pending.items():
            if done.get(pos) == WC_SUCCESS:
                it.finish(Outcome.COMPLETED, transferred_bytes=it.request.length_bytes)
            else:
                it.finish(Outcome.TIMEOUT if it.deadline_s <= now else Outcome.FAILED,
                          f"{why} ({peer.address}); the queue pair was reset")
        pending.clear()


def _close_quietly(obj: object) -> None:
    if obj is None:
        return
    try:
        obj.close()  # type: ignore[attr-defined]
    except Exception as err:
        log.debug("closing %s failed: %s", type(obj).__name__, err)
