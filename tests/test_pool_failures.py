"""Node and master failures on a real pool (``LocalCluster``: a ``quillcache master`` and three ``quillcache
node`` processes on 127.0.0.1, client TTL 2 s), each kill point drawn from a seeded RNG (``SEED``, printed in
every assertion message; set ``QUILLCACHE_FAILURE_SEED`` to replay one).

- a node SIGKILLed while batches of gets and puts are in flight: every get is bit-exact or a miss, every
  acknowledged object (2 replicas on distinct nodes) is still served, the master expires the node within
  its client TTL (+ one timer tick and a scheduling margin), and afterwards no object's replica points at it;
- a node restarted on its SSD directory: objects whose ONLY replica was on it (1 replica, persisted and
  flushed before the kill) are back in the pool, bit-exact;
- a network partition of one node: a network namespace with a veth pair when this runs as root with
  ``ip netns`` (nftables/iptables are the fallback, skipped when absent); the node is treated as dead (expired,
  gets fail over) and rejoins when the link comes back (remount, serves new puts);
- a frozen node (SIGSTOP/SIGCONT: a STAND-IN for a partition that needs no privileges): the same outcomes;
- the master SIGKILLed and restarted (same data dir) in the middle of a workload: the nodes re-register and
  no acknowledged object is lost.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from polling import wait_until

from quillcache.pool.cluster import LocalCluster

KiB, MiB = 1 << 10, 1 << 20
SEED = int(os.environ.get("QUILLCACHE_FAILURE_SEED", "20261125"))
TTL_S = 2.0
TICK_S = 0.2
MARGIN_S = 1.5  # scheduling on a loaded 2-core machine


def _poll(pred, timeout_s: float, what: str) -> float:
    """Wait for ``pred()``; returns the seconds it took (AssertionError naming ``what`` and the seed)."""
    t0 = time.monotonic()
    wait_until(pred, timeout_s, f"{what} (seed {SEED})")
    return time.monotonic() - t0


def _payload(rng: np.random.Generator, lo: int = 64 * KiB, hi: int = 512 * KiB) -> bytes:
    return rng.integers(0, 256, int(rng.integers(lo, hi + 1)), dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(3, dram_bytes=96 * MiB, ssd=True, base_dir=tmp_path_factory.mktemp("failures"),
                     client_ttl_s=TTL_S, lease_ttl_s=TTL_S, tick_s=TICK_S)
    try:
        c.start()
        yield c
    finally:
        c.close()


@pytest.fixture
def healthy(cluster):
    """The module's cluster with every process alive before and after the test (restarting what died)."""
    yield cluster
    for n in cluster.nodes:
        if not n.alive:
            cluster.restart_node(n.index)
        else:
            cluster.resume_node(n.index)  # harmless when not stopped
    if cluster.master_proc is None or cluster.master_proc.poll() is not None:
        cluster.restart_master()
    want = {n.node_id for n in cluster.nodes}  # by node id: a remounted node has a new segment id
    _poll(lambda: {s.node_id for s in cluster.master().segments()} == want, 20, "every node mounted again")


def _no_replica_on(master, keys, node_id: str) -> list[str]:
    bad = []
    for k in keys:
        try:
            if any(r.node_id == node_id for r in master.object_info(k).replicas):
                bad.append(k)
        except Exception:  # noqa: BLE001 - an object gone with its only replica points nowhere
            pass
    return bad


