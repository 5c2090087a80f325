"""Leader election through etcd: one winner with epoch E, a warm-up of one TTL before it leads, failover to a
standby after resign or SIGKILL within 2×TTL with a larger epoch, and the epoch fence that keeps a deposed
(SIGSTOPped) leader's writes out."""

from __future__ import annotations

import logging
import signal
import threading
import time

import pytest
from etcd_fixture import CANDIDATE_SCRIPT, Child, etcd, etcd_client, prefix, require_etcd  # noqa: F401
from polling import wait_until

from quillcache.cluster.client import Backoff, EtcdClient, EtcdUnavailableError
from quillcache.cluster.descriptors import election_key
from quillcache.cluster.election import EpochFence, FencedError, LeaderElection, NotLeaderError
from quillcache.cluster.etcd import EtcdProcess
from quillcache.cluster.registry import EtcdRegistry

TTL_S = 2  # etcd's smallest lease (it raises a TTL of 1 to 2)


def candidate(etcd, prefix, cid, port, **kw) -> LeaderElection:
    return LeaderElection(etcd.endpoint, "master", cid, f"127.0.0.1:{port}", ttl_s=TTL_S, prefix=prefix, **kw)


def test_one_of_two_wins_warms_up_and_the_other_takes_over_after_resign(etcd, prefix):
    a, b = candidate(etcd, prefix, "a", 5001), candidate(etcd, prefix, "b", 5002)
    try:
        a.start()
        won = wait_until(a.leader, 5, "a's key")
        assert won.candidate_id == "a" and not a.is_leader  # won the key, still warming up
        b.start()
        wait_until(lambda: a.is_leader, 2 * TTL_S, "a leads after its warm-up")
        assert a.epoch == won.epoch and not b.is_leader and b.epoch is None
        assert b.leader() == won and won.address == "127.0.0.1:5001"
        with EtcdRegistry(etcd.endpoint, prefix=prefix) as reg:
            assert reg.master_address() == "127.0.0.1:5001"

        resigned = time.monotonic()
        a.resign()
        wait_until(lambda: b.is_leader, 2 * TTL_S, "b leads within 2×TTL of a's resignation")
        took = time.monotonic() - resigned
        assert b.epoch > won.epoch and not a.is_leader
        assert a.leader().candidate_id == "b" and a.leader().epoch == b.epoch
        print(f"resign → standby leads: {took:.2f} s (warm-up {TTL_S} s included)")
    finally:
        a.resign()
        b.resign()
    assert b.leader() is None  # resigning deleted the key


def test_sigkilled_leader_is_replaced_within_two_ttls(etcd, prefix):
    child = Child(CANDIDATE_SCRIPT, etcd.endpoint, prefix, "master", "old", "127.0.0.1:6001", str(TTL_S))
    standby = candidate(etcd, prefix, "new", 6002)
    try:
        old_epoch = int(child.readline(30).split()[1])
        standby.start()
        child.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: (info := standby.leader()) is not None and info.candidate_id == "new", 2 * TTL_S,
                   "the standby holds the key within 2×TTL of the SIGKILL")
        won_s = time.monotonic() - killed
        wait_until(lambda: standby.is_leader, 2 * TTL_S, "the standby leads after its warm-up")
        leads_s = time.monotonic() - killed
        assert standby.epoch > old_epoch
        print(f"SIGKILL → standby holds the key {won_s:.2f} s, leads {leads_s:.2f} s (TTL {TTL_S} s)")
        assert won_s <= 2 * TTL_S and leads_s <= 3 * TTL_S
    finally:
        child.close()
        standby.resign()


def test_leader_paused_across_an_election_cannot_commit(etcd, etcd_client, prefix):
    child = Child(CANDIDATE_SCRIPT, etcd.endpoint, prefix, "master", "paused", "127.0.0.1:6101", str(TTL_S))
    standby = candidate(etcd, prefix, "next", 6102)
    try:
        old_epoch = int(child.readline(30).split()[1])
        child.send(f"put {prefix}/log/1")
        assert child.readline(5) == "ok"  # the leader commits while it leads
        child.signal(signal.SIGSTOP)
        standby.start()
        wait_until(lambda: standby.is_leader, 4 * TTL_S, "the standby leads while the old leader is stopped")
        new_epoch = standby.epoch
        standby.fence().put(f"{prefix}/log/2", b"new")
        child.signal(signal.SIGCONT)
        child.send(f"put {prefix}/log/3")
        answer = child.readline(5)
        assert answer.startswith("fenced"), answer
        assert f"epoch {old_epoch}" in answer and f"epoch {new_epoch} held by 'next'" in answer, answer
        assert etcd_client.get(f"{prefix}/log/3") is None
        child.send("is_leader")
        assert child.readline(5) == "False"  # its lease deadline passed while it was stopped
        assert etcd_client.get(f"{prefix}/log/2").value == b"new"
    finally:
        child.close()
        standby.resign()


