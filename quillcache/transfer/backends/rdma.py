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
- The QP information (``rdma_info``: a versioned, explicitly packed record of QP number, PSN, LID,
  GID, MTU and every region's id/address/length/rkey) travels over a SEPARATE small control socket
  of this backend, not over a new opcode of the TCP protocol: the control connection first passes
  exactly the TCP protocol's HMAC challenge-response (``protocol.encode_hello``/``decode_proof``/
  ``encode_accept`` on the serving side, ``decode_hello``/``client_proof``/``decode_accept`` on the
  initiating side), then the initiator sends its record and the server answers with its own. One
  control connection = one RC QP pair: the serving side creates its QP on the first record, brings
  it to RTS and answers; a later record on the same connection (same QP number and PSN) is a
  refresh that returns the server's current regions; when the connection closes the server
  destroys that QP. The initiator keeps the connection open while it uses the QP.
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
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace

import numpy as np

from quillcache.transfer import protocol as P
from quillcache.transfer.backends.sockets import TcpConfig
from quillcache.transfer.backends.tcp import _secret_bytes
from quillcache.transfer.backends.tcp_client import TcpClient, parse_address
from quillcache.transfer.backends.tcp_server import TcpServer
from quillcache.transfer.batch import Item
from quillcache.transfer.rdma_info import (
    HEADER,
    REGION,
    ZERO_GID,
    QpInfo,
    RegionKey,
    decode_qp_info,
    encode_qp_info,
    gid_from_str,
    gid_to_str,
    read_region_count,
)
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import (
    AuthenticationError,
    Op,
    Outcome,
    ProtocolError,
    RegionError,
    RemoteRegion,
    TransferError,
    TransferRequest,
)

__all__ = [
    "DIST_PACKAGES",
    "MAX_MESSAGE_BYTES",
    "LocalKey",
    "RdmaBackend",
    "RdmaConfig",
    "RdmaProbe",
    "WorkDescriptor",
    "buffer_address",
    "build_descriptor",
    "format_rdma_address",
    "load_pyverbs",
    "make_send_wr",
    "mr_access",
    "parse_rdma_address",
    "probe",
    "qp_access",
    "rts_attr",
    "wc_status_name",
    "wr_opcode",
]

log = logging.getLogger("quillcache.transfer.rdma")

DIST_PACKAGES = "/usr/lib/python3/dist-packages"  # where Debian's python3-pyverbs installs
MAX_MESSAGE_BYTES = 1 << 31  # the usual ibv_port_attr.max_msg_sz; one work request moves at most this
SYSFS_RDMA = "/sys/class/infiniband"

# enum ibv_wc_status (ABI-stable values, infiniband/verbs.h)
_WC_STATUS = (
    "SUCCESS", "LOC_LEN_ERR", "LOC_QP_OP_ERR", "LOC_EEC_OP_ERR", "LOC_PROT_ERR", "WR_FLUSH_ERR",
    "MW_BIND_ERR", "BAD_RESP_ERR", "LOC_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_ACCESS_ERR", "REM_OP_ERR",
    "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR", "LOC_RDD_VIOL_ERR", "REM_INV_RD_REQ_ERR", "REM_ABORT_ERR",
    "INV_EECN_ERR", "INV_EEC_STATE_ERR", "FATAL_ERR", "RESP_TIMEOUT_ERR", "GENERAL_ERR", "TM_ERR",
    "TM_RNDV_INCOMPLETE",
)
WC_SUCCESS, WC_WR_FLUSH_ERR = 0, 5
_CTRL_IDLE_S = 365 * 86400.0  # a control connection waits this long for a refresh (keepalive finds dead hosts)


# ---- finding pyverbs and a device -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RdmaProbe:
    """Whether the RDMA backend can run here; ``reason`` says exactly why not (or what was found)."""

    available: bool
    reason: str
    devices: tuple[str, ...] = ()
    pyverbs_version: str | None = None


_LOAD_LOCK = threading.Lock()
_VERBS: SimpleNamespace | None = None