def test_node_sigkilled_mid_batch(healthy):
    c = healthy
    rng = np.random.default_rng(SEED)
    store = c.store(local_cache_bytes=0, replicas=2, timeout_s=1.0)
    acked: dict[str, bytes] = {}
    for i in range(40):
        acked[f"k-{i}"] = _payload(rng)
    for out in store.put_many(list(acked.items())):
        assert not isinstance(out, BaseException), f"seed {SEED}: {out}"
    victim = int(rng.integers(0, 3))
    delay_s = float(rng.uniform(0.05, 0.6))
    dead = c.nodes[victim].node_id
    killer = threading.Timer(delay_s, c.kill_node, args=(victim,))
    wrong = served = missed = 0
    t_kill = time.monotonic() + delay_s
    killer.start()
    try:
        deadline = time.monotonic() + delay_s + 1.5
        b = 0
        while time.monotonic() < deadline:  # batches of gets and puts, straddling the kill
            keys = [list(acked)[j] for j in rng.integers(0, len(acked), 16)]
            for k, v in zip(keys, store.get_many(keys)):
                if v is None:
                    missed += 1
                else:
                    served += 1
                    wrong += bytes(v) != acked[k]
            new = {f"n-{b}-{j}": _payload(rng) for j in range(4)}
            for (k, data), out in zip(new.items(), store.put_many(list(new.items()))):
                if not isinstance(out, BaseException):
                    acked[k] = data  # acknowledged: must survive (a replica on a live node)
            b += 1
    finally:
        killer.join()
    msg = f"seed {SEED}: node-{victim} killed {delay_s:.3f} s into the batches"
    assert wrong == 0, f"{msg}: {wrong} gets returned wrong bytes"
    assert served > 0 and b >= 2, msg
    # every acknowledged object is still served, bit-exact, from a surviving replica
    for k, v in zip(list(acked), store.get_many(list(acked))):
        assert v is not None and bytes(v) == acked[k], f"{msg}: acknowledged {k} lost"
    # the master expires the node within its TTL, then no replica points at it
    m = c.master()
    _poll(lambda: all(s.node_id != dead for s in m.segments()), TTL_S + TICK_S + MARGIN_S + 5, f"expiry of {dead}")
    took = time.monotonic() - t_kill
    assert took <= TTL_S + TICK_S + MARGIN_S, f"{msg}: expired {took:.2f} s after the kill (TTL {TTL_S} s)"
    assert _no_replica_on(m, m.keys(), dead) == [], msg
    assert store.stats().corrupt_discarded == 0, msg


def test_restarted_node_brings_its_ssd_blocks_back(healthy):
    c = healthy
    rng = np.random.default_rng(SEED + 1)
    store = c.store(local_cache_bytes=0, replicas=1, persist=True, timeout_s=1.0)
    data = {f"ssd-{i}": _payload(rng, 16 * KiB, 256 * KiB) for i in range(60)}
    for out in store.put_many(list(data.items())):
        assert not isinstance(out, BaseException), f"seed {SEED}: {out}"
    infos = store.flush_persist()
    assert all("error" not in i for i in infos.values()), infos
    victim = int(rng.integers(0, 3))
    dead = c.nodes[victim].node_id
    m = c.master()
    only_there = [k for k in data if m.object_info(k).replicas[0].node_id == dead]
    assert only_there, f"seed {SEED}: no object landed on node-{victim}"
    c.kill_node(victim)
    _poll(lambda: all(s.node_id != dead for s in m.segments()), TTL_S + TICK_S + MARGIN_S + 5, f"expiry of {dead}")
    assert all(v is None for v in store.get_many(only_there)), "gone with the node's DRAM until it restarts"
    c.restart_node(victim)
    _poll(lambda: all(store.contains(only_there)), 20, f"re-announce of node-{victim}'s SSD blocks")
    for k, v in zip(only_there, store.get_many(only_there)):
        assert v is not None and bytes(v) == data[k], f"seed {SEED}: {k} not back bit-exact after the restart"
    for k, v in zip(list(data), store.get_many(list(data))):
        assert v is not None and bytes(v) == data[k], f"seed {SEED}: {k}"