def test_fence_rejects_the_old_epoch_and_another_candidate(etcd, etcd_client, prefix):
    a = candidate(etcd, prefix, "a", 5101, warmup_s=0.1)
    b = candidate(etcd, prefix, "b", 5102, warmup_s=0.1)
    try:
        epoch_a = a.campaign(timeout_s=10)
        old = a.fence()
        old.put(f"{prefix}/x", b"1")
        old.check()
        a.resign()
        with pytest.raises(NotLeaderError):
            a.fence()
        with pytest.raises(FencedError, match=f"epoch {epoch_a} of 'a'.*no leader"):
            old.check()
        epoch_b = b.campaign(timeout_s=10)
        assert epoch_b > epoch_a
        with pytest.raises(FencedError) as info:
            old.put(f"{prefix}/x", b"stale")
        assert info.value.epoch == epoch_a and info.value.current.epoch == epoch_b
        assert etcd_client.get(f"{prefix}/x").value == b"1"
        impostor = EpochFence(etcd_client, b.key, epoch_b, "a", "127.0.0.1:5101")  # right epoch, wrong holder
        with pytest.raises(FencedError):
            impostor.check()
        b.fence().put(f"{prefix}/x", b"2")
        assert etcd_client.get(f"{prefix}/x").value == b"2"
    finally:
        a.resign()
        b.resign()


def test_on_lost_fires_once_when_the_leader_key_goes(etcd, etcd_client, prefix):
    lost = []
    a = candidate(etcd, prefix, "a", 5201, warmup_s=0.1, on_lost=lost.append)
    try:
        a.campaign(timeout_s=10)
        etcd_client.delete(election_key("master", prefix))
        wait_until(lambda: lost, 5, "on_lost after the key was deleted")
        assert not a.is_leader and a.epoch is None and "deleted" in lost[0]
        assert len(lost) == 1
    finally:
        a.resign()


def test_a_deposed_leader_yields_one_ttl_so_a_watching_standby_takes_the_seat(etcd, etcd_client, prefix):
    lost = []
    a = candidate(etcd, prefix, "a", 5301, warmup_s=0.1, on_lost=lost.append)
    b = candidate(etcd, prefix, "b", 5302, warmup_s=0.1)
    try:
        a.campaign(timeout_s=10)
        b.start()  # watches a's key
        lease = a._keeper.lease_id
        etcd_client.revoke(lease)  # a's key goes, as when its lease expires while it is paused
        wait_until(lambda: lost, 5, "a learns it is deposed")
        t_lost = time.monotonic()
        won = []
        a_again = threading.Thread(target=lambda: won.append((a.campaign(timeout_s=4 * TTL_S), time.monotonic())))
        a_again.start()  # at once, as the master's campaign loop does
        wait_until(lambda: b.is_leader, 4 * TTL_S, "the watching standby leads")
        assert a.leader().candidate_id == "b"
        b.resign()  # now a is the only candidate: it takes the seat, but only after yielding one TTL
        a_again.join(4 * TTL_S + 5)
        assert won and a.is_leader
        assert won[0][1] - t_lost >= TTL_S * 0.95, "a campaigned again before its yield of one TTL ended"
    finally:
        a.resign()
        b.resign()


def test_campaign_with_etcd_down_is_a_clear_error_after_retries(tmp_path, caplog):
    require_etcd()
    with EtcdProcess(data_dir=tmp_path / "e") as proc:
        client = EtcdClient(proc.endpoint)
        election = LeaderElection(client, "master", "c", "127.0.0.1:5301", ttl_s=TTL_S,
                                  backoff=Backoff(initial_s=0.05, max_s=0.2))
        proc.kill()
        with caplog.at_level(logging.WARNING, logger="quillcache.cluster.election"):
            with pytest.raises(EtcdUnavailableError, match=f"etcd at {proc.endpoint} unreachable"):
                election.campaign(timeout_s=1.0)
        assert len(caplog.records) >= 2 and all(proc.endpoint in r.getMessage() for r in caplog.records)
        election.resign()


def test_bad_arguments_are_named(etcd):
    with pytest.raises(ValueError, match="address"):
        LeaderElection(etcd.endpoint, "master", "c", "nowhere")
    with pytest.raises(ValueError, match="candidate_id"):
        LeaderElection(etcd.endpoint, "master", "", "h:1")
    with pytest.raises(ValueError, match="ttl_s=0"):
        LeaderElection(etcd.endpoint, "master", "c", "h:1", ttl_s=0)
