"""A write whose request never left the client (no connection could be made: the leader it was sent to had just
died) is resent until ``retry_s``, like a read: it cannot have run. Before, only reads were resent, so every
failover cost a client through etcd discovery three or four write errors (review of 2026-11-29, /tmp/s35/ha M1).
A write that timed out once sent is still not resent (it may have run). Also the etcd endpoint and candidate
checks (L2, L3)."""

from __future__ import annotations

import pytest
from etcd_fixture import etcd, etcd_client, prefix  # noqa: F401

from quillcache.cluster.client import Backoff
from quillcache.master.client import MasterClient
from quillcache.rpc import RpcTimeoutError
from quillcache.rpc.stream import _not_sent


class _Flaky:
    """An rpc that fails the first ``fails`` calls with ``error()``, then answers."""

    def __init__(self, fails: int, error) -> None:
        self.fails, self.error, self.calls = fails, error, []

    def call(self, method, *args, **kwargs):
        self.calls.append(method)
        if len(self.calls) <= self.fails:
            raise self.error()
        return None


def _client(rpc) -> MasterClient:
    return MasterClient(_rpc=rpc, retry_s=5.0, backoff=Backoff(initial_s=0.001, max_s=0.002))


def test_a_write_never_sent_is_resent_until_it_runs():
    rpc = _Flaky(3, lambda: _not_sent("remove to qtcp://127.0.0.1:1: cannot connect (nobody accepts there)"))
    _client(rpc).remove("k")
    assert rpc.calls == ["remove"] * 4


def test_a_write_that_timed_out_once_sent_is_not_resent():
    rpc = _Flaky(1, lambda: RpcTimeoutError("remove: no reply within 5 s"))
    with pytest.raises(RpcTimeoutError, match="no reply"):
        _client(rpc).remove("k")
    assert rpc.calls == ["remove"]


@pytest.mark.parametrize("endpoint, why", [
    ("https://127.0.0.1:2379", "only plain http://"), ("127.0.0.1:2379,127.0.0.1:2380", "is a list"),
    ("bad host:2379", "not 'host:port'"), ("127.0.0.1:\u00b2", "not 'host:port'"), ("127.0.0.1:\u0663\u0663", "not"),
])
def test_a_malformed_etcd_endpoint_is_refused_naming_it(endpoint, why):
    from quillcache.cluster.client import parse_endpoint

    with pytest.raises(ValueError, match=why):
        parse_endpoint(endpoint)


@pytest.mark.parametrize("endpoint, want", [("127.0.0.1:2379", ("127.0.0.1", 2379)),
                                            ("http://localhost:2379/", ("localhost", 2379)),
                                            ("[::1]:2379", ("::1", 2379)), ("etcd-0.svc:2379", ("etcd-0.svc", 2379))])
def test_well_formed_etcd_endpoints_still_parse(endpoint, want):
    from quillcache.cluster.client import parse_endpoint

    assert parse_endpoint(endpoint) == want


@pytest.mark.parametrize("argv, why", [
    (["--etcd", "https://127.0.0.1:2379"], "only plain http://"),
    (["--etcd", "127.0.0.1:2379", "--candidate", ""], "--candidate is empty"),
])
def test_the_master_refuses_a_bad_ha_flag_in_one_line_before_starting(tmp_path, capsys, monkeypatch, argv, why):
    from quillcache.cli import main
    from quillcache.master import ha

    def reached(*args, **kwargs):  # the old code started a master that retried etcd for ever
        raise AssertionError("a master was started for a refused flag")

    monkeypatch.setattr(ha, "HaMaster", reached)
    rc = main(["master", "--data-dir", str(tmp_path / "d"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and why in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_client_says_which_key_on_which_etcd_holds_no_leader_record(etcd, etcd_client, prefix):  # noqa: F811
    """Garbage in the election key gave a client a decode error that named neither the key nor the endpoint
    (/tmp/s35/ha, with M2): it now waits for a leader as when the key is missing, and says both when none came."""
    from quillcache.cluster.descriptors import election_key
    from quillcache.master import NotLeaderError

    key = election_key("master", prefix)
    etcd_client.put(key, b"\xff\x00garbage")
    with pytest.raises(NotLeaderError) as info:
        MasterClient(etcd=etcd.endpoint, prefix=prefix, retry_s=0.5)
    assert key in str(info.value) and etcd.endpoint in str(info.value) and "no leader record" in str(info.value)