def test_frozen_node_is_treated_as_dead_then_rejoins(healthy):
    """SIGSTOP/SIGCONT: a STAND-IN for a network partition (the process neither answers nor heartbeats)."""
    c = healthy
    rng = np.random.default_rng(SEED + 2)
    store = c.store(local_cache_bytes=0, replicas=2, timeout_s=0.5, suspect_s=30.0)
    data = {f"fz-{i}": _payload(rng) for i in range(24)}
    store.put_many(list(data.items()))
    victim = int(rng.integers(0, 3))
    frozen = c.nodes[victim].node_id
    m = c.master()
    c.pause_node(victim)
    try:
        # gets fail over to the other replica while the master still lists the frozen one
        for k, v in zip(list(data), store.get_many(list(data))):
            assert v is not None and bytes(v) == data[k], f"seed {SEED}: {k} while node-{victim} is frozen"
        _poll(lambda: all(s.node_id != frozen for s in m.segments()), TTL_S + TICK_S + MARGIN_S + 5,
              f"expiry of frozen {frozen}")
        assert _no_replica_on(m, m.keys(), frozen) == []
    finally:
        c.resume_node(victim)
    # healed: the node heartbeats, hears NEED_REMOUNT, mounts again and takes new puts
    _poll(lambda: any(s.node_id == frozen for s in m.segments()), 15, f"remount of {frozen}")
    fresh = {f"fz-new-{i}": _payload(rng, 16 * KiB, 64 * KiB) for i in range(12)}
    for out in store.put_many(list(fresh.items()), replicas=3):
        assert not isinstance(out, BaseException) and out.replicas_written == 3, f"seed {SEED}: {out}"
    assert all(any(r.node_id == frozen for r in m.object_info(k).replicas) for k in fresh)
    for k, v in zip(list(fresh), store.get_many(list(fresh))):
        assert v is not None and bytes(v) == fresh[k]


def test_master_restarted_mid_workload_loses_no_acknowledged_object(healthy):
    c = healthy
    rng = np.random.default_rng(SEED + 3)
    store = c.store(local_cache_bytes=0, replicas=2, timeout_s=1.0, master_timeout_s=1.0, master_retry_s=20.0)
    acked: dict[str, bytes] = {}
    kill_at = int(rng.integers(10, 40))
    errors = 0
    for op in range(60):
        if op == kill_at:
            c.kill_master()
            c.restart_master()
        key = f"mr-{op}"
        data = _payload(rng, 16 * KiB, 256 * KiB)
        try:
            store.put(key, data)
            acked[key] = data
        except Exception:  # noqa: BLE001 - a put the master never acknowledged
            errors += 1
        if acked and op % 3 == 0:
            k = list(acked)[int(rng.integers(0, len(acked)))]
            v = store.get(k)
            assert v is not None and bytes(v) == acked[k], f"seed {SEED}: {k} (master restarted at op {kill_at})"
    _poll(lambda: len(c.master().segments()) == 3, 15, "the 3 nodes re-registered after the master restart")
    assert len(acked) >= 55, f"seed {SEED}: {errors} puts failed around the restart"
    for k, v in zip(list(acked), store.get_many(list(acked))):
        assert v is not None and bytes(v) == acked[k], f"seed {SEED}: acknowledged {k} lost (restart at op {kill_at})"


