"""Gateway review fixes (fix-gwb): a bounded identity registry (finding 5), config values refused by name (7),
tenant keys and salts (8) and engine-sim request fields (9). Everything runs in this process."""

from __future__ import annotations

import hashlib
import json

import pytest

from quillcache.cli import main
from quillcache.gateway.app import Gateway
from quillcache.gateway.config import ConfigError, EngineConfig, GatewayConfig, ModelConfig, config_from_dict
from quillcache.gateway.tenants import TenantKey, TenantTable, salt_for, scope_tenant
from quillcache.identity.scope import (IdentityRegistry, ReuseReason, SharingPolicy, audit_reuse, make_identity,
                                       public_identity)

BASE = {"engines": [{"url": "http://127.0.0.1:9"}]}


# ============================================================ 5. the identity registry is bounded (LRU)
def _salted(i: int, tenant: str = "acme"):
    return make_identity(model="m", tenant=scope_tenant(tenant, f"s{i}"))


def test_registry_memory_is_bounded_and_an_evicted_scope_comes_back_equal():
    reg = IdentityRegistry(SharingPolicy(public_blocks=frozenset({7})), capacity=8)
    first = reg.scope(_salted(0))
    for i in range(1, 500):
        reg.scope(_salted(i))
    assert len(reg) <= 16  # 2 * capacity digests, whatever the number of distinct salts
    assert reg.identity_of(first.digest) is None  # forgotten...
    again = reg.scope(_salted(0))  # ...and validated and registered again on demand, the same guard rows
    assert again.digest == first.digest and again.public_digest == first.public_digest
    assert again.allowed.tobytes() == first.allowed.tobytes() and again.public_slot == first.public_slot
    assert reg.identity_of(first.digest) == _salted(0) and reg.identity_of(first.public_digest) is not None
    # the hot scope survives a stream of one-off salts: every hit refreshes it and its public scope
    hot = _salted(1000)
    reg.scope(hot)
    for i in range(2000, 2100):
        reg.scope(hot)
        reg.scope(_salted(i))
    assert reg.identity_of(hot.digest()) == hot and reg.identity_of(public_identity(hot).digest()) is not None
    with pytest.raises(ValueError, match="capacity"):
        IdentityRegistry(capacity=0)


def test_audit_safety_does_not_depend_on_what_the_registry_still_remembers():
    policy = SharingPolicy(public_blocks=frozenset({7}))
    me = _salted(0)
    forgetful = IdentityRegistry(policy, capacity=1)  # has never seen me or my public scope
    other = _salted(1, tenant="globex")
    forgetful.register(other)
    cands = [(7, me.digest()), (7, public_identity(me).digest()), (8, public_identity(me).digest()),
             (7, other.digest()), (7, b"\x05" * 16)]
    got = [v.reason for v in audit_reuse(me, cands, registry=forgetful)]
    assert got == [ReuseReason.SAME_SCOPE, ReuseReason.SHARED_PUBLIC, ReuseReason.CROSS_TENANT,
                   ReuseReason.CROSS_TENANT, ReuseReason.UNKNOWN_IDENTITY]
    # the guard's verdict (digest in the scope's allowed rows; the public row only for a shared block)
    # and the audit's agree for a registry that evicts between building the scope and auditing
    sc = forgetful.scope(me)
    for i in range(5):
        forgetful.scope(_salted(100 + i))
    rows = [bytes(r) for r in sc.allowed]
    for h, d in cands:
        guard_ok = d in rows and (rows.index(d) != sc.public_slot or h in policy.public_blocks)
        (verdict,) = audit_reuse(me, [(h, d)], registry=forgetful)
        assert guard_ok == verdict.safe, (h, d)


def test_gateway_identity_lookup_keeps_the_registry_bounded(monkeypatch):
    # every registry built from here on (the gateway's planner's) defaults to 32 scopes
    monkeypatch.setattr(IdentityRegistry.__init__, "__kwdefaults__", {"capacity": 32})
    cfg = GatewayConfig(engines=(EngineConfig(url="http://127.0.0.1:9", name="e0"),), index_kind="flat",
                        models=(ModelConfig(name="m"),))
    gw = Gateway(cfg, TenantTable({"sk-aaaaaaaa": TenantKey("t1")}))
    model = gw.models["m"]
    first = gw._identity(model, scope_tenant("t1", "s0"))
    for i in range(1, 400):
        gw._identity(model, scope_tenant("t1", f"s{i}"))
    registry = gw.decider.planner.registry
    assert len(registry) <= 64, len(registry)
    assert gw.decider.scope(first).digest == first.digest()  # an evicted salt still gets its own scope


