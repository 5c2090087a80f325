"""The pool on real processes (``LocalCluster``: a ``quillcache master`` and three ``quillcache node`` processes
on 127.0.0.1, a ``PooledStore`` in this process moving bytes over TCP).

Covers: a few hundred random puts and gets of 64 KiB .. 2 MiB with 2 replicas, every get bit-exact; a node
SIGKILLed at a seeded random point of the workload: every later get of an acknowledged object is served
bit-exact from the surviving replica, no wrong bytes ever, and the master drops the dead node within its
TTL so that no replica points at it; the node restarted with its SSD directory brings its flushed blocks
back; ``quillcache node`` bad flags (one line, exit 2); ``quillcache cluster status`` output.
The 10,000-op / 100-kill acceptance trials are the cluster study's (experiments/), not these tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from polling import wait_until

from quillcache.cli import main
from quillcache.cluster.tempdirs import owners_of
from quillcache.pool.cluster import LocalCluster

KiB, MiB = 1 << 10, 1 << 20
SEED = int(os.environ.get("QUILLCACHE_POOL_SEED", "1125"))


def _poll(pred, timeout_s: float, what: str) -> None:
    wait_until(pred, timeout_s, f"{what} (seed {SEED})")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(3, dram_bytes=160 * MiB, ssd=True, base_dir=tmp_path_factory.mktemp("cluster"),
                     client_ttl_s=2.0, lease_ttl_s=2.0)
    try:
        c.start()
        yield c
    finally:
        c.close()


def test_random_puts_and_gets_survive_a_sigkilled_node(cluster):
    rng = np.random.default_rng(SEED)
    store = cluster.store(local_cache_bytes=0, staging_bytes=16 * MiB, replicas=2, persist=True)
    n_ops = 300
    kill_at = int(rng.integers(n_ops // 4, 3 * n_ops // 4))
    victim = int(rng.integers(0, 3))
    acked: dict[str, bytes] = {}
    wrong = served = 0
    for op in range(n_ops):
        if op == kill_at:
            cluster.kill_node(victim)
        if not acked or rng.random() < 0.5:
            key = f"c-{op}"
            data = rng.integers(0, 256, int(rng.integers(64 * KiB, 2 * MiB + 1)), dtype=np.uint8).tobytes()
            try:
                out = store.put(key, data)
            except Exception:  # a put that touched the dead node before its TTL: revoked, not acknowledged
                assert op >= kill_at, f"seed {SEED}: put {key} failed with every node alive"
                continue
            assert out.replicas_written >= 1
            acked[key] = data
        else:
            key = list(acked)[int(rng.integers(0, len(acked)))]
            got = store.get(key)
            assert got is not None, f"seed {SEED}: acknowledged {key} missing (kill at op {kill_at})"
            served += 1
            wrong += bytes(got) != acked[key]
    assert wrong == 0, f"seed {SEED}: {wrong} gets returned wrong bytes"
    for key, data in acked.items():  # every acknowledged object, after the kill
        got = store.get(key)
        assert got is not None and bytes(got) == data, f"seed {SEED}: {key} (victim node-{victim}, op {kill_at})"
    dead = cluster.nodes[victim].node_id
    m = cluster.master()
    _poll(lambda: all(s.node_id != dead for s in m.segments()), 4 * cluster.client_ttl_s, f"expiry of {dead}")
    for key in acked:
        assert all(r.node_id != dead for r in m.get_replica_list(key)), f"seed {SEED}: {key} still on {dead}"
    st = store.stats()
    assert st.corrupt_discarded == 0 and served > 50

    # the victim's SSD dir: what it had persisted before the kill comes back at its restart (the master still
    # holds most of it through the surviving replicas: those are skipped, the rest re-announced)
    infos = store.flush_persist()
    assert sum("error" in i for i in infos.values()) == 1  # the dead node is not asked
    node = cluster.restart_node(victim)
    assert node.alive and cluster.status().segments == 3
    for key, data in acked.items():
        got = store.get(key)
        assert got is not None and bytes(got) == data, f"seed {SEED}: {key} after the restart"
    store.close()


def test_cluster_status_command(cluster, capsys):
    assert main(["cluster", "status", "--master", cluster.master_address]) == 0
    out = capsys.readouterr().out
    for n in cluster.nodes:
        assert n.node_id in out
    assert "objects" in out and "MiB" in out
    assert main(["cluster", "status", "--master", cluster.master_address, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["segments"] == 3 and len(doc["nodes"]) == 3 and doc["capacity_bytes"] == 3 * 160 * MiB


def _exit_status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors exit from inside the parser
        return e.code


def test_node_command_refuses_bad_flags(capsys, monkeypatch):
    monkeypatch.setenv("QUILLCACHE_TRANSFER_SECRET", "x" * 32)
    for argv, needle in ((["node", "--master", "tcp://127.0.0.1:1", "--dram", "lots"], "is not a size"),
                         (["node", "--master", "tcp://127.0.0.1:1", "--dram", "1GiB", "--port", "70000"],
                          "not in [0, 65535]"),
                         (["node", "--dram", "1GiB"], "--master"),
                         (["node", "--master", "tcp://127.0.0.1:1", "--dram", "100"], "below the minimum"),
                         (["node", "--master", "tcp://127.0.0.1:1", "--dram", "1GiB", "--ssd-size", "1GiB"],
                          "--ssd-size needs --ssd"),
                         (["node", "--master", "tcp://127.0.0.1:1", "--dram", "1GiB", "--etcd", "nohost"], "--etcd")):
        assert _exit_status(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and "Traceback" not in err, err
    monkeypatch.delenv("QUILLCACHE_TRANSFER_SECRET")
    assert _exit_status(["node", "--master", "tcp://127.0.0.1:1", "--dram", "1GiB"]) == 2
    assert "QUILLCACHE_TRANSFER_SECRET" in capsys.readouterr().err


def test_parse_size():
    from quillcache.cli.argtypes import parse_size

    assert parse_size("256MiB") == 256 * MiB and parse_size("1GiB") == 1 << 30 and parse_size("4096") == 4096
    assert parse_size("2MB") == 2_000_000
    with pytest.raises(ValueError):
        parse_size("12 parsecs")


def test_cluster_up_runs_until_sigterm_and_stops_its_children(tmp_path):
    import signal

    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "quillcache", "cluster", "up", "--nodes", "2", "--dram", "8MiB",
                             "--dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = json.loads(proc.stdout.readline())
        assert len(line["nodes"]) == 2 and line["master"].startswith("tcp://127.0.0.1:")
        pids = [n["pid"] for n in line["nodes"]]
        out = subprocess.run([sys.executable, "-m", "quillcache", "cluster", "status", "--master", line["master"]],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "node-0" in out.stdout and "node-1" in out.stdout, out.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        for pid in pids:
            _poll(lambda pid=pid: not os.path.exists(f"/proc/{pid}") or
                  open(f"/proc/{pid}/stat").read().split()[2] == "Z", 10, f"node pid {pid} exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie nobody reaped yet is gone too
    except FileNotFoundError:
        return True


def _proc_state(pid: int) -> str:
    """``T`` when every thread of ``pid`` is stopped, else the state of one that is not."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                states.append(fh.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return next((st for st in states if st != "T"), "T")


