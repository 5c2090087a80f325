"""pyverbs for the ``rdma`` backend: finding it and a device (``probe``), and every piece of a one-sided
transfer that needs no device — access flags, descriptor building, the ``SendWR`` and the RTS
``QPAttr`` — so they are tested here even though no RDMA device is (``tests/test_transfer_rdma.py``).

Invariants:
- ``probe`` never raises; when RDMA cannot run, ``reason`` says exactly why: ``"pyverbs not
  importable: …"``, ``"no RDMA device: get_device_list() returned []"``, ``"no RDMA device:
  get_device_list() raised …"`` (this is what Debian's pyverbs does on a kernel without RDMA
  drivers), or ``"no RDMA device named …"``.
- ``load_pyverbs`` imports pyverbs from ``sys.path`` or else from Debian's dist-packages, taking
  that folder off ``sys.path`` again; the enum module is ``pyverbs.libibverbs_enums`` (rdma-core
  ≥ v50) or ``pyverbs.enums`` (≤ v58), whichever imports.
- ``build_descriptor`` is pure: an item and the two MRs' keys → ``(op, local addr, length, lkey,
  remote addr, rkey)``, or ``RegionError`` when a range leaves its MR, a direction meets a
  read-only region, or one work request would pass ``MAX_MESSAGE_BYTES``.
- ``MrTable`` mirrors a ``RegionTable`` as MRs (``MR(pd, length, access, address=<the buffer's
  address>)``; writable regions LOCAL_WRITE | REMOTE_READ | REMOTE_WRITE, read-only ones REMOTE_READ
  only, since a LOCAL_WRITE registration would pin read-only pages for writing). ``sync`` registers
  new regions and deregisters vanished ones; the table's ``unregister`` is wrapped on that
  instance so a region's MR is deregistered — its rkey revoked — BEFORE the region is forgotten,
  and no peer can then write into a buffer its owner believes is free. While that ``unregister``
  waits for the region's in-flight users the region is RETIRING: ``sync`` (a peer's key refresh, a
  local transfer) does not register it again, so no new rkey for it reaches a peer; if the wait
  fails (the region stays registered) it stops retiring and the next ``sync`` registers it again.
  Each MR keeps its own view of the buffer, so the pinned memory stays alive as long as the MR.
- pyverbs names used are those of rdma-core v44 (Debian bookworm) through v59: ``Context(name=)``,
  ``PD``, ``CQ(ctx, cqe)``, ``MR(pd, length, access, address=)``, ``QP(pd, QPInitAttr, QPAttr)``,
  ``QPCap``, ``QPAttr``, ``AHAttr``/``GlobalRoute``/``GID``, ``SGE``, ``SendWR`` + ``set_wr_rdma``,
  ``qp.to_rts``, ``qp.modify``, ``cq.poll``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import numpy as np

from quillcache.transfer.backends.tcp_client import parse_address
from quillcache.transfer.batch import Item
from quillcache.transfer.rdma_info import ZERO_GID, QpInfo, RegionKey, gid_to_str
from quillcache.transfer.regions import RegionTable
from quillcache.transfer.types import Op, RegionError, TransferRequest

__all__ = [
    "DIST_PACKAGES",
    "MAX_MESSAGE_BYTES",
    "WC_SUCCESS",
    "LocalKey",
    "MrTable",
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


# ---- the MRs of a region table ----------------------------------------------------------------------------------

@dataclass(eq=False)
class _Mr:
    mr: object
    view: memoryview  # keeps the buffer alive while the MR pins it
    key: LocalKey
    rkey: int


class MrTable:
    """The MRs mirroring one ``RegionTable`` in one protection domain (thread-safe). ``_retiring`` counts, per
    region id, the wrapped ``unregister`` calls in progress; ``sync`` registers no MR for such a region."""

    def __init__(self, verbs: SimpleNamespace, pd: object, regions: RegionTable) -> None:
        self._v, self._pd, self._regions = verbs, pd, regions
        self._mrs: dict[int, _Mr] = {}
        self._retiring: dict[int, int] = {}
        self._lock = threading.RLock()
        original = regions.unregister

        def unregister(region, *, timeout_s: float = 30.0) -> None:
            rid = getattr(region, "region_id", region)
            if type(rid) is not int:
                return original(region, timeout_s=timeout_s)  # raises, naming what is wrong with ``region``
            with self._lock:
                self._retiring[rid] = self._retiring.get(rid, 0) + 1  # before the MR goes: no sync brings it back
                try:
                    if rid in self._mrs:
                        self._dereg(rid)
                except BaseException:
                    self._unretire(rid)
                    raise
            try:
                original(region, timeout_s=timeout_s)
            finally:
                with self._lock:
                    self._unretire(rid)

        regions.unregister = unregister  # type: ignore[method-assign]
        self._wrapped = True
        try:
            self.sync()
        except BaseException:
            self.close()
            raise

    def _unretire(self, rid: object) -> None:
        n = self._retiring.pop(rid, 0) - 1
        if n > 0:
            self._retiring[rid] = n

    def _dereg(self, rid: int) -> None:
        m = self._mrs.pop(rid)
        try:
            m.mr.close()  # type: ignore[attr-defined]
        finally:
            m.view.release()

    def sync(self) -> None:
        """Register the table's new regions (not those being unregistered), deregister the ones it no longer has."""
        v = self._v
        with self._lock:
            current = {r.region_id: r for r in self._regions.describe()}
            for rid in [rid for rid in self._mrs if rid not in current]:
                self._dereg(rid)
            for rid, r in current.items():
                if rid in self._mrs or rid in self._retiring:
                    continue
                try:
                    view = self._regions.checkout(rid, 0, r.length_bytes, write=False)
                except RegionError:
                    continue  # unregistered in between
                try:
                    keep = view[:]  # our own view, held while the MR pins the pages
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

    def local(self, region_id: int) -> LocalKey | None:
        with self._lock:
            m = self._mrs.get(region_id)
            return None if m is None else m.key

    def keys(self) -> tuple[RegionKey, ...]:
        """What peers need: every region's address, length, rkey and writability."""
        with self._lock:
            return tuple(RegionKey(m.key.region_id, m.key.addr, m.key.length_bytes, m.rkey, m.key.writable)
                         for m in self._mrs.values())

    def close(self) -> None:
        """Deregister every MR and give the table its own ``unregister`` back; idempotent."""
        with self._lock:
            if self._wrapped:
                self._regions.__dict__.pop("unregister", None)
                self._wrapped = False
            for rid in list(self._mrs):
                try:
                    self._dereg(rid)
                except Exception:
                    pass
