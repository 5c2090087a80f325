"""The replay's byte seam (``quillcache.harness.bytepool``) and its real pool (``ClusterPool``).

- The default ``AccountingPool`` leaves every replay exactly as it was before the seam existed: the
  digests below are of the rows, summary and verify failures that commit 27cf4c5 (the replay before
  the seam) produced for the same inputs, bit for bit.
- Whatever the pool, it is told a mirror of the data planes' host bytes: a reference pool (a dict of
  real payloads) ends holding exactly the (node, block) pairs the data planes hold in DRAM/SSD, and
  every peer fetch finds its bytes.
- ``ClusterPool`` over real node processes: same rows and summary as the default, every fetched block
  bit-exact, the master's objects = the mirror; a removed object is a miss and a wrong payload is
  corrupt (the counters can fail).
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from quillcache.harness import ReplayConfig, replay
from quillcache.harness.bytepool import AccountingPool, BytePool, PoolBlock, PoolReport, block_payload, pool_key
from quillcache.store import StoreKey
from quillcache.traces.loader import TraceRequest, load_trace

BS = 16


def synth(seed: int = 0, convs: int = 8, turns: int = 5) -> list[TraceRequest]:
    """Conversations behind a 2-block shared prompt, 500 ms apart: peer fetches, demotions and drops
    with the small tiers below."""
    rng = random.Random(seed)
    nxt, hist, out = 2, [[0, 1] for _ in range(convs)], []
    for _ in range(turns):
        for c in range(convs):
            new = rng.randint(1, 4)
            ids = hist[c] + list(range(nxt, nxt + new))
            nxt += new
            hist[c] = ids
            out.append(ids)
    return [TraceRequest(i * 500, len(ids) * BS, rng.randint(1, 40), tuple(ids), block_tokens=BS)
            for i, ids in enumerate(out)]


SYNTH_REAL = dict(model="llama-3.2-1b", engines=3, gpu_capacity_blocks=24, dram_capacity_blocks=10,
                  ssd_capacity_blocks=12, account_bytes=False, router="round_robin")
TRACE_SMALL = dict(model="llama-3.2-1b", gpu_capacity_blocks=300, dram_capacity_blocks=40, ssd_capacity_blocks=60,
                   engines=3, on_oversize="skip", account_bytes=True)

# sha256 of (rows, summary without wall_s, verify_failures) from commit 27cf4c5 (before the seam)
GOLDEN = {
    "trace-default": "ff8d11a6511cd242fa3d1ce501afe61dd15c316361eea958ae01fefa6d65b662",
    "trace-small-tiers": "a91e75e5ad33d16d1b1c8be51f4f292b86f62678552592e4779cccf0f49baebc",
    "synth-real": "9b1460a92d620a7305147922be06a04a61435867fc52a55fd5ef970beec68198",
}


def digest(res) -> str:
    s = res.summary.as_dict()
    s.pop("wall_s")
    blob = json.dumps({"rows": [r.as_dict() for r in res.rows], "summary": s, "vf": res.verify_failures},
                      sort_keys=True, default=repr).encode()
    return hashlib.sha256(blob).hexdigest()


def same_outcome(a, b) -> bool:
    sa, sb = a.summary.as_dict(), b.summary.as_dict()
    sa.pop("wall_s"), sb.pop("wall_s")
    return sa == sb and [r.as_dict() for r in a.rows] == [r.as_dict() for r in b.rows]


@pytest.mark.parametrize("name, trace, kw", [("synth-real", lambda: synth(0), SYNTH_REAL)])
def test_default_pool_leaves_the_replay_bit_for_bit_as_before(name, trace, kw) -> None:
    res = replay(trace(), ReplayConfig(**kw))
    assert digest(res) == GOLDEN[name]
    explicit = replay(trace(), ReplayConfig(**kw), pool=AccountingPool())
    assert digest(explicit) == GOLDEN[name]
    assert res.pool is not None and not res.pool.real_bytes and res.pool.blocks_offloaded > 0


@pytest.mark.parametrize("name, kw", [("trace-default", {}), ("trace-small-tiers", TRACE_SMALL)])
def test_default_pool_on_the_mooncake_trace_prefix_is_unchanged(trace_path, name, kw) -> None:
    res = replay(load_trace(trace_path, limit=300), ReplayConfig(**kw))
    assert digest(res) == GOLDEN[name]


class DictPool:
    """A reference pool: real payloads in a dict, checked on every fetch."""

    def __init__(self, block_bytes: int = 64) -> None:
        self.objects: dict[str, bytes] = {}
        self.block_bytes = block_bytes
        self.fetched = self.misses = self.corrupt = self.double_puts = 0
        self.batches: list[tuple[str, int]] = []

    def offload(self, blocks) -> None:
        self.batches.append(("offload", len(blocks)))
        for b in blocks:
            k = pool_key(b)
            self.double_puts += k in self.objects
            self.objects[k] = block_payload(k, self.block_bytes)

    def drop(self, blocks) -> None:
        self.batches.append(("drop", len(blocks)))
        for b in blocks:
            assert self.objects.pop(pool_key(b), None) is not None, f"dropped {pool_key(b)} that was never offloaded"

    def fetch(self, blocks) -> int:
        self.batches.append(("fetch", len(blocks)))
        ok = 0
        for b in blocks:
            assert b.kind in (4, 5)
            self.fetched += 1
            got = self.objects.get(pool_key(b))
            if got is None:
                self.misses += 1
            elif got != block_payload(pool_key(b), self.block_bytes):
                self.corrupt += 1
            else:
                ok += 1
        return ok

    def report(self) -> PoolReport:
        return PoolReport(pool="dict", real_bytes=True, blocks_fetched=self.fetched, misses=self.misses)

    def close(self) -> None:
        pass


def host_pairs(res) -> set[str]:
    out = set()
    for node, dp in res.planes.items():
        for key in dp.dram.keys():
            out.add(pool_key(PoolBlock(key, node, 0)))
        if dp.ssd is not None:
            for key in dp.ssd.keys():
                out.add(pool_key(PoolBlock(key, node, 0)))
    return out


@pytest.mark.parametrize("seed, kw, peers", [(0, SYNTH_REAL, True), (3, SYNTH_REAL, True),
                                             (2, {**SYNTH_REAL, "router": "dynamo", "engines": 2}, False)])
def test_a_pool_is_told_a_mirror_of_the_host_tiers(seed, kw, peers) -> None:
    pool = DictPool()
    assert isinstance(pool, BytePool)
    with replay(synth(seed), ReplayConfig(**kw), pool=pool, keep_open=True) as res:
        assert set(pool.objects) == host_pairs(res)
        assert pool.misses == 0 and pool.corrupt == 0 and pool.double_puts == 0
        peer_host = sum(r.hit_peer for r in res.rows)  # GPU-to-GPU peer hits never reach the pool
        assert pool.fetched <= peer_host
        kinds = {op for op, _ in pool.batches}
        if peers:  # round robin over 3 engines sends turns of one conversation to other nodes
            assert pool.fetched > 0 and kinds == {"offload", "drop", "fetch"}, kinds
        baseline = replay(synth(seed), ReplayConfig(**kw))
        assert same_outcome(res, baseline)  # the pool changed no decision


def test_replay_refuses_a_pool_that_is_not_one() -> None:
    with pytest.raises(TypeError, match="pool must be a BytePool"):
        replay(synth(0), ReplayConfig(**SYNTH_REAL), pool=object())  # type: ignore[arg-type]


def test_block_payload_is_deterministic_and_distinct() -> None:
    a = block_payload("engine-0/x", 4096)
    assert a == block_payload("engine-0/x", 4096) and len(a) == 4096
    assert a != block_payload("engine-1/x", 4096)
    assert block_payload("engine-0/x", 100) == a[:100]  # PCG64 output is a stream
    with pytest.raises(ValueError):
        block_payload("k", -1)
    k = StoreKey(7, b"\x01" * 16)
    assert pool_key(PoolBlock(k, "engine-2", 1)) == f"engine-2/{k.hex()}"


# ---- ClusterPool: real node processes ---------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    from quillcache.pool.cluster import LocalCluster

    with LocalCluster(nodes=2, dram_bytes=32 << 20, client_ttl_s=10.0, lease_ttl_s=10.0) as c:
        yield c


def test_cluster_pool_moves_real_bytes_and_changes_no_decision(cluster) -> None:
    from quillcache.harness.cluster_pool import ClusterPool

    block = 4096
    store = cluster.store(local_cache_bytes=0, replicas=1)
    pool = ClusterPool(store, block_bytes=block, nodes=2)
    with replay(synth(0), ReplayConfig(**SYNTH_REAL), pool=pool, keep_open=True) as res:
        ref = replay(synth(0), ReplayConfig(**SYNTH_REAL))
        assert same_outcome(res, ref)
        r = res.pool
        assert r.real_bytes and r.nodes == 2 and r.block_bytes == block
        assert (r.misses, r.corrupt, r.offload_failures, r.drop_failures) == (0, 0, 0, 0), r
        assert r.blocks_fetched == ref.pool.blocks_fetched > 0
        assert r.blocks_offloaded == ref.pool.blocks_offloaded and r.blocks_dropped == ref.pool.blocks_dropped > 0
        assert r.bytes_read == block * r.blocks_fetched
        assert r.measured_fetch_s > 0 and r.measured_transfer_s > 0 and r.predicted_fetch_s > 0
        # the master holds exactly the mirror of the data planes' host bytes
        assert set(cluster.master().keys()) == host_pairs(res)
        # the counters can fail: an object removed behind the pool's back is a miss, a wrong payload corrupt
        pairs = sorted(host_pairs(res))
        node, _, hexkey = pairs[0].partition("/")
        h, _, ident = hexkey.partition("-")
        gone = PoolBlock(StoreKey(int(h, 16), bytes.fromhex(ident)), node, block)
        store.remove(pool_key(gone), force=True)
        node, _, hexkey = pairs[1].partition("/")
        h, _, ident = hexkey.partition("-")
        wrong = PoolBlock(StoreKey(int(h, 16), bytes.fromhex(ident)), node, block)
        store.remove(pool_key(wrong), force=True)
        store.put(pool_key(wrong), bytes(block))  # verifies (crc) but is not the block's payload
        assert pool.fetch([gone, wrong]) == 0
        after = pool.report()
        assert after.misses == 1 and after.corrupt == 1
    pool.close()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quillcache", "replay", *args], capture_output=True, text=True,
                          check=False, timeout=180)


def _trace_file(tmp: Path) -> Path:
    p = tmp / "t.jsonl"
    lines = [json.dumps({"timestamp": r.timestamp_ms, "input_length": 512 * len(r.hash_ids),
                         "output_length": r.output_tokens, "hash_ids": list(r.hash_ids)}) for r in synth(0)]
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize("args, message", [
    (["--block-bytes", "4096"], "--block-bytes=4096 is the pool's block size: it needs --cluster N"),
    (["--cluster", "0"], "--cluster=0 must be"),
    (["--cluster", "17"], "--cluster=17 must be"),
    (["--cluster", "2", "--block-bytes", "0"], "--block-bytes=0 must be"),
    (["--cluster", "2", "--block-bytes", str(1 << 40)], "--block-bytes=1099511627776 must be"),
    (["--cluster", "x"], "argument --cluster: invalid int value: 'x'"),
])
def test_cluster_flags_refuse_bad_values_in_one_line(tmp_path: Path, capsys, args, message) -> None:
    from quillcache.cli import main

    try:  # in this process: argparse errors exit from inside the parser
        code = main(["replay", str(_trace_file(tmp_path)), "--out", str(tmp_path / "out"), "--quiet", *args])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert len(errors) == 1 and message in errors[0], err
    assert not (tmp_path / "out").exists()


def test_cli_cluster_replay_prints_and_writes_the_pool_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    p = cli(str(_trace_file(tmp_path)), "--out", str(out), "--cluster", "1", "--block-bytes", "2048",
            "--model", "llama-3.2-1b", "--engines", "3", "--gpu-capacity-blocks", "24", "--capacity-blocks", "10",
            "--ssd-capacity-blocks", "12", "--router", "round_robin", "--account-bytes")
    assert p.returncode == 0, p.stderr
    assert "pool: misses / fallbacks / corrupt" in p.stdout and "pool: 1 node processes" in p.stdout
    import csv

    row = next(csv.DictReader(open(out / "pool.csv")))
    assert row["misses"] == "0" and row["corrupt"] == "0" and int(row["blocks_fetched"]) > 0
    assert int(row["bytes_read"]) == 2048 * int(row["blocks_fetched"])


def test_cluster_plan_holds_every_offload_below_the_eviction_watermark() -> None:
    from quillcache.harness.cluster_pool import FILL, plan_cluster, pool_objects_bound
    from quillcache.pool.frame import TRAILER_BYTES

    reqs = synth(0)
    full = sum(r.input_tokens // r.block_tokens for r in reqs)
    assert pool_objects_bound(reqs, ReplayConfig(**SYNTH_REAL)) == min(full, 3 * (10 + 12))
    assert pool_objects_bound(reqs, ReplayConfig(**{**SYNTH_REAL, "dram_capacity_blocks": 1000})) == full
    plan = plan_cluster(10_000, nodes=3, block_bytes=16 << 10)
    foot = -(-((16 << 10) + TRAILER_BYTES) // 64) * 64
    assert plan.dram_bytes_per_node % (1 << 20) == 0
    assert 10_000 * foot <= FILL * plan.total_dram_bytes < 0.9 * plan.total_dram_bytes  # master evicts above 0.90


def test_cluster_replay_refuses_what_this_machine_cannot_hold(monkeypatch) -> None:
    from quillcache.harness import cluster_pool
    from quillcache.harness.replay import ReplayResourceError

    replay_mod = sys.modules["quillcache.harness.replay"]  # the package's `replay` attribute is the function
    monkeypatch.setattr(replay_mod, "available_ram_bytes", lambda: 64 << 20)  # 64 MiB "available"
    started = []
    monkeypatch.setattr("quillcache.pool.cluster.LocalCluster.start", lambda self: started.append(self))
    with pytest.raises(ReplayResourceError, match="lower --block-bytes or --limit"):
        cluster_pool.cluster_replay(synth(0), ReplayConfig(**SYNTH_REAL), nodes=3, block_bytes=4 << 20)
    assert started == []  # refused before any process started