def _import_all() -> SimpleNamespace:
    pyverbs = importlib.import_module("pyverbs")
    try:  # rdma-core >= v50 (and the only name in current releases)
        enums = importlib.import_module("pyverbs.libibverbs_enums")
    except ImportError:  # rdma-core <= v58, e.g. Debian bookworm's 44.0
        enums = importlib.import_module("pyverbs.enums")
    mods = {name: importlib.import_module(f"pyverbs.{name}")
            for name in ("pyverbs_error", "device", "pd", "cq", "mr", "qp", "wr", "addr")}
    return SimpleNamespace(pyverbs=pyverbs, e=enums, enums_module=enums.__name__,
                           errors=mods["pyverbs_error"], **mods)


def _version(pyverbs: ModuleType) -> str | None:
    try:
        return str(importlib.import_module("pyverbs.__version__").__version__)  # built from rdma-core's tree
    except Exception:
        pass
    try:
        from importlib.metadata import version

        return version("pyverbs")  # PyPI's pyverbs
    except Exception:
        pass
    if str(getattr(pyverbs, "__file__", "")).startswith(DIST_PACKAGES):
        try:  # Debian's python3-pyverbs carries no Python metadata
            out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "python3-pyverbs"], capture_output=True,
                                 text=True, timeout=5, check=False)
            if out.returncode == 0 and out.stdout.strip():
                return f"{out.stdout.strip()} (Debian python3-pyverbs)"
        except Exception:
            pass
    return None


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs modules this backend uses (``e`` is the enum module, wherever it lives), loaded once.

    ``import pyverbs`` from ``sys.path`` first; failing that, from ``DIST_PACKAGES`` (Debian's
    ``python3-pyverbs``), which is put on ``sys.path`` only for that import and taken off again so
    no other Debian package shadows the venv's. Raises ``ImportError`` saying what was tried.
    """
    global _VERBS
    with _LOAD_LOCK:
        if _VERBS is not None:
            return _VERBS
        try:
            verbs = _import_all()
        except ImportError as first:
            if not os.path.isdir(os.path.join(DIST_PACKAGES, "pyverbs")) or DIST_PACKAGES in sys.path:
                raise
            for name in [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")]:
                del sys.modules[name]  # a half-imported package must not hide the second try
            sys.path.append(DIST_PACKAGES)
            try:
                verbs = _import_all()
            except ImportError as second:
                raise ImportError(f"{first} (on sys.path); {second} (from {DIST_PACKAGES})") from None
            finally:
                sys.path.remove(DIST_PACKAGES)
        verbs.version = _version(verbs.pyverbs)
        _VERBS = verbs
        return verbs


def _device_name(dev: object) -> str:
    name = getattr(dev, "name", dev)
    return name.decode("utf-8", "replace") if isinstance(name, (bytes, bytearray)) else str(name)


def probe(device: str | None = None) -> RdmaProbe:
    """Can RDMA run here? Never raises; ``reason`` is the exact cause when it cannot."""
    try:
        verbs = load_pyverbs()
    except Exception as e:
        return RdmaProbe(False, f"pyverbs not importable: {type(e).__name__}: {e}")
    version = verbs.version
    try:
        found = verbs.device.get_device_list()
    except Exception as e:
        hint = ("" if os.path.isdir(SYSFS_RDMA)
                else f"; {SYSFS_RDMA} does not exist: no RDMA driver is loaded in this kernel")
        return RdmaProbe(False, f"no RDMA device: get_device_list() raised {type(e).__name__}: {e}{hint}",
                         (), version)
    try:
        names = tuple(_device_name(d) for d in found)
    except Exception as e:
        return RdmaProbe(False, f"no RDMA device: cannot read the device list: {type(e).__name__}: {e}", (), version)
    if not names:
        return RdmaProbe(False, "no RDMA device: get_device_list() returned []", (), version)
    if device is not None and device not in names:
        return RdmaProbe(False, f"no RDMA device named {device!r}: get_device_list() returned {list(names)}",
                         names, version)
    return RdmaProbe(True, f"RDMA devices {list(names)} through pyverbs ({verbs.enums_module})", names, version)


# ---- pure pieces (no device needed) -------------------------------------------------------------------------------

def mr_access(e: object, writable: bool) -> int:
    """MR access flags: a writable region is read and written locally and remotely; a read-only one is
    only read remotely."""
    if writable:
        return e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE  # type: ignore[attr-defined]
    return e.IBV_ACCESS_REMOTE_READ  # type: ignore[attr-defined]


def qp_access(e: object) -> int:
    """``qp_access_flags`` of every QP: the peer may READ and WRITE what the MRs allow."""
    return e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE  # type: ignore[attr-defined]


def wr_opcode(e: object, op: Op) -> int:
    return e.IBV_WR_RDMA_READ if op is Op.READ else e.IBV_WR_RDMA_WRITE  # type: ignore[attr-defined]


def wc_status_name(status: int) -> str:
    if isinstance(status, int) and 0 <= status < len(_WC_STATUS):
        return f"IBV_WC_{_WC_STATUS[status]}"
    return f"unknown completion status {status!r}"


@dataclass(frozen=True)
class LocalKey:
    """A local region's MR as a work request needs it: base address, length, lkey."""

    region_id: int
    addr: int
    length_bytes: int
    lkey: int
    writable: bool = True