# ---- a real partition: a network namespace and a veth pair ------------------------------------


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create a network namespace (ip netns); nftables/iptables drops need root too"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (apt-get install iproute2)"
    name = f"qcprobe{secrets.token_hex(3)}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"ip netns add failed here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _sh(*args: str) -> None:
    p = subprocess.run(list(args), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {p.stderr.strip()}")


def _spawn(argv: list[str], env: dict, log: Path) -> tuple[subprocess.Popen, dict]:
    with open(log, "ab") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=fh, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    line = b""
    deadline = time.monotonic() + 60
    import select

    while not line.endswith(b"\n"):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError(f"{argv[3:5]} did not start: {log.read_text(errors='replace')[-2000:]}")
        r, _, _ = select.select([proc.stdout], [], [], 0.2)
        if r:
            line += os.read(proc.stdout.fileno(), 4096)
    return proc, json.loads(line.split(b"\n")[0])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_partitioned_node_netns_is_treated_as_dead_then_rejoins(tmp_path):
    why = _netns_unavailable()
    if why:
        pytest.skip(why)
    from quillcache.pool.store import PooledStore
    from quillcache.transfer import SECRET_ENV

    tag = secrets.token_hex(2)
    ns, veth_h, veth_n = f"qcpart{tag}", f"qch{tag}", f"qcn{tag}"
    octet = 64 + int(tag, 16) % 128
    host_ip, ns_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
    procs: list[subprocess.Popen] = []
    store = None
    env = dict(os.environ, **{SECRET_ENV: secrets.token_hex(16), "PYTHONUNBUFFERED": "1"})
    py = [sys.executable, "-m", "quillcache"]
    try:
        _sh("ip", "netns", "add", ns)
        _sh("ip", "link", "add", veth_h, "type", "veth", "peer", "name", veth_n)
        _sh("ip", "link", "set", veth_n, "netns", ns)
        _sh("ip", "addr", "add", f"{host_ip}/30", "dev", veth_h)
        _sh("ip", "link", "set", veth_h, "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/30", "dev", veth_n)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", veth_n, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        master, m = _spawn(py + ["master", "--data-dir", str(tmp_path / "m"), "--host", host_ip, "--port", "0",
                                 "--client-ttl-s", repr(TTL_S), "--lease-ttl-s", repr(TTL_S), "--tick-s", repr(TICK_S),
                                 "--log-level", "warning"], env, tmp_path / "master.log")
        procs.append(master)
        addr = m["address"]
        common = ["--master", addr, "--dram", "32MiB", "--heartbeat-s", "0.5", "--log-level", "warning"]
        for i in range(2):
            p, _ = _spawn(py + ["node", *common, "--node-id", f"host-{i}", "--host", host_ip], env,
                          tmp_path / f"host-{i}.log")
            procs.append(p)
        p, _ = _spawn(["ip", "netns", "exec", ns, *py, "node", *common, "--node-id", "cut", "--host", ns_ip], env,
                      tmp_path / "cut.log")
        procs.append(p)
        store = PooledStore(addr, secret=env[SECRET_ENV], local_cache_bytes=0, replicas=2, timeout_s=0.5,
                            lease_ttl_s=TTL_S, suspect_s=30.0)
        mc = store.master
        _poll(lambda: len(mc.segments()) == 3, 20, "3 segments mounted")
        rng = np.random.default_rng(SEED + 4)
        data = {f"p-{i}": _payload(rng, 16 * KiB, 128 * KiB) for i in range(24)}
        for out in store.put_many(list(data.items()), replicas=3):
            assert not isinstance(out, BaseException) and out.replicas_written == 3, out
        _sh("ip", "link", "set", veth_h, "down")  # the partition
        try:
            for k, v in zip(list(data), store.get_many(list(data))):
                assert v is not None and bytes(v) == data[k], f"seed {SEED}: {k} during the partition"
            took = _poll(lambda: all(s.node_id != "cut" for s in mc.segments()), TTL_S + TICK_S + MARGIN_S + 5,
                         "expiry of the partitioned node")
            assert took <= TTL_S + TICK_S + MARGIN_S, f"expired {took:.2f} s after the cut"
            assert _no_replica_on(mc, mc.keys(), "cut") == []
        finally:
            _sh("ip", "link", "set", veth_h, "up")  # healed
        _poll(lambda: any(s.node_id == "cut" for s in mc.segments()), 20, "remount of the healed node")
        fresh = {f"p-new-{i}": _payload(rng, 16 * KiB, 64 * KiB) for i in range(8)}
        for out in store.put_many(list(fresh.items()), replicas=3):
            assert not isinstance(out, BaseException) and out.replicas_written == 3, out
        for k, v in zip(list(fresh), store.get_many(list(fresh))):
            assert v is not None and bytes(v) == fresh[k]
    finally:
        if store is not None:
            store.close()
        for p in reversed(procs):
            p.send_signal(signal.SIGCONT)
            _stop(p)
        subprocess.run(["ip", "link", "del", veth_h], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
