"""Stateful test: ``MasterService`` and the plain-Python model (``master_model.py``) driven with
the same operations — mounts/unmounts, puts (with pins and digests; single and in batches of several keys,
whose put_end reaches the residency index as one bulk ``put_columns``; and the columnar batch forms),
put_end/revoke, leased gets (plain, compact and columnar),
exists, removes, evictions, heartbeats and expiry, clock advances, and restarts (a clean close +
reopen, or a simulated power loss on ``CrashFs`` + reopen from snapshot and log) — and compared
after every step: outcomes (value or error code), objects (status, segments, put ids, leases),
segment usage, clients, the service's own invariants, and the residency index (every COMPLETE
object's replicas and nothing else; with ``defer_index_publish`` drawn on, once published). A power loss may
forget the put starts written since the last fsync (``MasterConfig.sync_put_start``): the recovered state must
then be the model's at one of the LSNs from the last fsynced one on, exactly."""

from __future__ import annotations

import copy
import math
import os
import random

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from master_model import ModelMaster
from quillcache.durability.crashfs import CrashFs
from quillcache.master import (
    MasterConfig, MasterError, MasterService, ObjectStatus, PinKind, PutRequest, ReplicaConfig, SegmentDescriptor,
    residency_key,
)
from quillcache.master.wire import expand_put_results, expand_replicas

UNIT = 64
NODES = ["a", "b", "c", "d"]
KEYS = [f"k{i}" for i in range(8)]
SEGS = list(range(6))
DATA_DIR = "/master"

node_ids = st.sampled_from(NODES)
keys = st.sampled_from(KEYS)
seg_ids = st.sampled_from(SEGS)
pins = st.sampled_from([PinKind.NONE, PinKind.NONE, PinKind.SOFT, PinKind.HARD])
digests = st.sampled_from([None, b"x", b"y"])
advances = st.sampled_from([0.5, 1.0, 3.0, 6.0, 6.0, 11.0, 31.0, 601.0, 1801.0])


def code(out):
    return out.code if isinstance(out, MasterError) else out


class MasterMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1), snap_every=st.sampled_from([3, 11, 1000]), defer=st.booleans())
    def start(self, seed: int, snap_every: int, defer: bool) -> None:
        self.now = 100.0
        self.rng = random.Random(seed)
        self.cfg = MasterConfig(alignment_bytes=UNIT, snapshot_every_records=snap_every, restart_budget_s=0.0,
                                index_kind="art", defer_index_publish=defer)
        self.fs = CrashFs()
        self.fs.mkdir(DATA_DIR)
        self.svc = MasterService(self.cfg, clock=lambda: self.now, data_dir=DATA_DIR, fs=self.fs)
        self.model = ModelMaster(unit=UNIT)
        self.models_at: dict[int, ModelMaster] = {}  # LSN -> the model then, from the last fsynced LSN on
        for seg, (node, units) in enumerate([("a", 3), ("b", 2), ("c", 2)]):
            self.mount(node, seg, units)

    def teardown(self) -> None:
        svc = getattr(self, "svc", None)
        if svc is not None:
            try:
                svc.close()
            except Exception:
                pass

    # ---------------------------------------------------------------- rules
    @rule(node=node_ids, seg=seg_ids, units=st.integers(1, 4))
    def mount(self, node: str, seg: int, units: int) -> None:
        exp = self.model.mount(self.now, node, seg, units)
        try:
            self.svc.mount_segment(SegmentDescriptor(node_id=node, segment_id=seg, capacity_bytes=units * UNIT,
                                                     endpoint=f"{node}:1", region_ids=(seg,)))
            got = None
        except MasterError as exc:
            got = exc.code
        assert got == exp

    @rule(seg=seg_ids)
    def unmount(self, seg: int) -> None:
        exp = self.model.unmount(self.now, seg)
        try:
            self.svc.unmount_segment(seg)
            got = None
        except MasterError as exc:
            got = exc.code
        assert got == exp

    @rule(key=keys, size=st.integers(1, UNIT), n=st.integers(1, 3), preferred=st.none() | seg_ids, pin=pins,
          digest=digests, compact=st.booleans())
    def put_start(self, key, size, n, preferred, pin, digest, compact=False) -> None:
        exp = self.model.put_start(self.now, key, size, n, preferred, int(pin), digest)
        try:
            if compact:  # the RPC's hot form, expanded as MasterClient does
                segs, rows = self.svc.batch_put_start_compact([[key, size, n, preferred, int(pin), digest]])
                r = expand_put_results(segs, rows)[0]
                if isinstance(r, MasterError):
                    raise r
            else:
                r = self.svc.put_start(key, size, ReplicaConfig(replica_num=n, preferred_segment=preferred), pin=pin,
                                       digest=digest)
            got = ([d.segment_id for d in r.replicas], r.put_id, r.existing)
            assert len({d.node_id for d in r.replicas}) == len(r.replicas)
            assert all(d.size_bytes == (size if not r.existing else d.size_bytes) for d in r.replicas)
        except MasterError as exc:
            got = exc.code
        assert got == exp, (got, exp)

    @rule(key=keys, size=st.integers(1, UNIT), n=st.integers(1, 3), pin=pins)
    def put(self, key, size, n, pin) -> None:
        """put_start + put_end (the common case), so objects accumulate."""
        self.put_start(key, size, n, None, pin, None)
        self.put_end(key, False, False)

    @rule(ks=st.lists(st.tuples(keys, st.integers(1, UNIT), st.integers(1, 3), st.none() | seg_ids, pins, digests),
                      min_size=2, max_size=8),
          compact=st.booleans(), end=st.booleans())
    def put_many(self, ks, compact, end) -> None:
        """The bulk paths: one batch_put_start (plain or compact) of several keys (repeats included, with mixed
        sizes, replica counts, preferred segments, pins and digests, so a batch meets its own puts, existing
        and zombie objects, and eviction in the middle), then one batch_put_end of them all (the index gets
        the whole batch in one put_columns)."""
        exp = [self.model.put_start(self.now, k, size, n, pref, int(pin), dg) for k, size, n, pref, pin, dg in ks]
        if compact:
            res = expand_put_results(*self.svc.batch_put_start_compact([[k, size, n, pref, int(pin), dg]
                                                                        for k, size, n, pref, pin, dg in ks]))
        else:
            res = self.svc.batch_put_start([PutRequest(key=k, size_bytes=size, pin=pin, digest=dg,
                                                       config=ReplicaConfig(replica_num=n, preferred_segment=pref))
                                            for k, size, n, pref, pin, dg in ks])
        got = [code(r) if isinstance(r, MasterError) else ([d.segment_id for d in r.replicas], r.put_id, r.existing)
               for r in res]
        assert got == exp, (got, exp)
        if end:
            names = [k for k, *_ in ks]
            exp_end = [self.model.put_end(self.now, k, None) for k in names]
            assert [code(x) for x in self.svc.batch_put_end(names)] == exp_end

    @rule(ks=st.lists(st.tuples(keys, st.integers(1, UNIT)), min_size=2, max_size=8), n=st.sampled_from([1, 1, 2]),
          pin=pins, end=st.booleans())
    def put_columns(self, ks, n, pin, end) -> None:
        """The columnar batch (``batch_put_start_columns``): with one replica, no preferred segment and no
        digest, distinct new keys that fit take the compiled path; the rest its reference."""
        exp = [self.model.put_start(self.now, k, size, n, None, int(pin), None) for k, size in ks]
        cols = self.svc.batch_put_start_columns([k for k, _ in ks], [size for _, size in ks], replica_num=n, pin=pin)
        cols.check()
        got = [code(r) if isinstance(r, MasterError) else ([d.segment_id for d in r.replicas], r.put_id, r.existing)
               for r in cols.to_list()]
        assert got == exp, (got, exp)
        if end:
            names = [k for k, _ in ks]
            exp_end = [self.model.put_end(self.now, k, None) for k in names]
            assert [code(x) for x in self.svc.batch_put_end(names)] == exp_end

    @rule(key=keys, with_id=st.booleans(), wrong_id=st.booleans())
    def put_end(self, key, with_id, wrong_id) -> None:
        obj = self.model.objects.get(key)
        put_id = None
        if with_id and obj is not None:
            put_id = obj.put_id + (1000 if wrong_id else 0)
        exp = self.model.put_end(self.now, key, put_id)
        assert code(self.svc.batch_put_end([key], put_ids=[put_id])[0]) == exp

    @rule(key=keys)
    def put_revoke(self, key) -> None:
        exp = self.model.put_revoke(self.now, key, None)
        assert code(self.svc.batch_put_revoke([key])[0]) == exp

    @rule(ks=st.lists(keys, max_size=4), form=st.sampled_from(["plain", "compact", "columns"]))
    def get(self, ks, form) -> None:
        exp = self.model.get(self.now, ks)
        out = (expand_replicas(*self.svc.get_replicas_compact(ks)) if form == "compact" else
               self.svc.get_replicas_columns(ks).to_list() if form == "columns" else self.svc.get_replicas(ks))
        got = [code(o) if isinstance(o, MasterError) else [d.segment_id for d in o] for o in out]
        assert got == exp

    @rule(ks=st.lists(keys, max_size=4))
    def exists(self, ks) -> None:
        assert self.svc.exists(ks) == self.model.exists(ks)

    @rule(key=keys, force=st.booleans())
    def remove(self, key, force) -> None:
        exp = self.model.remove(self.now, key, force)
        assert code(self.svc.batch_remove([key], force=force)[0]) == exp

    @rule()
    def evict(self) -> None:
        exp = self.model.evict(self.now)
        assert self.svc.evict() == exp

    @rule()
    def tick(self) -> None:
        expired, reclaimed, evicted = self.model.tick(self.now)
        r = self.svc.tick()
        assert (list(r.expired_clients), list(r.reclaimed_puts), list(r.evicted)) == (expired, reclaimed, evicted)

    @rule(node=node_ids)
    def heartbeat(self, node) -> None:
        exp = self.model.heartbeat(self.now, node)
        try:
            self.svc.heartbeat(node)
            got = None
        except MasterError as exc:
            got = exc.code
        assert got == exp

    @rule()
    def heartbeat_all(self) -> None:
        for node in list(self.model.clients):
            self.heartbeat(node)

    @rule(dt=advances)
    def advance(self, dt) -> None:
        self.now += dt

    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        if crash:  # power loss: only what was fsynced survives, the rest kept, dropped, torn or garbled at random
            self.fs = self.fs.crash(self.rng)
        else:
            self.svc.close()
        self.svc = MasterService(self.cfg, clock=lambda: self.now, data_dir=DATA_DIR, fs=self.fs)
        if crash:
            # Every call but one that only starts puts was fsynced before it returned; those written but not yet
            # fsynced (MasterConfig.sync_put_start) may be lost, a suffix of them: the recovered state must be the
            # model's state at the last fsynced call or after one of the later put starts, exactly.
            assert self.svc.lsn in self.models_at, (self.svc.lsn, sorted(self.models_at))
            self.model = copy.deepcopy(self.models_at[self.svc.lsn])
        self.models_at = {}
        self.model.restart(self.now)

    @invariant()
    def track_durability(self) -> None:
        """Remember the model at each LSN from the last fsynced one on (what a power loss may go back to)."""
        svc = getattr(self, "svc", None)
        if svc is None:
            return
        if svc.durable_lsn == svc.lsn:
            if list(self.models_at) != [svc.lsn]:
                self.models_at = {svc.lsn: copy.deepcopy(self.model)}
        elif svc.lsn not in self.models_at:  # a call that only started puts: written, not fsynced
            assert svc.durable_lsn in self.models_at
            self.models_at[svc.lsn] = copy.deepcopy(self.model)

    # ---------------------------------------------------------------- agreement
    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "svc"):
            return
        svc, model = self.svc, self.model
        svc.check_invariants()
        assert sorted(svc.keys()) == sorted(model.objects)
        for key, m in model.objects.items():
            info = svc.object_info(key)
            assert info.status == (ObjectStatus.COMPLETE if m.status == "complete" else ObjectStatus.PENDING)
            assert [d.segment_id for d in info.replicas] == m.segments
            assert info.put_id == m.put_id
            if m.status == "complete":
                assert info.lease_end_s == m.lease_end or (math.isinf(m.lease_end) and info.lease_end_s < self.now)
                assert info.last_access_s == m.last_access
        assert {s.segment_id: s.node_id for s in svc.segments()} == {s: g.node for s, g in model.segments.items()}
        for s, g in model.segments.items():
            assert svc.segment_usage(s) == (g.used * UNIT, g.units * UNIT)
        assert svc.clients() == sorted(model.clients)
        # one source of truth: the index holds exactly the COMPLETE objects' replicas. With deferred publishing
        # (what the master server runs) it does once publish_index() ran, as the server does after each reply;
        # at random it is left queued instead, so the next calls meet the rows still waiting.
        if self.cfg.defer_index_publish:
            if self.rng.random() < 0.5:
                return
            svc.publish_index()
        located = svc.index.locate([residency_key(k)[0] for k in KEYS])
        for key, rows in zip(KEYS, located):
            m = model.objects.get(key)
            want = sorted((model.segments[s].node, s) for s in m.segments) if m and m.status == "complete" else []
            assert sorted((e.node, e.segment_id) for e in rows) == want, key


TestMaster = MasterMachine.TestCase
TestMaster.settings = settings(max_examples=int(os.environ.get("QUILLCACHE_MASTER_EXAMPLES", "200")),
                               stateful_step_count=40, deadline=None)