@dataclass(frozen=True)
class WorkDescriptor:
    """One work request: ``op`` over ``length`` bytes, local ``(addr, lkey)`` ↔ remote ``(addr, rkey)``."""

    op: Op
    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int


def build_descriptor(item: Item | TransferRequest, local: LocalKey, remote: RegionKey) -> WorkDescriptor:
    """The work request for one item (pure). Raises ``RegionError`` when it does not fit.

    Checks: the keys are the item's regions; both ranges lie inside their MRs; a READ lands in a
    writable local region and a WRITE goes to a writable remote one; one work request moves at most
    ``MAX_MESSAGE_BYTES`` (an SGE's length is 32 bits).
    """
    req = item.request if isinstance(item, Item) else item
    if not isinstance(req, TransferRequest):
        raise TypeError(f"build_descriptor takes an Item or TransferRequest, got {type(item).__name__}")
    n = req.length_bytes
    if local.region_id != req.local_region:
        raise RegionError(f"local key is for region {local.region_id}, the request uses {req.local_region}")
    if remote.region_id != req.remote_region:
        raise RegionError(f"remote key is for region {remote.region_id}, the request uses {req.remote_region}")
    if n <= 0 or n > MAX_MESSAGE_BYTES:
        raise RegionError(f"{n} bytes in one RDMA work request (1..{MAX_MESSAGE_BYTES})")
    if req.local_offset_bytes < 0 or req.local_offset_bytes + n > local.length_bytes:
        raise RegionError(f"local range [{req.local_offset_bytes}, {req.local_offset_bytes + n}) lies outside "
                          f"region {local.region_id} of {local.length_bytes} bytes")
    if req.remote_offset_bytes < 0 or req.remote_offset_bytes + n > remote.length_bytes:
        raise RegionError(f"remote range [{req.remote_offset_bytes}, {req.remote_offset_bytes + n}) lies outside "
                          f"region {remote.region_id} of {remote.length_bytes} bytes")
    if req.op is Op.READ and not local.writable:
        raise RegionError(f"READ into read-only local region {local.region_id}")
    if req.op is Op.WRITE and not remote.writable:
        raise RegionError(f"WRITE to read-only remote region {remote.region_id}")
    return WorkDescriptor(req.op, local.addr + req.local_offset_bytes, n, local.lkey,
                          remote.addr + req.remote_offset_bytes, remote.rkey)