def _kill_parent_and_await_children(proc: subprocess.Popen, pids: list[int]) -> None:
    """SIGKILL ``proc`` (no cleanup of its own runs) and poll until every child pid is gone."""
    proc.kill()
    proc.wait(timeout=30)
    for pid in pids:
        _poll(lambda pid=pid: _gone(pid), 20, f"child pid {pid} exit after its parent's SIGKILL")


@contextmanager
def _parent(argv: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """Start ``argv`` (a process that starts children; ``env`` added to this environment); yields it
    and a list the test fills with its children's pids. Whatever a failed test left is killed on the
    way out: the parent, then every listed child still there (woken first if paused)."""
    import signal

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    pids: list[int] = []
    try:
        yield proc, pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("etcd", [False, True], ids=["plain", "etcd"])
def test_cluster_up_children_stop_when_it_is_sigkilled(tmp_path, etcd):
    """SIGKILL runs no cleanup in ``cluster up``: its master and nodes notice they were re-parented
    (``cli.parent``) and stop by themselves, each through its own cleanup; an ``--etcd`` server,
    which cannot poll, gets SIGTERM from the kernel (``kill_on_parent_death``)."""
    from quillcache.cluster.etcd import ETCD_INSTALL_HINT, find_etcd

    if etcd and find_etcd() is None:
        pytest.skip(ETCD_INSTALL_HINT)
    with _parent([sys.executable, "-m", "quillcache", "cluster", "up", "--nodes", "2", "--dram", "8MiB",
                  "--dir", str(tmp_path), *(["--etcd"] if etcd else [])]) as (proc, pids):
        line = json.loads(proc.stdout.readline())
        pids += [line["master_pid"], *(n["pid"] for n in line["nodes"])]
        assert (line["etcd_pid"] is not None) == etcd
        if etcd:
            pids.append(line["etcd_pid"])
        assert not any(_gone(p) for p in pids)
        _kill_parent_and_await_children(proc, pids)
        for name in ("master", "node-0", "node-1"):
            log = (tmp_path / f"{name}.log").read_text()
            assert "is gone: stopping" in log, (name, log[-2000:])


def test_the_temporary_dir_a_sigkilled_cluster_up_left_is_removed_by_the_next_one(tmp_path):
    """Without ``--dir`` the base dir is a temporary one that ``close`` removes; SIGKILL runs no close, so it
    stays, and once every process it names has exited the next cluster that makes one removes it
    (``quillcache.cluster.tempdirs``). A cluster still running keeps its own."""
    argv = [sys.executable, "-m", "quillcache", "cluster", "up", "--nodes", "1", "--dram", "8MiB"]
    env = {"TMPDIR": str(tmp_path)}
    with _parent(argv, env) as (first, pids):
        line = json.loads(first.stdout.readline())
        pids += [line["master_pid"], line["nodes"][0]["pid"]]
        left = Path(line["base_dir"])
        assert left.parent == tmp_path and left.is_dir()
        # it names cluster up and every child working in it: none may be running when it is swept
        assert {o.pid for o in owners_of(left)} == {first.pid, *pids}
        _kill_parent_and_await_children(first, pids)
        assert left.is_dir()  # nobody removed it
    with _parent(argv, env) as (second, pids):
        line = json.loads(second.stdout.readline())
        pids += [line["master_pid"], line["nodes"][0]["pid"]]
        mine = Path(line["base_dir"])
        assert not left.exists() and mine.is_dir() and mine != left
        with _parent(argv, env) as (third, more):  # a running cluster's dir is not swept
            line = json.loads(third.stdout.readline())
            more += [line["master_pid"], line["nodes"][0]["pid"]]
            assert mine.is_dir() and Path(line["base_dir"]).is_dir()
            third.terminate()
            assert third.wait(timeout=60) == 0
            assert not Path(line["base_dir"]).exists()  # a normal stop removes its own
        second.terminate()
        assert second.wait(timeout=60) == 0
        assert not mine.exists()


def test_a_temporary_base_dir_names_every_child_working_in_it(tmp_path, monkeypatch):
    """The etcd server as well as the master and nodes, each named as soon as it is started."""
    import tempfile

    from quillcache.cluster.etcd import ETCD_INSTALL_HINT, find_etcd

    if find_etcd() is None:
        pytest.skip(ETCD_INSTALL_HINT)
    from quillcache.cluster.etcd import EtcdProcess

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen_while_starting = []
    wait_healthy = EtcdProcess._wait_healthy

    def noting(self):  # what the owner file says before etcd is healthy (it may take a while)
        seen_while_starting.append({o.pid for o in owners_of(self._owned_by)})
        wait_healthy(self)

    monkeypatch.setattr(EtcdProcess, "_wait_healthy", noting)
    with LocalCluster(1, dram_bytes=8 * MiB, etcd=True) as c:
        assert c.base_dir.parent == tmp_path
        assert seen_while_starting == [{os.getpid(), c.etcd.pid}]
        named = {o.pid for o in owners_of(c.base_dir)}
        assert named == {os.getpid(), c.etcd.pid, c.master_pid, c.nodes[0].pid}
    assert not c.base_dir.exists()


def test_a_paused_node_stops_too_when_its_parent_is_sigkilled(tmp_path):
    """A node stopped by ``pause_node`` (SIGSTOP) cannot poll: the kernel's SIGCONT on its parent's
    death (``cli.parent``) wakes it, and it stops like the others."""
    script = (
        "import json, sys, time\n"
        "from quillcache.pool.cluster import LocalCluster\n"
        f"c = LocalCluster(1, dram_bytes=8 << 20, base_dir={str(tmp_path)!r}).start()\n"
        "c.pause_node(0)\n"
        "print(json.dumps([c.master_pid, c.nodes[0].pid]), flush=True)\n"
        "time.sleep(600)\n")
    with _parent([sys.executable, "-c", script]) as (proc, pids):
        pids += json.loads(proc.stdout.readline())
        assert _proc_state(pids[1]) == "T"  # pause_node returned once the node stopped
        _kill_parent_and_await_children(proc, pids)


def test_pause_and_resume_return_once_the_kernel_shows_them(cluster):
    """Signals arrive asynchronously; ``pause_node``/``resume_node`` wait for the state they name, so
    a caller never acts on a node it believes frozen while it still runs."""
    n = cluster.nodes[2]
    assert len(os.listdir(f"/proc/{n.pid}/task")) > 1  # a node has threads: each must be seen stopped
    try:
        for _ in range(20):  # each round's reads come right after the call returns
            cluster.pause_node(2)
            assert _proc_state(n.pid) == "T"
            cluster.resume_node(2)
            assert _proc_state(n.pid) != "T"
    finally:
        cluster.resume_node(2)  # the module's other tests need the node running


def test_a_child_started_otherwise_never_watches_a_parent(monkeypatch):
    from quillcache.cli.parent import PARENT_ENV, parent_watch

    assert os.getppid() != 1  # (else "our parent is gone" would be right)
    live_stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # unset, malformed, init, a live process that is not our parent (ourselves; a stranger)
        for value in (None, "not-a-pid", "1", str(os.getpid()), str(live_stranger.pid)):
            if value is None:
                monkeypatch.delenv(PARENT_ENV, raising=False)
            else:
                monkeypatch.setenv(PARENT_ENV, value)
            assert parent_watch()() is False and PARENT_ENV not in os.environ
    finally:
        live_stranger.kill()
        live_stranger.wait()
    # a parent that died before the child looked: the named pid no longer exists
    monkeypatch.setenv(PARENT_ENV, str(live_stranger.pid))
    assert parent_watch()() is True
    monkeypatch.setenv(PARENT_ENV, str(os.getppid()))
    gone = parent_watch()
    assert gone() is False and PARENT_ENV not in os.environ  # read once, never inherited


def test_a_child_that_cannot_poll_gets_killed_with_its_parent():
    """``kill_on_parent_death``: a child that runs no code of ours (here ``sleep``; etcd in use) is
    signalled by the kernel when its parent is SIGKILLed; from a thread other than the main one the
    guard is not given (the kernel's signal would follow that thread's end)."""
    import threading

    from quillcache.cli.parent import kill_on_parent_death

    script = ("import subprocess, signal\n"
              "from quillcache.cli.parent import kill_on_parent_death\n"
              "p = subprocess.Popen(['sleep', '600'], preexec_fn=kill_on_parent_death(signal.SIGTERM))\n"
              "print(p.pid, flush=True)\n"
              "p.wait()\n")
    with _parent([sys.executable, "-c", script]) as (proc, pids):
        pids.append(int(proc.stdout.readline()))
        assert not _gone(pids[0])
        _kill_parent_and_await_children(proc, pids)
    assert callable(kill_on_parent_death())
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(kill_on_parent_death()))
    t.start()
    t.join()
    assert seen == [None]


