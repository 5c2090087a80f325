"""The ``rdma`` backend (issue 13, item 4): everything that can be tested without an RDMA device.

These machines have no RDMA device and cannot run SoftRoCE, so:

- ``probe`` is checked to answer available=False here with an exact reason and never raise (also
  with pyverbs missing, ``get_device_list`` raising, returning ``[]``, or lacking the named device);
  ``TransferEngine("rdma", ...)`` fails with that reason and leaves no thread behind.
- The pure pieces: descriptor building (Hypothesis: addresses are the MR bases plus the offsets,
  every out-of-range, read-only or mismatched case is a ``RegionError``), the QP-information record
  (round trip; every malformed field, truncation, extension, random bytes and single-byte mutations
  raise ``ProtocolError`` or decode to a record that re-encodes to the same bytes), GIDs, addresses,
  completion-status names, the configuration's checks.
- With Debian's ``python3-pyverbs`` importable (from the venv through /usr/lib/python3/dist-packages),
  the verbs objects that need no device are built for real: the enum module found by the import
  guard, the access flags' ABI values, a signalled RDMA READ/WRITE ``SendWR`` with its SGE, the RTS
  ``QPAttr`` with ``qp_access_flags`` and the address vector (GRH or LID). Skipped when pyverbs is absent.
- The backend's own logic — MR registration, the authenticated control exchange over real sockets,
  QP bring-up calls, posting, polling, deadlines, the QP reset, rkey revocation on unregister,
  reconnect — runs against a FAKE verbs layer (``FakeVerbs``) that moves bytes with ``memmove``
  between the registered addresses and checks rkeys, lkeys, MR and QP access flags as a device would.
  It shows the logic is consistent; it says nothing about real hardware.
- ``test_real_device_*`` run only where ``probe()`` finds a device; here they are skipped with its reason.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import threading
import time
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.transfer import Op, Outcome, ProtocolError, RegionError, TransferEngine, TransferError, TransferRequest
from quillcache.transfer import rdma_verbs as V
from quillcache.transfer.backends import rdma as R
from quillcache.transfer.batch import Item
from quillcache.transfer.rdma_info import (
    HEADER,
    MAX_REGIONS,
    REGION,
    QpInfo,
    RegionKey,
    decode_qp_info,
    encode_qp_info,
    gid_from_str,
    gid_to_str,
    read_region_count,
)

SECRET = "quillcache-rdma-tests-secret-0123456789"
U24, U32, U64 = (1 << 24) - 1, (1 << 32) - 1, (1 << 64) - 1
PROBE = V.probe()


def _verbs_or_skip():
    try:
        return V.load_pyverbs()
    except ImportError as e:
        pytest.skip(f"pyverbs not importable here: {e}")


# ---- the probe and the engine constructor -----------------------------------------------------------------------

def test_probe_answers_without_raising_and_says_why():
    p = V.probe()
    assert isinstance(p, V.RdmaProbe)
    if p.available:
        assert p.devices
        return
    assert p.reason.startswith(("pyverbs not importable: ", "no RDMA device: ")), p.reason
    assert p.devices == ()


def test_probe_here_finds_no_device():
    if PROBE.available:
        pytest.skip(f"this machine has an RDMA device: {PROBE.reason}")
    assert not PROBE.available and PROBE.reason


def test_engine_constructor_fails_with_the_probe_reason_and_leaves_nothing_running():
    if PROBE.available:
        pytest.skip(f"this machine has an RDMA device: {PROBE.reason}")
    before = set(threading.enumerate())
    with pytest.raises(TransferError, match=re.escape(PROBE.reason)):
        TransferEngine("rdma", secret=SECRET)
    time.sleep(0.05)
    assert set(threading.enumerate()) - before == set()


def _fake_loader(devices=None, list_error=None):
    def get_device_list():
        if list_error is not None:
            raise list_error
        return [SimpleNamespace(name=n) for n in devices]
    return lambda: SimpleNamespace(device=SimpleNamespace(get_device_list=get_device_list), version="9.9",
                                   enums_module="pyverbs.libibverbs_enums")


def test_probe_reasons_are_exact(monkeypatch):
    def missing():
        raise ImportError("No module named 'pyverbs'")
    monkeypatch.setattr(V, "load_pyverbs", missing)
    assert V.probe() == V.RdmaProbe(False, "pyverbs not importable: ImportError: No module named 'pyverbs'")

    monkeypatch.setattr(V, "load_pyverbs", _fake_loader(devices=[]))
    assert V.probe() == V.RdmaProbe(False, "no RDMA device: get_device_list() returned []", (), "9.9")

    monkeypatch.setattr(V, "load_pyverbs", _fake_loader(list_error=OSError("boom")))
    p = V.probe()
    assert not p.available and p.reason.startswith("no RDMA device: get_device_list() raised OSError: boom")

    monkeypatch.setattr(V, "load_pyverbs", _fake_loader(devices=[b"mlx5_0", b"mlx5_1"]))
    assert V.probe() == V.RdmaProbe(True, "RDMA devices ['mlx5_0', 'mlx5_1'] through pyverbs "
                                          "(pyverbs.libibverbs_enums)", ("mlx5_0", "mlx5_1"), "9.9")
    assert V.probe("mlx5_1").available
    assert V.probe("rxe0") == V.RdmaProbe(False, "no RDMA device named 'rxe0': get_device_list() returned "
                                                 "['mlx5_0', 'mlx5_1']", ("mlx5_0", "mlx5_1"), "9.9")

    def weird():
        raise RuntimeError("ABI mismatch")
    monkeypatch.setattr(V, "load_pyverbs", weird)
    assert V.probe().reason == "pyverbs not importable: RuntimeError: ABI mismatch"


# ---- descriptors ------------------------------------------------------------------------------------------------

LOCAL = V.LocalKey(region_id=3, addr=0x7F00_0000_0000, length_bytes=1 << 20, lkey=0x1234)
REMOTE = RegionKey(region_id=9, addr=0x5500_0000_1000, length_bytes=1 << 21, rkey=0xABCD)


def _req(op=Op.READ, lo=0, ro=0, n=4096, lr=3, rr=9) -> TransferRequest:
    return TransferRequest(op, lr, lo, 1, rr, ro, n)


@given(op=st.sampled_from(list(Op)), lo=st.integers(0, (1 << 20) - 1), ro=st.integers(0, (1 << 21) - 1),
       n=st.integers(1, 1 << 20))
def test_descriptor_is_the_mr_bases_plus_the_offsets(op, lo, ro, n):
    req = _req(op, lo, ro, n)
    fits = lo + n <= LOCAL.length_bytes and ro + n <= REMOTE.length_bytes
    if not fits:
        with pytest.raises(RegionError, match="lies outside region"):
            V.build_descriptor(req, LOCAL, REMOTE)
        return
    d = V.build_descriptor(req, LOCAL, REMOTE)
    assert d == V.WorkDescriptor(op, LOCAL.addr + lo, n, LOCAL.lkey, REMOTE.addr + ro, REMOTE.rkey)


def test_descriptor_takes_an_item_too():
    req = _req(Op.WRITE, 100, 200, 300)
    item = Item(None, 0, req, memoryview(bytearray(300)), time.monotonic() + 1)  # type: ignore[arg-type]
    assert V.build_descriptor(item, LOCAL, REMOTE) == V.build_descriptor(req, LOCAL, REMOTE)


@pytest.mark.parametrize("req, local, remote, match", [
    (_req(lr=4), LOCAL, REMOTE, "local key is for region 3"),
    (_req(rr=8), LOCAL, REMOTE, "remote key is for region 9"),
    (_req(lo=(1 << 20) - 10, n=11), LOCAL, REMOTE, r"local range \[1048566, 1048577\)"),
    (_req(ro=(1 << 21), n=1), LOCAL, REMOTE, r"remote range \[2097152, 2097153\)"),
    (_req(Op.READ), V.LocalKey(3, 0x1000, 1 << 20, 1, writable=False), REMOTE, "READ into read-only local"),
    (_req(Op.WRITE), LOCAL, RegionKey(9, 0x1000, 1 << 21, 1, writable=False), "WRITE to read-only remote"),
    (_req(n=V.MAX_MESSAGE_BYTES + 1), V.LocalKey(3, 0x1000, 1 << 40, 1), RegionKey(9, 0x1000, 1 << 40, 1),
     "in one RDMA work request"),
])
def test_descriptor_refuses(req, local, remote, match):
    with pytest.raises(RegionError, match=match):
        V.build_descriptor(req, local, remote)


def test_read_only_directions_that_are_allowed():
    ro_local = V.LocalKey(3, 0x1000, 1 << 20, 1, writable=False)
    ro_remote = RegionKey(9, 0x1000, 1 << 21, 1, writable=False)
    assert V.build_descriptor(_req(Op.WRITE), ro_local, REMOTE).op is Op.WRITE  # the HCA only reads it
    assert V.build_descriptor(_req(Op.READ), LOCAL, ro_remote).op is Op.READ


# ---- the QP-information record -------------------------------------------------------------------------------------

region_keys = st.builds(RegionKey, region_id=st.integers(0, U32), addr=st.integers(1, 1 << 62),
                        length_bytes=st.integers(1, 1 << 40), rkey=st.integers(0, U32), writable=st.booleans())
qp_infos = st.builds(QpInfo, qp_num=st.integers(2, U24), psn=st.integers(0, U24), lid=st.integers(0, 0xFFFF),
                     gid=st.binary(min_size=16, max_size=16), mtu=st.integers(1, 5),
                     regions=st.lists(region_keys, max_size=8, unique_by=lambda r: r.region_id).map(tuple))


@given(qp_infos)
def test_record_round_trips(info):
    data = encode_qp_info(info)
    assert len(data) == HEADER.size + REGION.size * len(info.regions)
    assert read_region_count(data[:HEADER.size]) == len(info.regions)
    assert decode_qp_info(data) == info
    for r in info.regions:
        assert info.region(r.region_id) == r


def _record(**kw) -> bytes:
    base = dict(qp_num=77, psn=5, lid=1, gid=bytes(range(16)), mtu=5,
                regions=(RegionKey(1, 0x1000, 4096, 0x11), RegionKey(2, 0x9000, 8192, 0x22, False)))
    base.update(kw)
    return encode_qp_info(QpInfo(**base))


def _patch_header(data: bytes, **fields) -> bytes:
    names = ["magic", "version", "mtu", "lid", "qp_num", "psn", "gid", "count", "reserved"]
    vals = dict(zip(names, HEADER.unpack_from(data)))
    vals.update(fields)
    return HEADER.pack(*[vals[n] for n in names]) + data[HEADER.size:]


def _patch_region(data: bytes, i: int, **fields) -> bytes:
    names = ["region_id", "flags", "addr", "length", "rkey", "reserved"]
    off = HEADER.size + i * REGION.size
    vals = dict(zip(names, REGION.unpack_from(data, off)))
    vals.update(fields)
    return data[:off] + REGION.pack(*[vals[n] for n in names]) + data[off + REGION.size:]


GOOD = _record()


@pytest.mark.parametrize("data, match", [
    (GOOD[:HEADER.size - 1], "shorter than its 36-byte header"),
    (GOOD[:-1], "a record with 2 regions is 100"),
    (GOOD + b"\0", "a record with 2 regions is 100"),
    (_patch_header(GOOD, magic=b"QCTR"), "bad QP info magic"),
    (_patch_header(GOOD, version=2), "unsupported QP info version 2"),
    (_patch_header(GOOD, mtu=0), "MTU code 0"),
    (_patch_header(GOOD, mtu=6), "MTU code 6"),
    (_patch_header(GOOD, qp_num=0), "QP number 0"),
    (_patch_header(GOOD, qp_num=1), "QP number 1"),
    (_patch_header(GOOD, qp_num=1 << 24), "QP number 16777216"),
    (_patch_header(GOOD, psn=1 << 24), "PSN 16777216"),
    (_patch_header(GOOD, reserved=1), "reserved header bits"),
    (_patch_header(GOOD, count=3), "a record with 3 regions is 132"),
    (_patch_region(GOOD, 1, reserved=7), "region 2 sets reserved bits"),
    (_patch_region(GOOD, 0, flags=2), "region 1 has unknown flags"),
    (_patch_region(GOOD, 0, length=0), "region 1 has length 0"),
    (_patch_region(GOOD, 0, addr=0), "region 1 at address 0"),
    (_patch_region(GOOD, 0, addr=U64 - 10), "does not fit in 64 bits"),
    (_patch_region(GOOD, 1, region_id=1), "region 1 listed twice"),
])
def test_malformed_records_raise_protocol_error(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode_qp_info(data)


def test_region_count_is_bounded_before_anything_is_read():
    data = encode_qp_info(QpInfo(5, 0, 0, bytes(16), 3, tuple(RegionKey(i, 4096, 1, i) for i in range(10))))
    assert read_region_count(data[:HEADER.size], max_regions=10) == 10
    with pytest.raises(ProtocolError, match="lists 10 regions, more than the 9 allowed"):
        read_region_count(data[:HEADER.size], max_regions=9)
    with pytest.raises(ProtocolError, match="more than the 9 allowed"):
        decode_qp_info(data, max_regions=9)
    with pytest.raises(ProtocolError, match="header is 35 bytes"):
        read_region_count(data[:HEADER.size - 1])


@pytest.mark.parametrize("info, match", [
    (QpInfo(1, 0, 0, bytes(16), 5), "QP number 1"),
    (QpInfo(5, -1, 0, bytes(16), 5), "PSN -1"),
    (QpInfo(5, 0, 1 << 16, bytes(16), 5), "LID 65536"),
    (QpInfo(5, 0, 0, bytes(15), 5), "GID must be 16 bytes"),
    (QpInfo(5, 0, 0, bytes(16), 7), "MTU code 7"),
    (QpInfo(5, 0, 0, bytes(16), 5, (RegionKey(1, 4096, 1, 1 << 32),)), "rkey 4294967296"),
    (QpInfo(5, 0, 0, bytes(16), 5, (RegionKey(1 << 32, 4096, 1, 1),)), "region id 4294967296"),
    (QpInfo(5, 0, 0, bytes(16), 5, (RegionKey(1, 4096, 1, 1), RegionKey(1, 8192, 1, 1))), "listed twice"),
    (QpInfo(5, 0, 0, bytes(16), 5, (RegionKey(1, 4096, 1, 1),) * (MAX_REGIONS + 1)), "exceed the record's limit"),
    ("not a QpInfo", "takes a QpInfo"),
])
def test_encode_refuses_out_of_range_fields(info, match):
    with pytest.raises(ProtocolError, match=match):
        encode_qp_info(info)


@given(st.binary(max_size=200))
def test_random_bytes_decode_to_a_record_or_protocol_error(data):
    try:
        info = decode_qp_info(data)
    except ProtocolError:
        return
    assert encode_qp_info(info) == data


@given(qp_infos, st.data())
def test_single_byte_mutations_never_escape_protocol_error(info, data):
    raw = bytearray(encode_qp_info(info))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] = data.draw(st.integers(0, 255))
    try:
        decoded = decode_qp_info(bytes(raw))
    except ProtocolError:
        return
    assert encode_qp_info(decoded) == bytes(raw)  # anything accepted is canonical


@given(st.binary(min_size=16, max_size=16))
def test_gid_text_round_trips(gid):
    text = gid_to_str(gid)
    assert re.fullmatch(r"[0-9a-f]{4}(:[0-9a-f]{4}){7}", text)
    assert gid_from_str(text) == gid


@pytest.mark.parametrize("text", ["", "fe80::1", "fe80:0000:0000:0000:0000:0000:0000", "zz80:" + "0000:" * 6 + "0001",
                                  " e80:" + "0000:" * 6 + "0001", None])
def test_bad_gid_text_is_a_value_error(text):
    with pytest.raises(ValueError):
        gid_from_str(text)  # type: ignore[arg-type]


# ---- small helpers ------------------------------------------------------------------------------------------------

def test_addresses_round_trip_and_bad_ones_are_refused():
    assert V.parse_rdma_address(V.format_rdma_address("10.0.0.1", 7000, 7001)) == ("10.0.0.1", 7000, 7001)
    assert V.parse_rdma_address(V.format_rdma_address("::1", 7000, 7001)) == ("::1", 7000, 7001)
    for bad in ["10.0.0.1:7000", "rdma://10.0.0.1:7000", "rdma://10.0.0.1:7000/0", "rdma://10.0.0.1/7001",
                "rdma://10.0.0.1:7000/x", 7]:
        with pytest.raises((ValueError, TypeError)):
            V.parse_rdma_address(bad)  # type: ignore[arg-type]


def test_buffer_address_is_the_first_byte_for_writable_and_read_only_buffers():
    buf = bytearray(b"x" * 64)
    assert V.buffer_address(memoryview(buf)) == ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert V.buffer_address(memoryview(buf)[8:]) == ctypes.addressof(ctypes.c_char.from_buffer(buf)) + 8
    ro = bytes(64)
    assert V.buffer_address(memoryview(ro)) == ctypes.cast(ctypes.c_char_p(ro), ctypes.c_void_p).value
    memoryview(buf).release()
    buf.extend(b"y")  # no export left behind


def test_completion_status_names():
    assert V.wc_status_name(0) == "IBV_WC_SUCCESS"
    assert V.wc_status_name(5) == "IBV_WC_WR_FLUSH_ERR"
    assert V.wc_status_name(10) == "IBV_WC_REM_ACCESS_ERR"
    assert V.wc_status_name(12) == "IBV_WC_RETRY_EXC_ERR"
    assert V.wc_status_name(99) == "unknown completion status 99"


@pytest.mark.parametrize("kw, match", [
    (dict(max_send_wr=0), "max_send_wr"), (dict(cq_entries=8, max_send_wr=16), "at least max_send_wr"),
    (dict(retry_cnt=8), "retry_cnt"), (dict(ack_timeout=32), "ack_timeout"), (dict(drain_timeout_s=-1), "drain"),
    (dict(max_rd_atomic=True), "max_rd_atomic"),
])
def test_config_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        V.RdmaConfig(**kw)


def test_backend_constructor_checks_its_options():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        R.RdmaBackend(secret="short")
    with pytest.raises(ValueError, match="port must be"):
        R.RdmaBackend(secret=SECRET, port=0)
    with pytest.raises(ValueError, match="device must be"):
        R.RdmaBackend(secret=SECRET, device="")
    with pytest.raises(TypeError, match="rdma_config must be"):
        R.RdmaBackend(secret=SECRET, rdma_config=object())  # type: ignore[arg-type]


# ---- real pyverbs objects that need no device ------------------------------------------------------------------

def test_pyverbs_enums_and_access_flags_have_their_abi_values():
    v = _verbs_or_skip()
    e = v.e
    assert v.enums_module in ("pyverbs.libibverbs_enums", "pyverbs.enums")
    assert V.mr_access(e, True) == 1 | 2 | 4  # LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ
    assert V.mr_access(e, False) == 4  # REMOTE_READ
    assert V.qp_access(e) == 7
    assert (V.wr_opcode(e, Op.WRITE), V.wr_opcode(e, Op.READ)) == (0, 4)  # IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ
    assert (e.IBV_QPT_RC, e.IBV_SEND_SIGNALED, e.IBV_QPS_ERR, e.IBV_QP_STATE, e.IBV_PORT_ACTIVE) == (2, 2, 6, 1, 4)
    for i, name in enumerate(V._WC_STATUS):
        if hasattr(e, f"IBV_WC_{name}"):
            assert getattr(e, f"IBV_WC_{name}") == i, name
            assert V.wc_status_name(i) == f"IBV_WC_{name}"


@pytest.mark.parametrize("op", list(Op))
def test_pyverbs_send_wr_is_a_signalled_rdma_request(op):
    v = _verbs_or_skip()
    d = V.build_descriptor(_req(op, 64, 128, 4096), LOCAL, REMOTE)
    wr = V.make_send_wr(v, d, 17)
    try:
        assert (wr.wr_id, wr.num_sge) == (17, 1)
        assert wr.opcode == (v.e.IBV_WR_RDMA_READ if op is Op.READ else v.e.IBV_WR_RDMA_WRITE)
        assert wr.send_flags == v.e.IBV_SEND_SIGNALED
    finally:
        wr.close()


@pytest.mark.parametrize("remote_gid", [bytes.fromhex("fe80000000000000021122fffe334455"), bytes(16)])
def test_pyverbs_rts_attr_sets_access_flags_psns_mtu_and_route(remote_gid):
    v = _verbs_or_skip()
    cfg = V.RdmaConfig(max_rd_atomic=8)
    local = QpInfo(100, 11, 1, bytes.fromhex("fe800000000000000000000000000001"), 5)
    remote = QpInfo(200, 22, 9, remote_gid, 3)
    a = V.rts_attr(v, port_num=1, gid_index=3, local=local, remote=remote, config=cfg)
    assert a.qp_access_flags == V.qp_access(v.e) != 0
    assert (a.dest_qp_num, a.rq_psn, a.sq_psn, a.path_mtu) == (200, 22, 11, 3)
    assert (a.max_rd_atomic, a.max_dest_rd_atomic, a.retry_cnt, a.rnr_retry) == (8, 8, 7, 7)
    ah = a.ah_attr
    assert (ah.dlid, ah.port_num) == (9, 1)
    if remote_gid != bytes(16):
        assert ah.is_global == 1 and ah.dgid == gid_to_str(remote_gid) and ah.sgid_index == 3
    else:
        assert ah.is_global == 0


def test_pyverbs_qp_attr_for_the_error_state():
    v = _verbs_or_skip()
    assert v.qp.QPAttr(qp_state=v.e.IBV_QPS_ERR).qp_state == v.e.IBV_QPS_ERR


# ---- the backend's logic against a fake verbs layer -----------------------------------------------------------------

class FakeVerbs:
    """Enough of pyverbs for ``RdmaBackend``: MRs are real addresses, ``post_send`` moves bytes with memmove.

    It checks what hardware checks: the lkey covers the local range, the rkey exists (not deregistered)
    and covers the remote range with REMOTE_READ/REMOTE_WRITE, and the target QP was created with
    ``qp_access_flags`` allowing the access (0 refuses everything, as ibverbs' default does).
    ``stall`` holds completions back (the timeout path); a QP moved to ERROR flushes them.
    """

    IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4
    IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED = 0, 4, 2
    IBV_QPT_RC, IBV_QPS_INIT, IBV_QPS_RTS, IBV_QPS_ERR, IBV_QP_STATE, IBV_PORT_ACTIVE = 2, 1, 3, 6, 1, 4

    def __init__(self) -> None:
        self.mrs: dict[int, tuple[int, int, int]] = {}
        self.qps: dict[int, object] = {}
        self.keys = itertools.count(0x100)
        self.qp_nums = itertools.count(0x40)
        self.stall = False
        self.posted = 0
        self.rts = 0
        fv = self

        class Err(Exception):
            pass

        class Context:
            def __init__(self, name):
                self.name = name

            def query_port(self, port):
                return SimpleNamespace(state=4, lid=7, active_mtu=5)

            def query_gid(self, port, index):
                return SimpleNamespace(gid="fe80:0000:0000:0000:0000:0000:0000:0001")

            def close(self):
                pass

        class PD:
            def __init__(self, ctx):
                pass

            def close(self):
                pass

        class CQ:
            def __init__(self, ctx, cqe):
                self.q: deque = deque()

            def poll(self, num_entries=1):
                out = []
                while self.q and len(out) < num_entries:
                    out.append(self.q.popleft())
                return len(out), out

            def close(self):
                pass

        class MR:
            def __init__(self, pd, length, access, address=None):
                self.lkey = self.rkey = next(fv.keys)
                fv.mrs[self.rkey] = (address, length, access)

            def close(self):
                fv.mrs.pop(self.rkey, None)

        class QPAttr:
            def __init__(self, qp_state=None, port_num=1):
                self.qp_state, self.port_num, self.qp_access_flags = qp_state, port_num, 0

        class QP:
            def __init__(self, pd, init, attr):
                assert init.qp_type == fv.IBV_QPT_RC
                self.qp_num = next(fv.qp_nums)
                self.cq, self.access, self.state, self.stalled = init.scq, attr.qp_access_flags, 1, []
                fv.qps[self.qp_num] = self

            def to_rts(self, attr):
                self.dest, self.state = attr.dest_qp_num, fv.IBV_QPS_RTS
                fv.rts += 1

            def modify(self, attr, mask):
                assert mask == fv.IBV_QP_STATE
                self.state = attr.qp_state
                for wr_id in self.stalled:
                    self.cq.q.append(SimpleNamespace(wr_id=wr_id, status=5, vendor_err=0))
                self.stalled = []

            def post_send(self, wr):
                if self.state != fv.IBV_QPS_RTS:
                    raise Err("QP not in RTS")
                fv.posted += 1
                if fv.stall:
                    self.stalled.append(wr.wr_id)
                    return
                self.cq.q.append(SimpleNamespace(wr_id=wr.wr_id, status=fv._move(self, wr), vendor_err=0))

            def close(self):
                fv.qps.pop(self.qp_num, None)

        class SGE:
            def __init__(self, addr, length, lkey):
                self.addr, self.length, self.lkey = addr, length, lkey

        class SendWR:
            def __init__(self, wr_id=0, opcode=0, num_sge=0, sg=None, send_flags=0):
                assert num_sge == 1 and send_flags == fv.IBV_SEND_SIGNALED
                self.wr_id, self.opcode, self.sge = wr_id, opcode, sg[0]

            def set_wr_rdma(self, rkey, addr):
                self.rkey, self.raddr = rkey, addr

            def close(self):
                pass

        self.e = self
        self.errors = SimpleNamespace(PyverbsError=Err)
        self.device = SimpleNamespace(Context=Context, get_device_list=lambda: [SimpleNamespace(name=b"fake0")])
        self.pd = SimpleNamespace(PD=PD)
        self.cq = SimpleNamespace(CQ=CQ)
        self.mr = SimpleNamespace(MR=MR)
        self.qp = SimpleNamespace(QP=QP, QPAttr=QPAttr, QPCap=lambda **kw: kw,
                                  QPInitAttr=lambda qp_type, scq, rcq, cap, sq_sig_all: SimpleNamespace(
                                      qp_type=qp_type, scq=scq))
        self.wr = SimpleNamespace(SGE=SGE, SendWR=SendWR)
        self.addr = SimpleNamespace(GID=lambda v: v, GlobalRoute=lambda **kw: kw, AHAttr=lambda **kw: kw)
        self.version, self.enums_module = "fake", "fake"

    def _covers(self, key: int, addr: int, n: int, need: int) -> bool:
        mr = self.mrs.get(key)
        return mr is not None and mr[0] <= addr and addr + n <= mr[0] + mr[1] and (mr[2] & need) == need

    def _move(self, qp, wr) -> int:
        target = self.qps.get(qp.dest)
        read = wr.opcode == self.IBV_WR_RDMA_READ
        need = self.IBV_ACCESS_REMOTE_READ if read else self.IBV_ACCESS_REMOTE_WRITE
        if target is None or not (target.access & need) or not self._covers(wr.rkey, wr.raddr, wr.sge.length, need):
            return 10  # IBV_WC_REM_ACCESS_ERR
        if not self._covers(wr.sge.lkey, wr.sge.addr, wr.sge.length, self.IBV_ACCESS_LOCAL_WRITE if read else 0):
            return 8  # IBV_WC_LOC_ACCESS_ERR
        src, dst = (wr.raddr, wr.sge.addr) if read else (wr.sge.addr, wr.raddr)
        ctypes.memmove(dst, src, wr.sge.length)
        return 0


@pytest.fixture
def fake(monkeypatch):
    fv = FakeVerbs()
    monkeypatch.setattr(R, "load_pyverbs", lambda: fv)
    monkeypatch.setattr(R, "probe", lambda device=None: V.RdmaProbe(True, "fake", ("fake0",), "fake"))
    before = set(threading.enumerate())
    engines: list[TransferEngine] = []

    def make(**kw):
        eng = TransferEngine("rdma", secret=kw.pop("secret", SECRET),
                             rdma_config=V.RdmaConfig(drain_timeout_s=0.2, max_send_wr=8, cq_entries=8), **kw)
        engines.append(eng)
        return eng
    fv.make = make
    yield fv
    for eng in engines:
        eng.close()
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) - before == set()
    assert fv.mrs == {} and fv.qps == {}  # every MR and QP released


def test_fake_device_reads_and_writes_land_in_the_registered_buffers(fake):
    a, b = fake.make(), fake.make()
    assert a.address.startswith("rdma://127.0.0.1:")
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    la = a.register_region(dst, name="la")
    rb = b.register_region(src, name="rb")
    seg = a.open_segment(b.address)
    assert seg.by_name("rb").region_id == rb.region_id and fake.rts == 2  # one QP each side, both at RTS
    reqs = [TransferRequest(Op.READ, la.region_id, i * 4096, seg.segment_id, rb.region_id, (255 - i) * 4096, 4096)
            for i in range(20)]  # more than max_send_wr=8: posted in windows
    assert [s.outcome for s in a.transfer_sync(reqs)] == [Outcome.COMPLETED] * 20
    for i in range(20):
        assert np.array_equal(dst[i * 4096:(i + 1) * 4096], src[(255 - i) * 4096:(256 - i) * 4096])
    payload = np.arange(1000, dtype=np.uint8)
    dst[:1000] = payload
    a.write(la, 0, seg, rb.region_id, 5000, 1000)
    assert np.array_equal(src[5000:6000], payload)


def test_fake_device_refuses_bad_directions_before_posting(fake):
    a, b = fake.make(), fake.make()
    la = a.register_region(bytes(4096), name="ro-local")
    rb = b.register_region(bytearray(4096), name="rw")
    seg = a.open_segment(b.address)
    (st,) = a.transfer_sync([TransferRequest(Op.READ, la.region_id, 0, seg.segment_id, rb.region_id, 0, 10)])
    assert st.outcome is Outcome.FAILED and "read-only" in st.reason
    assert fake.posted == 0


def test_fake_device_regions_registered_later_are_learned_and_unregistered_ones_revoked(fake):
    a, b = fake.make(), fake.make()
    buf = bytearray(8192)
    la = a.register_region(buf)
    seg = a.open_segment(b.address)
    late = bytearray(b"L" * 4096)
    rl = b.register_region(late, name="late")
    seg = a.open_segment(b.address)  # the engine learns the region; the backend refreshes its rkey
    a.read(la, 0, seg, rl.region_id, 0, 4096)
    assert bytes(buf[:4096]) == bytes(late)
    b.unregister_region(rl)  # its MR goes first: the rkey is revoked before the buffer is forgotten
    (st,) = a.transfer_sync([TransferRequest(Op.WRITE, la.region_id, 0, seg.segment_id, rl.region_id, 0, 16)])
    assert st.outcome is Outcome.FAILED
    assert "IBV_WC_REM_ACCESS_ERR" in st.reason or "no memory region" in st.reason
    assert bytes(late) == b"L" * 4096  # nothing written into the unregistered buffer


def test_fake_device_timeout_resets_the_qp_and_the_next_transfer_reconnects(fake):
    a, b = fake.make(), fake.make()
    buf, rbuf = bytearray(4096), bytearray(b"R" * 4096)
    la, rb = a.register_region(buf), b.register_region(rbuf)
    seg = a.open_segment(b.address)
    fake.stall = True
    t0 = time.monotonic()
    sts = a.transfer_sync([TransferRequest(Op.READ, la.region_id, 0, seg.segment_id, rb.region_id, 0, 64)] * 3,
                          timeout_s=0.3)
    assert [s.outcome for s in sts] == [Outcome.TIMEOUT] * 3
    assert all("queue pair was reset" in s.reason for s in sts)
    assert time.monotonic() - t0 < 2
    fake.stall = False
    a.read(la, 0, seg, rb.region_id, 0, 4096)  # a fresh QP pair (the old ones are gone)
    assert bytes(buf) == bytes(rbuf)
    assert fake.rts == 4


def test_fake_device_a_peer_restart_is_survived(fake):
    a, b = fake.make(), fake.make()
    buf = bytearray(4096)
    la = a.register_region(buf)
    b.register_region(bytearray(b"1" * 4096))
    seg = a.open_segment(b.address)
    a.read(la, 0, seg, 1, 0, 10)
    b.close()  # the serving side goes away: its control connection closes, its QP is destroyed
    (st,) = a.transfer_sync([TransferRequest(Op.READ, la.region_id, 0, seg.segment_id, 1, 0, 10)], timeout_s=2)
    assert st.outcome is Outcome.FAILED  # nobody there; the failure is a reason, not a hang
    c = fake.make()
    c.register_region(bytearray(b"2" * 4096))
    seg2 = a.open_segment(c.address)
    a.read(la, 0, seg2, 1, 0, 10)
    assert bytes(buf[:10]) == b"2" * 10


def test_fake_device_wrong_secret_is_refused(fake):
    a, b = fake.make(), fake.make(secret="another-secret-0123456789abcdef")
    with pytest.raises(TransferError):
        a.open_segment(b.address)


# ---- real hardware only ------------------------------------------------------------------------------------------

@pytest.fixture
def device_pair():
    if not PROBE.available:
        pytest.skip(PROBE.reason)
    a, b = TransferEngine("rdma", secret=SECRET), TransferEngine("rdma", secret=SECRET)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_real_device_read_and_write_verified(device_pair):
    a, b = device_pair
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 4 << 20, dtype=np.uint8)
    dst = np.zeros(4 << 20, dtype=np.uint8)
    la, rb = a.register_region(dst), b.register_region(src)
    seg = a.open_segment(b.address)
    sizes = [1, 4096, 65536, 1 << 20]
    off = 0
    reqs = []
    for n in sizes:
        reqs.append(TransferRequest(Op.READ, la.region_id, off, seg.segment_id, rb.region_id, off, n))
        off += n
    assert [s.outcome for s in a.transfer_sync(reqs)] == [Outcome.COMPLETED] * len(sizes)
    assert np.array_equal(dst[:off], src[:off])
    dst[:off] = rng.integers(0, 256, off, dtype=np.uint8)
    a.write(la, 0, seg, rb.region_id, 0, off)
    assert np.array_equal(dst[:off], src[:off])


def test_real_device_unregistered_region_is_refused_by_the_hardware(device_pair):
    a, b = device_pair
    la = a.register_region(bytearray(4096))
    rb = b.register_region(bytearray(4096))
    seg = a.open_segment(b.address)
    b.unregister_region(rb)
    (st,) = a.transfer_sync([TransferRequest(Op.WRITE, la.region_id, 0, seg.segment_id, rb.region_id, 0, 16)],
                            timeout_s=5)
    assert st.outcome is Outcome.FAILED