def make_send_wr(verbs: SimpleNamespace, desc: WorkDescriptor, wr_id: int) -> object:
    """A signalled ``SendWR`` with one SGE for ``desc``. The caller ``close()``s it after posting
    (pyverbs' SendWR frees its SGE array only in ``close``)."""
    e = verbs.e
    sge = verbs.wr.SGE(desc.local_addr, desc.length, desc.lkey)
    wr = verbs.wr.SendWR(wr_id=wr_id, opcode=wr_opcode(e, desc.op), num_sge=1, sg=[sge],
                         send_flags=e.IBV_SEND_SIGNALED)
    wr.set_wr_rdma(desc.rkey, desc.remote_addr)
    return wr


def rts_attr(verbs: SimpleNamespace, *, port_num: int, gid_index: int, local: QpInfo, remote: QpInfo,
             config: "RdmaConfig") -> object:
    """The ``QPAttr`` that takes our QP to RTS towards ``remote`` (ibv_rc_pingpong's PSN convention:
    we receive from the peer's PSN and send from ours)."""
    e = verbs.e
    attr = verbs.qp.QPAttr(port_num=port_num)
    attr.qp_access_flags = qp_access(e)
    attr.path_mtu = min(local.mtu, remote.mtu)
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.sq_psn = local.psn
    attr.max_dest_rd_atomic = config.max_rd_atomic
    attr.max_rd_atomic = config.max_rd_atomic
    attr.min_rnr_timer = config.min_rnr_timer
    attr.timeout = config.ack_timeout
    attr.retry_cnt = config.retry_cnt
    attr.rnr_retry = config.rnr_retry
    if remote.gid != ZERO_GID:
        gr = verbs.addr.GlobalRoute(dgid=verbs.addr.GID(gid_to_str(remote.gid)), sgid_index=gid_index)
        attr.ah_attr = verbs.addr.AHAttr(dlid=remote.lid, is_global=1, port_num=port_num, gr=gr)
    else:
        attr.ah_attr = verbs.addr.AHAttr(dlid=remote.lid, is_global=0, port_num=port_num)
    return attr


def buffer_address(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too); the view itself is kept by the caller."""
    arr = np.frombuffer(view, dtype=np.uint8)
    try:
        return int(arr.ctypes.data)
    finally:
        del arr


def format_rdma_address(host: str, tcp_port: int, ctrl_port: int) -> str:
    h = f"[{host}]" if ":" in host else host
    return f"rdma://{h}:{tcp_port}/{ctrl_port}"


def parse_rdma_address(address: str) -> tuple[str, int, int]:
    """``rdma://HOST:TCP_PORT/CTRL_PORT`` → ``(host, tcp_port, ctrl_port)``; else ``ValueError``."""
    if not isinstance(address, str) or not address.startswith("rdma://"):
        raise ValueError(f"bad RDMA peer address {address!r}: expected 'rdma://host:tcp_port/ctrl_port'")
    hostport, sep, ctrl = address[len("rdma://"):].rpartition("/")
    if not sep or not ctrl.isdigit() or not 0 < int(ctrl) < 65536:
        raise ValueError(f"bad RDMA peer address {address!r}: expected 'rdma://host:tcp_port/ctrl_port'")
    host, port = parse_address(hostport)
    return host, port, int(ctrl)