# ============================================================ 7. config values refused by name
@pytest.mark.parametrize(("extra", "needle"), [
    ({"seed": "abc"}, "seed must be an integer"),
    ({"seed": -1}, "seed=-1 must be >= 0"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"seed": True}, "seed must be an integer"),
    ({"index_kind": "bogus"}, "index_kind 'bogus' is not a registered index backend"),
    ({"index_kind": 5}, "index_kind 5 is not a registered index backend"),
    ({"index_kind": "rocksdb"}, "index_kind 'rocksdb': the gateway keeps its index in memory"),
    ({"models": {"m": {"name": "other"}}}, "models['m']: 'name' is not a model entry key"),
    ({"chat_template": 5}, "chat_template must be null or a tokenizer_config.json path"),
    ({"router": []}, "router [] is not registered"),
])
def test_config_refuses_bad_values_naming_the_field(extra, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, **extra})
    assert needle in str(e.value), str(e.value)


def test_config_accepts_the_good_values():
    c = config_from_dict({**BASE, "seed": 0, "index_kind": "flat", "models": {"m": {"base": "b", "adapter": "a"}}})
    assert (c.seed, c.index_kind, [(m.name, m.base, m.adapter) for m in c.models]) == (0, "flat", [("m", "b", "a")])
    assert config_from_dict(BASE).index_kind == "art" and config_from_dict({**BASE, "seed": None}).seed is None


def test_cli_refuses_a_bad_index_kind_with_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    import quillcache.gateway.server

    monkeypatch.setattr(quillcache.gateway.server, "serve", lambda *a, **kw: pytest.fail("served a bad config"))
    monkeypatch.setenv("QUILLCACHE_GATEWAY_KEYS", "sk-long-enough=acme")
    conf = tmp_path / "c.json"
    for extra, needle in (({"index_kind": "bogus"}, "index_kind 'bogus'"), ({"seed": "abc"}, "seed must be")):
        conf.write_text(json.dumps({**BASE, **extra}))
        assert main(["gateway", "--config", str(conf)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err


# ============================================================ 8. tenants: duplicate env keys, scheme case, long secrets
def test_env_keys_refuse_a_duplicate_key_without_quoting_it():
    env = {"QUILLCACHE_GATEWAY_KEYS": "sk-shared-key1=acme,sk-shared-key1=globex"}
    with pytest.raises(ConfigError, match="QUILLCACHE_GATEWAY_KEYS entry 1: duplicate key") as e:
        TenantTable.from_env(env)
    assert "sk-shared-key1" not in str(e.value)


def test_bearer_scheme_is_case_insensitive():
    t = TenantTable.from_env({"QUILLCACHE_GATEWAY_KEYS": "sk-shared-key1=acme"})
    for header in ("Bearer sk-shared-key1", "bearer sk-shared-key1", "BEARER sk-shared-key1",
                   "Bearer  sk-shared-key1"):
        assert t.lookup(header) == TenantKey("acme"), header
    for header in ("Basic sk-shared-key1", "Bearer", "bearer ", "Bearersk-shared-key1", "sk-shared-key1", ""):
        assert t.lookup(header) is None, header


def test_every_byte_of_a_long_secret_counts_and_short_secrets_keep_their_salts():
    a = b"s" * 64
    assert salt_for("acme", a + b"X") != salt_for("acme", a + b"Y")
    assert salt_for("acme", a + b"X") != salt_for("acme", a)
    # a secret within BLAKE2b's 64-byte key keeps the salt deployed replicas already send
    for secret in (b"", b"k" * 10, a):
        want = "qc-" + hashlib.blake2b(b"acme", digest_size=16, key=secret, person=b"qc-gw-salt").hexdigest()
        assert salt_for("acme", secret) == want


# ============================================================ 9. engine-sim: only null is an absent field
@pytest.fixture(scope="module")
def sim():
    from starlette.testclient import TestClient

    from quillcache.enginesim.app import build_app
    from quillcache.enginesim.config import EngineSimConfig

    with TestClient(build_app(EngineSimConfig(fixed_ttft_ms=0, decode_ms_per_token=0, gpu_blocks=64)),
                    raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize(("extra", "status", "param"), [
    ({"stream": 0}, 400, "stream"),
    ({"stream": ""}, 400, "stream"),
    ({"model": 0}, 400, "model"),
    ({"model": ""}, 404, "model"),
    ({"stream_options": []}, 400, "stream_options"),
    ({"stream_options": 0}, 400, "stream_options"),
    ({"stream": True, "stream_options": 0}, 400, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options"),
])
def test_engine_sim_refuses_falsy_wrong_types_naming_the_field(sim, extra, status, param):
    r = sim.post("/v1/completions", json={"model": "quillcache-sim", "prompt": "hello", "max_tokens": 2, **extra})
    assert r.status_code == status, (extra, r.status_code, r.text)
    assert r.json()["error"]["param"] == param


def test_engine_sim_takes_null_as_absent(sim):
    body = {"prompt": "hello", "max_tokens": 2, "model": None, "stream": None, "stream_options": None}
    r = sim.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["model"] == "quillcache-sim", r.text
    r = sim.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": True,
                                          "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and '"choices":[]' not in r.text, r.text  # include_usage null: no usage chunk
    r = sim.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": True,
                                          "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"choices":[]' in r.text, r.text
