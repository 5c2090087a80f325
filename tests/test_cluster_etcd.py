"""A real etcd as a test fixture (``EtcdProcess``) and the client's behaviour when etcd is away: a clear error
naming the endpoint, retries with backoff, a watch that resumes after an etcd restart."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
from etcd_fixture import etcd, etcd_client, prefix, require_etcd  # noqa: F401
from polling import wait_until

from quillcache.cluster.client import Backoff, EtcdClient, EtcdUnavailableError, parse_endpoint
from quillcache.cluster.etcd import ETCD_INSTALL_HINT, TEMP_PREFIX, EtcdNotFoundError, EtcdProcess, EtcdStartError, \
    find_etcd, free_port
from quillcache.cluster.lease import LeaseKeeper
from quillcache.cluster.tempdirs import owners_of, process_identity
from quillcache.cluster.watch import Watch


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_find_etcd_honours_the_override(monkeypatch, tmp_path):
    monkeypatch.setenv("QUILLCACHE_ETCD", str(tmp_path / "no-such-etcd"))
    assert find_etcd() is None
    with pytest.raises(EtcdNotFoundError, match="apt-get install etcd-server"):
        EtcdProcess()
    assert "apt-get install etcd-server" in ETCD_INSTALL_HINT


def test_etcd_that_exits_at_once_is_reported_with_its_log(tmp_path):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\necho 'cannot start: simulated' >&2\nexit 3\n")
    fake.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(EtcdStartError, match=r"(?s)exited with status 3.*simulated"):
        EtcdProcess(str(fake)).start()
    assert time.monotonic() - started < 5


def test_process_starts_healthy_and_always_stops(tmp_path):
    require_etcd()
    with EtcdProcess(data_dir=tmp_path / "e") as proc:
        port = proc.client_port
        assert proc.running() and listening(port)
        assert EtcdClient(proc.endpoint).version.startswith("3.")
    assert not proc.running() and not listening(port)
    proc.stop()  # idempotent


def test_owned_directory_is_removed_even_when_the_block_raises():
    require_etcd()
    with pytest.raises(RuntimeError, match="boom"):
        with EtcdProcess() as proc:
            base = proc.log_path.parent
            # it names this process and the server: no sweep removes it while either runs (quillcache.cluster.tempdirs)
            assert owners_of(base) == [process_identity(), process_identity(proc.pid)]
            assert base.name.startswith(TEMP_PREFIX)
            raise RuntimeError("boom")
    assert not proc.running() and not os.path.exists(base)


@pytest.mark.parametrize("bad", ["localhost", "h:0", "h:99999", "h:port", ""])
def test_bad_endpoints_are_named(bad):
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint(bad)


def test_unreachable_etcd_is_a_clear_error_after_retries_with_backoff(caplog):
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="quillcache.cluster.client"):
        with pytest.raises(EtcdUnavailableError) as info:
            EtcdClient(endpoint, connect_timeout_s=1.0, backoff=Backoff(initial_s=0.05, max_s=0.4))
    elapsed = time.monotonic() - started
    msg = str(info.value)
    assert f"etcd at {endpoint} is not reachable" in msg and "attempt(s) over 1 s" in msg, msg
    assert "Traceback" not in msg and info.value.endpoint == endpoint
    attempts = int(msg.split("(")[1].split()[0])
    assert attempts >= 3 and 0.9 <= elapsed < 4, (attempts, elapsed)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == attempts - 1 and all(endpoint in w for w in warnings)
    delays = [float(w.rsplit("retrying in ", 1)[1].split()[0]) for w in warnings]
    assert delays[:3] == [0.05, 0.1, 0.2] and max(delays) <= 0.4, delays  # doubling up to the cap


def test_client_waits_for_an_etcd_that_comes_up_during_its_retries(tmp_path):
    require_etcd()
    port = free_port()
    proc = EtcdProcess(client_port=port, data_dir=tmp_path / "late")
    starter = threading.Timer(0.5, proc.start)
    starter.start()
    try:
        client = EtcdClient(f"127.0.0.1:{port}", connect_timeout_s=30.0, backoff=Backoff(initial_s=0.1, max_s=0.5))
        assert client.put("/late/key", b"v") > 0
    finally:
        starter.join()
        proc.stop()


def test_calls_on_a_dead_etcd_raise_unavailable_naming_it(tmp_path):
    require_etcd()
    with EtcdProcess(data_dir=tmp_path / "d") as proc:
        client = EtcdClient(proc.endpoint)
        proc.kill()
        with pytest.raises(EtcdUnavailableError, match=f"etcd at {proc.endpoint} unreachable during get '/k'"):
            client.get("/k")


def test_txn_compare_on_create_revision(etcd_client, prefix):
    from quillcache.cluster.client import compare_create, put_op, range_op
    key = f"{prefix}/once"
    first = etcd_client.txn([compare_create(key, 0)], [put_op(key, b"1")], [range_op(key)])
    second = etcd_client.txn([compare_create(key, 0)], [put_op(key, b"2")], [range_op(key)])
    assert first.succeeded and not second.succeeded
    assert second.ranges[0][0].value == b"1" and second.ranges[0][0].create_revision == first.revision


def test_lease_keeper_keeps_a_key_past_its_ttl_and_revokes_it(etcd_client, prefix):
    keeper = LeaseKeeper(etcd_client, 2)
    lease = keeper.grant()
    assert keeper.granted_ttl_s == 2
    etcd_client.put(f"{prefix}/leased", b"v", lease)
    deadline = time.monotonic() + 3.0  # past the TTL: renewals kept it
    wait_until(lambda: time.monotonic() >= deadline, 4.0, "time to pass")
    assert keeper.alive() and etcd_client.get(f"{prefix}/leased") is not None
    keeper.stop(revoke=True)
    assert etcd_client.get(f"{prefix}/leased") is None and not keeper.alive()


def test_lease_keeper_reports_loss_when_etcd_revokes_it(etcd_client):
    lost = []
    keeper = LeaseKeeper(etcd_client, 2, on_lost=lost.append)
    etcd_client.revoke(keeper.grant())
    wait_until(lambda: lost, 3.0, "on_lost after the lease was revoked behind the keeper's back")
    assert "expired" in lost[0] and not keeper.alive()
    keeper.stop()


def test_watch_resumes_after_an_etcd_restart_without_losing_events(tmp_path):
    require_etcd()
    with EtcdProcess(data_dir=tmp_path / "w") as proc:
        client = EtcdClient(proc.endpoint)
        seen = []
        with Watch(client, "/w/", lambda ev: seen.append((ev.kind, ev.key)), prefix=True,
                   backoff=Backoff(initial_s=0.05, max_s=0.2)) as w:
            assert w.created.wait(5)
            client.put("/w/a", b"1")
            wait_until(lambda: seen == [("put", "/w/a")], 5, f"first event; saw {seen}")
            proc.restart()  # stop, keep the data, start on the same ports
            client.put("/w/b", b"2")
            client.delete("/w/a")
            wait_until(lambda: len(seen) == 3, 10, f"events after the restart; saw {seen}")
        assert seen == [("put", "/w/a"), ("put", "/w/b"), ("delete", "/w/a")]


def test_watch_callback_errors_do_not_end_the_watch(etcd_client, prefix, caplog):
    seen = []

    def flaky(ev):
        seen.append(ev.key)
        if len(seen) == 1:
            raise RuntimeError("callback bug")

    with Watch(etcd_client, f"{prefix}/", flaky, prefix=True) as w:
        assert w.created.wait(5)
        etcd_client.put(f"{prefix}/1", b"")
        etcd_client.put(f"{prefix}/2", b"")
        wait_until(lambda: len(seen) == 2, 5, f"both events; saw {seen}")
    assert "callback bug" in caplog.text


def test_lease_keeper_gives_up_at_its_deadline_when_etcd_is_gone(tmp_path):
    require_etcd()
    with EtcdProcess(data_dir=tmp_path / "k") as proc:
        lost = []
        keeper = LeaseKeeper(EtcdClient(proc.endpoint), 2, on_lost=lost.append)
        keeper.grant()
        proc.kill()
        killed = time.monotonic()
        wait_until(lambda: lost, 4.0, "on_lost once the lease deadline passed without etcd")
        assert time.monotonic() - killed <= 2.5 and not keeper.alive()
        assert "no refresh" in lost[0] and proc.endpoint in lost[0]
        keeper.stop()  # nothing to revoke: no error