# ---- configuration --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RdmaConfig:
    """Knobs of the RDMA path. ``max_send_wr``: work requests in flight on one QP; ``cq_entries``: the
    CQ's size (≥ ``max_send_wr``); ``max_rd_atomic``: RDMA READs outstanding per QP; ``ack_timeout``
    (4.096 µs × 2^value), ``retry_cnt``, ``rnr_retry``, ``min_rnr_timer``: the RC transport's retry
    settings; ``drain_timeout_s``: how long a reset QP's flushed completions are awaited;
    ``poll_sleep_s``: the pause between empty CQ polls after ``spin_polls`` of them; ``max_regions``:
    the most regions a peer's record may list."""

    max_send_wr: int = 128
    cq_entries: int = 256
    max_rd_atomic: int = 16
    ack_timeout: int = 14
    retry_cnt: int = 7
    rnr_retry: int = 7
    min_rnr_timer: int = 12
    drain_timeout_s: float = 1.0
    poll_sleep_s: float = 20e-6
    spin_polls: int = 200
    max_regions: int = 4096

    def __post_init__(self) -> None:
        for name, lo, hi in (("max_send_wr", 1, 1 << 15), ("cq_entries", 1, 1 << 22), ("max_rd_atomic", 1, 255),
                             ("ack_timeout", 0, 31), ("retry_cnt", 0, 7), ("rnr_retry", 0, 7),
                             ("min_rnr_timer", 0, 31), ("spin_polls", 0, 1 << 20), ("max_regions", 1, 0xFFFF)):
            v = getattr(self, name)
            if type(v) is not int or not lo <= v <= hi:
                raise ValueError(f"RdmaConfig.{name} must be an int in {lo}..{hi}, got {v!r}")
        if self.cq_entries < self.max_send_wr:
            raise ValueError(f"RdmaConfig.cq_entries ({self.cq_entries}) must be at least max_send_wr "
                             f"({self.max_send_wr})")
        for name in ("drain_timeout_s", "poll_sleep_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"RdmaConfig.{name} must be a non-negative number of seconds, got {v!r}")


# ---- the backend ----------------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Mr:
    mr: object
    view: memoryview  # keeps the buffer alive while the MR pins it
    key: LocalKey
    rkey: int


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
        self.host, self.port_tcp, self.ctrl_port = host, port_tcp, ctrl_port
        self.client = TcpClient(self.secret, self.config)
        self.server: TcpServer | None = None
        self.probe_result: RdmaProbe | None = None
        self.address = ""
        self._v: SimpleNamespace | None = None
        self._ctx = self._pd = self._server_cq = None
        self._lid, self._gid, self._mtu = 0, ZERO_GID, 0
        self._regions: RegionTable | None = None
        self._mrs: dict[int, _Mr] = {}
        self._mr_lock = threading.RLock()
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._lsock: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._ctrl: dict[socket.socket, threading.Thread] = {}
        self._closing = False
        self._wrapped_unregister = False

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
            self._regions = regions
            self._wrap_unregister(regions)
            self._sync_mrs()
            self.server = TcpServer(regions, self.secret, self.config, self.host, self.port_tcp)
            self._lsock = socket.create_server((self.host, self.ctrl_port), backlog=64)
            ctrl_port = self._lsock.getsockname()[1]
            self._acceptor = threading.Thread(target=self._accept_loop, name=f"qc-rdma-ctrl:{ctrl_port}",
                                              daemon=True)
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
            ctrl = dict(self._ctrl)
        if self._lsock is not None:
            try:
                self._lsock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._lsock.close()
        for s in ctrl:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        for t in ctrl.values():
            t.join(timeout=5)
        for peer in peers:
            with peer.lock:
                self._drop(peer)
        self.client.close()
        if self.server is not None:
            self.server.close()
        if self._regions is not None and self._wrapped_unregister:
            self._regions.__dict__.pop("unregister", None)
            self._wrapped_unregister = False
        with self._mr_lock:
            for rid in list(self._mrs):
                self._dereg(rid)
        for obj in (self._server_cq, self._pd, self._ctx):
            _close_quietly(obj)
        self._server_cq = self._pd = self._ctx = None

    # ---- memory regions ---------------------------------------------------------------------------------------

    def _wrap_unregister(self, regions: RegionTable) -> None:
        """Deregister a region's MR (revoking its rkey) before the table forgets the region."""
        original = regions.unregister
        backend = self

        def unregister(region, *, timeout_s: float = 30.0) -> None:
            rid = getattr(region, "region_id", region)
            with backend._mr_lock:
                if rid in backend._mrs:
                    backend._dereg(rid)
            original(region, timeout_s=timeout_s)

        regions.unregister = unregister  # type: ignore[method-assign]
        self._wrapped_unregister = True

    def _dereg(self, rid: int) -> None:
        m = self._mrs.pop(rid)
        _close_quietly(m.mr)
        m.view.release()

    def _sync_mrs(self) -> None:
        """Make the MR set match the region table: register new regions, deregister vanished ones."""
        assert self._regions is not None and self._v is not None
        v = self._v
        with self._mr_lock:
            current = {r.region_id: r for r in self._regions.describe()}
            for rid in [rid for rid in self._mrs if rid not in current]:
                self._dereg(rid)
            for rid, r in current.items():
                if rid in self._mrs:
                    continue
                try:
                    view = self._regions.checkout(rid, 0, r.length_bytes, write=False)
                except RegionError:
                    continue  # unregistered in between
                try:
                    keep = view[:]  # our own export, held while the MR pins the pages
                finally:
                    view.release()
                    self._regions.release(rid)
                addr = buffer_address(keep)
                try:
                    mr = v.mr.MR(self._pd, r.length_bytes, mr_access(v.e, r.writable), address=addr)
                except BaseException:
                    keep.release()
                    raise
                self._mrs[rid] = _Mr(mr, keep, LocalKey(rid, addr, r.length_bytes, int(mr.lkey), r.writable),
                                     int(mr.rkey))

    def _my_info(self, qp_num: int, psn: int) -> QpInfo:
        with self._mr_lock:
            keys = tuple(RegionKey(m.key.region_id, m.key.addr, m.key.length_bytes, m.rkey, m.key.writable)
                         for m in self._mrs.values())
        return QpInfo(qp_num, psn, self._lid, self._gid, self._mtu, keys)

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
        send_all(sock, encode_qp_info(info), self.config.progress_timeout_s, deadline)

    def _recv_info(self, sock: socket.socket, deadline: float | None, first_s: float | None = None) -> QpInfo:
        cfg = self.config
        head = recv_exact(sock, HEADER.size, cfg.progress_timeout_s, deadline, first_s)
        count = read_region_count(head, self.rdma_config.max_regions)
        body = recv_exact(sock, count * REGION.size, cfg.progress_timeout_s, deadline) if count else b""
        return decode_qp_info(head + body, self.rdma_config.max_regions)

    # serving side

    def _accept_loop(self) -> None:
        assert self._lsock is not None
        while True:
            try:
                sock, peer = self._lsock.accept()
            except OSError:
                return
            with self._lock:
                if self._closing:
                    sock.close()
                    return
                if len(self._ctrl) >= self.config.max_server_connections:
                    log.warning("refusing RDMA control connection from %s: already %d", peer, len(self._ctrl))
                    sock.close()
                    continue
                t = threading.Thread(target=self._serve_ctrl, args=(sock, peer), daemon=True,
                                     name=f"qc-rdma-ctrl-conn:{peer[1]}")
                self._ctrl[sock] = t
            t.start()

    def _serve_ctrl(self, sock: socket.socket, peer: tuple) -> None:
        cfg = self.config
        qp = None
        first: QpInfo | None = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            nonce = P.new_nonce()
            send_all(sock, P.encode_hello(nonce), cfg.auth_timeout_s)
            proof = recv_exact(sock, P.PROOF.size, cfg.auth_timeout_s, first_s=cfg.auth_timeout_s)
            client_nonce = P.decode_proof(proof, self.secret, nonce)
            send_all(sock, P.encode_accept(P.server_proof(self.secret, nonce, client_nonce)), cfg.auth_timeout_s)
            psn = secrets.randbits(24)
            while True:
                # no idle timeout: RDMA traffic never touches this connection, and closing it kills the QP
                theirs = self._recv_info(sock, None, first_s=_CTRL_IDLE_S)
                if first is None:
                    first = theirs
                    qp = self._new_qp(self._server_cq)
                elif (theirs.qp_num, theirs.psn) != (first.qp_num, first.psn):
                    raise ProtocolError(f"QP info changed on one control connection: QP {first.qp_num} PSN "
                                        f"{first.psn} became QP {theirs.qp_num} PSN {theirs.psn}")
                self._sync_mrs()
                mine = self._my_info(int(qp.qp_num), psn)  # type: ignore[union-attr]
                if theirs is first:
                    self._to_rts(qp, mine, theirs)
                self._send_info(sock, mine, None)
        except (AuthenticationError, ProtocolError) as err:
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
        """Open the control connection, exchange QP records and bring a fresh QP to RTS (peer.lock held)."""
        assert self._v is not None
        cfg = self.config
        host, _, ctrl = parse_rdma_address(peer.address)
        timeout = max(0.001, min(cfg.connect_timeout_s, deadline - time.monotonic()))
        sock = socket.create_connection((host, ctrl), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            hs_deadline = min(deadline, time.monotonic() + cfg.auth_timeout_s + cfg.connect_timeout_s)
            server_nonce = P.decode_hello(recv_exact(sock, P.HELLO.size, cfg.progress_timeout_s, hs_deadline))
            client_nonce = P.new_nonce()
            send_all(sock, P.encode_proof(client_nonce, P.client_proof(self.secret, server_nonce, client_nonce)),
                     cfg.progress_timeout_s, hs_deadline)
            try:
                accept = recv_exact(sock, P.ACCEPT.size, cfg.progress_timeout_s, hs_deadline)
            except ConnectionError:
                raise AuthenticationError(f"{peer.address} closed the control connection during authentication "
                                          "(wrong shared secret?)") from None
            P.decode_accept(accept, self.secret, server_nonce, client_nonce)
            peer.sock = sock
            peer.cq = self._v.cq.CQ(self._ctx, self.rdma_config.cq_entries)
            peer.qp = self._new_qp(peer.cq)
            self._sync_mrs()
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
        self._sync_mrs()
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
                if peer.qp is not None and not _alive(peer.sock):
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
            if peer.qp is not None and not _alive(peer.sock):
                log.info("the control connection to %s closed; reconnecting its queue pair", peer.address)
                self._drop(peer)
            if peer.qp is None:
                self._connect(peer, deadline)
            else:
                self._sync_mrs()
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
        if any(peer.remote.region(it.request.remote_region) is None for it in live):
            try:  # a region the peer registered after our last exchange
                self._refresh(peer, deadline)
            except Exception as err:
                self._drop(peer)
                for it in live:
                    it.finish(Outcome.FAILED, f"cannot refresh {peer.address}'s regions: {type(err).__name__}: {err}")
                return
        work: deque[tuple[int, Item, WorkDescriptor]] = deque()
        for pos, it in enumerate(live):
            req = it.request
            with self._mr_lock:
                m = self._mrs.get(req.local_region)
            remote = peer.remote.region(req.remote_region)
            try:
                if m is None:
                    raise RegionError(f"local region {req.local_region} has no memory region registered")
                if remote is None:
                    raise RegionError(f"{peer.address} has no memory region for region {req.remote_region}")
                work.append((pos, it, build_descriptor(it, m.key, remote)))
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


def _alive(sock: socket.socket | None) -> bool:
    """A non-blocking peek at a control socket: False when the peer closed it (or it broke)."""
    if sock is None:
        return False
    try:
        sock.settimeout(0.0)
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return False  # EOF, or bytes nobody asked for: the connection is out of step


def recv_exact(sock: socket.socket, n: int, progress_s: float, deadline: float | None = None,
               first_s: float | None = None) -> bytes:
    """``n`` bytes from a control socket; each wait bounded by ``progress_s`` (``first_s`` for the first
    byte) and by ``deadline``; ``socket.timeout`` past them, ``ConnectionError`` on EOF mid-way."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        sock.settimeout(_wait(first_s if (got == 0 and first_s is not None) else progress_s, deadline))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes, progress_s: float, deadline: float | None = None) -> None:
    sock.settimeout(_wait(progress_s, deadline))
    sock.sendall(data)  # control records are small


def _wait(seconds: float, deadline: float | None) -> float:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        seconds = min(seconds, left)
    return seconds


def _close_quietly(obj: object) -> None:
    if obj is None:
        return
    try:
        obj.close()  # type: ignore[attr-defined]
    except Exception as err:
        log.debug("closing %s failed: %s", type(obj).__name__, err)