def test_nodes_register_in_etcd_and_leave_when_killed(tmp_path):
    from quillcache.cluster.etcd import ETCD_INSTALL_HINT, find_etcd
    from quillcache.cluster.registry import EtcdRegistry

    if find_etcd() is None:
        pytest.skip(ETCD_INSTALL_HINT)
    with LocalCluster(2, dram_bytes=8 * MiB, etcd=True, base_dir=tmp_path, client_ttl_s=2.0) as c:
        reg = EtcdRegistry(c.etcd.endpoint)
        try:
            nodes = {d.node_id: d for d in reg.nodes()}
            assert sorted(nodes) == ["node-0", "node-1"]
            assert nodes["node-1"].endpoint == c.nodes[1].transfer_address
            assert nodes["node-1"].capacity_bytes == 8 * MiB
            c.kill_node(0)
            _poll(lambda: [d.node_id for d in reg.nodes()] == ["node-1"], 15, "node-0 leaving the registry")
        finally:
            reg.close()


def test_node_control_rpc_info_and_bad_persist_requests(cluster):
    from quillcache.pool.control_auth import control_key, sign
    from quillcache.pool.errors import ControlAuthError
    from quillcache.rpc import RpcClient, RpcRejectedError

    key = control_key(cluster.secret)  # persist and flush need a proof on the pool secret (control_auth)
    bad = [("k", -1, 100), "junk", ("k", 0, 1 << 40), ("", 0, 100)]
    for n in cluster.nodes:
        with RpcClient(n.control_address, timeout_s=10) as c:
            info = c.call("info")
            assert info["node_id"] == n.node_id and info["pid"] == n.pid
            assert info["transfer_address"] == n.transfer_address and info["capacity_bytes"] == 160 * MiB
            with pytest.raises(ControlAuthError):
                c.call("persist", bad)
            assert c.call("persist", bad, auth=sign(key, "persist", bad)) == 0
            with pytest.raises(RpcRejectedError):
                c.call("persist")  # arguments that do not bind
            with pytest.raises(Exception, match="list"):
                c.call("persist", "not a list", auth=sign(key, "persist", "not a list"))
            assert c.call("info")["persist_skipped"] >= 4  # still serving, and it counted them
