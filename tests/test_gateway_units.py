"""Gateway pieces without servers: config and key-file errors, tenant salts and limits, the residency
tracker's speculative / confirmed / approximate entries (injected clock, no sleeps), and the decision
path's isolation and next-best fallback over the real planner and index."""

from __future__ import annotations

import asyncio
import json
import random
import re

import numpy as np
import pytest

from quillcache.gateway.app import Gateway
from quillcache.gateway.config import (ConfigError, EngineConfig, ModelConfig, config_from_dict, load_config,
                                       parse_engine_urls)
from quillcache.gateway.decision import Decider, NoWorkerError
from quillcache.gateway.proxying import sse_event_end
from quillcache.gateway.residency import EntryState, ResidencyTracker
from quillcache.gateway.tenants import TenantKey, TenantLimiter, TenantTable, salt_for, scope_tenant
from quillcache.httpserve.jsonbody import BodyError, loads_strict
from quillcache.hashing import hash_blocks
from quillcache.identity.scope import SALT_RE, make_identity
from quillcache.index import open_index
from quillcache.types import KvLayout

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------------------------------------- config
def test_engine_urls_and_config_errors_name_the_field(tmp_path):
    engines = parse_engine_urls("http://127.0.0.1:8001, http://127.0.0.1:8002")
    assert [e.name for e in engines] == ["e0", "e1"] and engines[0].prefix_state == "approximate"
    with pytest.raises(ConfigError, match="not a http/https URL"):
        parse_engine_urls("ftp://x:1")
    with pytest.raises(ConfigError, match="duplicate engine urls"):
        config_from_dict({}, engines=parse_engine_urls("http://a:1,http://a:1"))
    with pytest.raises(ConfigError, match=r"limits: limits.max_body_bytes=0"):
        config_from_dict({"limits": {"max_body_bytes": 0}}, engines=engines)
    with pytest.raises(ConfigError, match=r"unknown config keys \['bogus'\]"):
        config_from_dict({"bogus": 1}, engines=engines)
    with pytest.raises(ConfigError, match="kv_events_replay needs kv_events"):
        EngineConfig(url="http://a:1", kv_events_replay="tcp://127.0.0.1:5")
    e = EngineConfig(url="http://a:1", kv_events="tcp://127.0.0.1:5")
    assert e.prefix_state == "events" and e.name == "a:1"
    assert config_from_dict({"router": "dynamo", "router_options": {"prefill_load_scale": 4.0}},
                            engines=engines).router_options == {"prefill_load_scale": 4.0}
    assert config_from_dict({}, engines=engines).router == "cache_aware"  # the default, by the gateway study
    with pytest.raises(ConfigError, match=r"router_options for 'cache_aware'.*prefill_load_scale"):
        config_from_dict({"router_options": {"prefill_load_scale": 4.0}}, engines=engines)
    with pytest.raises(ConfigError, match=r"router 'nope' is not registered; known: \['cache_aware', 'dynamo'"):
        config_from_dict({"router": "nope"}, engines=engines)
    with pytest.raises(ConfigError, match=r"router_options for 'cache_aware'.*\['bogus'\]"):
        config_from_dict({"router_options": {"bogus": 1}}, engines=engines)
    p = tmp_path / "c.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_config(p)
    p.write_text(json.dumps({"engines": [{"url": "http://127.0.0.1:9"}], "models": {"m": {}, "m-sql": {
        "base": "m", "adapter": "m-sql"}}, "timeouts": {"first_byte_s": 0.5}}))
    cfg = load_config(p)
    assert cfg.timeouts.first_byte_s == 0.5 and [m.adapter for m in cfg.models] == ["", "m-sql"]


def test_key_table_from_file_and_env(tmp_path):
    p = tmp_path / "keys.json"
    p.write_text(json.dumps({"keys": [{"key": "sk-aaaaaaaa", "tenant": "acme", "max_concurrency": 3},
                                      {"key": "sk-bbbbbbbb", "tenant": "beta"}]}))
    t = TenantTable.from_file(p)
    assert t.lookup("Bearer sk-aaaaaaaa").tenant == "acme" and t.lookup("Bearer sk-aaaaaaaa").max_concurrency == 3
    assert t.lookup("Bearer sk-nope0000") is None and t.lookup(None) is None and t.lookup("sk-aaaaaaaa") is None
    p.write_text(json.dumps({"keys": [{"key": "sk-aaaaaaaa", "tenant": "a:b"}]}))
    with pytest.raises(ConfigError, match="tenant 'a:b'"):
        TenantTable.from_file(p)
    env = TenantTable.from_env({"QUILLCACHE_GATEWAY_KEYS": "sk-cccccccc=gamma,sk-dddddddd=delta"})
    assert env.tenants == ["delta", "gamma"]
    with pytest.raises(ConfigError, match="no API keys"):
        TenantTable.from_env({})


def test_salts_are_per_scope_valid_and_keyed():
    a, b = salt_for("acme"), salt_for("beta")
    assert a != b and SALT_RE.fullmatch(a) and salt_for("acme") == a
    assert salt_for("acme", b"secret") != a
    assert scope_tenant("acme", None) == "acme" and scope_tenant("acme", "s1") == "acme:s1"
    with pytest.raises(ValueError, match="salt"):
        scope_tenant("acme", "bad salt")


def test_tenant_limiter_never_exceeds_its_limit():
    lim = TenantLimiter(2)
    assert lim.try_acquire("a", None) and lim.try_acquire("a", None) and not lim.try_acquire("a", None)
    assert lim.try_acquire("a", 3) and lim.try_acquire("b", 1) and not lim.try_acquire("b", 1)
    for _ in range(3):
        lim.release("a")
    lim.release("b")
    assert lim.total == 0


# ---------------------------------------------------------------------------------------------- residency
def _tracker(modes=None, ttl_s=2.0, cap=None):
    clock = Clock()
    index = open_index("flat")
    modes = modes or {"e0": "events", "e1": "events"}
    tr = ResidencyTracker(index, modes, ttl_s=ttl_s, clock=clock, approx_capacity_blocks=cap)
    return tr, index, clock


D_A = make_identity(model="m", tenant="a", layout=KvLayout(block_size_tokens=BS)).digest()
D_B = make_identity(model="m", tenant="b", layout=KvLayout(block_size_tokens=BS)).digest()


def test_speculation_expires_unless_confirmed():
    tr, index, clock = _tracker()
    h = [11, 12, 13]
    assert len(tr.speculate("e0", h, [D_A] * 3)) == 3
    assert tr.count("e0", EntryState.PENDING) == 3
    assert tr.stored("e0", [901, 902], [11, 12], None) == 2  # the engine stored two of the three
    clock.t += 2.0
    assert tr.expire() == 1  # block 13 was never stored
    assert {(e.block_hash, e.identity) for e in index.entries_on_node("e0")} == {(11, D_A), (12, D_A)}
    tr.check()
    assert tr.removed("e0", [902]) == 1 and tr.removed("e0", [999]) == 0
    assert [e.block_hash for e in index.entries_on_node("e0")] == [11]
    tr.check()


def test_events_attribute_by_parent_or_a_single_scope_never_across_engines():
    tr, index, clock = _tracker()
    tr.speculate("e0", [1, 2], [D_A, D_A])
    assert tr.stored("e0", [50], [1], None) == 1  # one scope waits for chain 1 on e0: it is A's
    assert tr.stored("e0", [51], [2], 50) == 1  # the child follows its parent's scope
    # a store on e1 confirms nothing of e0 and writes nothing (no speculation there)
    assert tr.stored("e1", [70], [1], None) == 0 and tr.stats.unattributed == 1
    assert index.entries_on_node("e1") == []
    # a continuation the gateway never routed inherits its parent's scope
    assert tr.stored("e0", [52], [3], 51) == 1 and tr.stats.inherited == 1
    tr.check()
    assert tr.cleared("e0") == 3 and index.entries_on_node("e0") == []
    tr.check()


def test_a_root_store_two_scopes_wait_for_is_nobodys():
    """Tenants A and B both wait for chain 5 on e0: a store of it could be either's, so it confirms neither
    (else B's cached_tokens could come to depend on A's traffic); both speculations expire."""
    tr, index, clock = _tracker()
    tr.speculate("e0", [5], [D_A])
    tr.speculate("e0", [5], [D_B])
    assert tr.stored("e0", [80], [5], None) == 0 and tr.stats.ambiguous == 1
    assert tr.stored("e0", [81], [6], 80) == 0  # nor its children
    clock.t += 3
    assert tr.expire() == 2 and index.entries_on_node("e0") == []
    tr.check()


def test_retract_takes_back_only_unconfirmed_entries():
    tr, index, clock = _tracker({"e0": "events", "e1": "approximate"})
    recs = tr.speculate("e0", [1, 2, 3], [D_A] * 3)
    tr.stored("e0", [50], [1], None)  # block 1 confirmed meanwhile: it stays
    assert tr.retract(recs) == 2
    assert [e.block_hash for e in index.entries_on_node("e0")] == [1]
    assert tr.retract(tr.speculate("e1", [7, 8], [D_B] * 2)) == 2 and index.entries_on_node("e1") == []
    clock.t += 10
    assert tr.expire() == 0  # the retracted speculations left nothing to expire
    tr.check()


def test_already_held_blocks_are_not_speculated_again():
    tr, index, clock = _tracker()
    tr.speculate("e0", [1, 2], [D_A, D_A])
    tr.stored("e0", [50, 51], [1, 2], None)
    assert len(tr.speculate("e0", [1, 2, 3], [D_A] * 3)) == 1  # only the new block
    clock.t += 5
    assert tr.expire() == 1
    assert tr.count("e0", EntryState.CONFIRMED) == 2
    tr.check()


def test_approximate_engines_keep_an_lru_of_what_was_routed():
    tr, index, clock = _tracker({"e0": "approximate"}, cap={"e0": 4})
    tr.speculate("e0", [1, 2, 3], [D_A] * 3)
    clock.t += 100
    assert tr.expire() == 0 and tr.count("e0", EntryState.APPROX) == 3  # no TTL
    tr.speculate("e0", [1, 9], [D_A, D_A], reused_blocks=1)  # block 1 was a hit: refreshed
    tr.speculate("e0", [7], [D_B])
    held = {e.block_hash for e in index.entries_on_node("e0")}
    assert held == {1, 3, 9, 7}  # block 2, the least recently used, was evicted
    assert tr.stored("e0", [5], [1], None) == 0  # events are ignored for an approximate engine
    tr.check()


def test_random_event_sequences_keep_index_and_tracker_equal():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    tr, index, clock = _tracker()
    next_e = [1000]
    stored_by_engine = {"e0": [], "e1": []}
    for _ in range(400):
        op = rng.random()
        eng = rng.choice(["e0", "e1"])
        if op < 0.35:
            n = rng.randint(1, 4)
            tr.speculate(eng, [rng.randint(1, 12) for _ in range(n)], [rng.choice([D_A, D_B])] * n)
        elif op < 0.6:
            n = rng.randint(1, 3)
            es = list(range(next_e[0], next_e[0] + n))
            next_e[0] += n
            parent = rng.choice(stored_by_engine[eng]) if stored_by_engine[eng] and rng.random() < 0.5 else None
            tr.stored(eng, es, [rng.randint(1, 12) for _ in range(n)], parent)
            stored_by_engine[eng].extend(es)
        elif op < 0.8 and stored_by_engine[eng]:
            tr.removed(eng, rng.sample(stored_by_engine[eng], min(2, len(stored_by_engine[eng]))))
        elif op < 0.85:
            tr.cleared(eng)
        else:
            clock.t += rng.random()
            tr.expire()
        try:
            tr.check()
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from None


# ---------------------------------------------------------------------------------------------- decisions
def _decider(n=3, modes=None, **router):
    index = open_index("flat")
    names = [f"e{i}" for i in range(n)]
    clock = Clock()
    tr = ResidencyTracker(index, modes or {w: "events" for w in names}, clock=clock)
    return Decider(index, names, tr, block_size_tokens=BS, seed=7, **router), tr, clock


def test_router_options_reach_the_planners_router():
    dec, tr, clock = _decider(2, router_options={"prefill_load_scale": 4.0, "temperature": 0.5})
    assert dec.planner.router.prefill_load_scale == 4.0 and dec.planner.router.temperature == 0.5
    dec, tr, clock = _decider(2, router="prefix_affinity")
    assert dec.planner.router.name == "prefix_affinity"
    d = dec.decide(_ident("a"), list(range(1, 3 * BS)), 0)
    d.lease.release()


def _ident(tenant):
    return make_identity(model="m", tenant=tenant, layout=KvLayout(block_size_tokens=BS))


def test_fully_cached_prompt_reports_one_block_less_like_the_engine():
    dec, tr, clock = _decider(1)
    tokens = list(range(1, 3 * BS + 1))  # exactly three blocks
    tr.speculate("e0", hash_blocks(tokens, BS), [dec.scope(_ident("a")).digest] * 3)
    d = dec.decide(_ident("a"), tokens, 0)
    assert d.cached_tokens == 2 * BS  # the engine recomputes the last token, hence the last block
    d.lease.release()


def test_decision_counts_load_and_speculates_then_hits():
    dec, tr, clock = _decider()
    tokens = list(range(1, 4 * BS + 3))
    d1 = dec.decide(_ident("a"), tokens, 8)
    assert d1.cached_tokens == 0 and d1.reason == "no_hit" and d1.lease.live
    assert int(dec.planner.loads.inflight[d1.worker_index]) == 1
    d1.lease.release()
    hashes = hash_blocks(tokens, BS)
    tr.stored(d1.worker, list(range(500, 504)), list(hashes), None)
    d2 = dec.decide(_ident("a"), tokens, 8)
    assert d2.worker == d1.worker and d2.cached_tokens == 4 * BS and d2.reason == "prefix_hit"
    d2.lease.release()
    assert dec.planner.loads.inflight.sum() == 0


def test_other_tenants_history_changes_nothing_a_tenant_sees():
    tokens = list(range(1, 6 * BS))
    seen = []
    for a_history in (False, True):
        dec, tr, clock = _decider()
        if a_history:  # tenant a has the prompt cached on every engine
            for w in dec.names:
                tr.speculate(w, hash_blocks(tokens, BS), [dec.scope(_ident("a")).digest] * 5)
        d = dec.decide(_ident("b"), tokens, 4)
        seen.append((d.worker, d.cached_tokens, d.timing_class, d.reason))
        d.lease.release()
    assert seen[0] == seen[1] and seen[0][1] == 0


def test_excluded_planner_choice_falls_back_to_next_best_with_own_overlap():
    dec, tr, clock = _decider(3)
    tokens = list(range(1, 4 * BS + 2))
    h = hash_blocks(tokens, BS)
    dig = dec.scope(_ident("a")).digest
    tr.speculate("e1", h, [dig] * 4)  # all four blocks on e1
    tr.speculate("e2", h[:2], [dig] * 2)  # two on e2
    d = dec.decide(_ident("a"), tokens, 0)
    assert d.worker == "e1" and d.cached_tokens == 4 * BS
    d.lease.release()
    d = dec.decide(_ident("a"), tokens, 0, excluded={1}, why_excluded="retry")
    assert d.worker == "e2" and d.cached_tokens == 2 * BS and d.reason == "retry"
    assert int(dec.planner.loads.active_prefill_tokens[2]) == 2 * BS + 1
    d.lease.release()
    with pytest.raises(NoWorkerError):
        dec.decide(_ident("a"), tokens, 0, excluded={0, 1, 2})
    assert dec.planner.loads.inflight.sum() == 0 and np.all(dec.planner.loads.active_prefill_tokens == 0)


# ---------------------------------------------------------------------------------------------- peers
# the peer link's wire format and garbage refusal: tests/test_gateway_attribution.py


def test_events_engines_get_a_bounded_speculation_and_events_fill_in_the_rest():
    dec, tr, clock = _decider(1)
    dec.speculative_max_blocks = 2
    tokens = list(range(1, 6 * BS + 2))
    d = dec.decide(_ident("a"), tokens, 0)
    d.lease.release()
    assert tr.count("e0", EntryState.PENDING) == 2
    h = hash_blocks(tokens, BS)
    assert tr.stored("e0", list(range(900, 906)), list(h), None) == 6  # the root by speculation, the rest by parent
    assert tr.count("e0", EntryState.CONFIRMED) == 6 and tr.stats.inherited == 4
    d = dec.decide(_ident("a"), tokens, 0)
    assert d.cached_tokens == 6 * BS
    d.lease.release()
    tr.check()


# ------------------------------------------------------------------------------ model names, JSON, SSE
def test_model_identity_names_outside_the_identity_rule_are_config_errors_naming_the_model():
    engines = parse_engine_urls("http://127.0.0.1:9")
    for models, fragment in (({"Llama 3 8B": {}}, r"models\['Llama 3 8B'\]: model 'Llama 3 8B': its name"),
                             ({"qwen~2.5": {}}, r"model 'qwen~2.5': its name"),
                             ({"x": {"base": "b c"}}, r"model 'x': base 'b c' must be 1-256 characters"),
                             ({"x": {"base": "b", "adapter": "my adapter"}}, r"model 'x': adapter 'my adapter'")):
        with pytest.raises(ConfigError, match=fragment):
            config_from_dict({"models": models}, engines=engines)
    with pytest.raises(ConfigError, match="model 'bad name'"):
        ModelConfig(name="bad name")
    # only the identity's fields follow the rule: a served name with a space and a valid base is fine
    m = config_from_dict({"models": {"Llama 3 8B": {"base": "llama-3-8b", "adapter": "sql/v2+x=1"}}},
                         engines=engines).models[0]
    assert (m.name, m.base, m.adapter) == ("Llama 3 8B", "llama-3-8b", "sql/v2+x=1")


def _gateway(models: dict | None = None) -> Gateway:
    cfg = config_from_dict({"models": models or {}}, engines=parse_engine_urls("http://127.0.0.1:9"))
    return Gateway(cfg, TenantTable({"sk-units-0001": TenantKey(tenant="tenant-u", max_concurrency=4)}))


def test_discovery_skips_models_outside_the_identity_rule():
    gw = _gateway()
    listed = {"object": "list", "data": [
        {"id": "Llama 3 8B"}, {"id": "good-base"}, {"id": "good-lora", "parent": "good-base"},
        {"id": "bad lora", "parent": "good-base"}, {"id": "lora-of-bad", "parent": "bad base"}]}

    async def get_json(url):
        return listed

    gw.upstream.get_json = get_json
    gw.healthy = [True]
    try:
        asyncio.run(gw._discover_models())
        assert sorted(gw.models) == ["good-base", "good-lora"]
        assert (gw.models["good-lora"].base, gw.models["good-lora"].adapter) == ("good-base", "good-lora")
    finally:
        gw.index.close()


def _asgi_post(gw: Gateway, path: str, body: dict, key: str = "sk-units-0001") -> tuple[int, dict]:
    """One POST through the gateway's ASGI entry, in process (only for refusals made before any upstream)."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    sent = []
    inbox = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive():
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(gw.asgi(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def test_a_model_whose_identity_is_malformed_is_a_404_naming_it_never_a_500():
    gw = _gateway({"ok-model": {}})
    try:
        bad = ModelConfig(name="ok-model")
        object.__setattr__(bad, "base", "Llama 3 8B")  # what ModelConfig refuses, had it got through
        gw.models["Llama 3 8B"] = bad
        status, err = _asgi_post(gw, "/v1/completions", {"model": "Llama 3 8B", "prompt": "hello", "max_tokens": 1})
        assert status == 404, err
        assert err["error"]["type"] == "model_not_found" and err["error"]["code"] == 404
        assert err["error"]["message"].startswith("the model 'Llama 3 8B' cannot be served here: model=")
        assert gw.limiter.total == 0
    finally:
        gw.index.close()


def test_numbers_that_overflow_a_float_are_refused_naming_their_field():
    for raw, fragment in ((b'{"model": "m", "temperature": 1e400}', "field 'temperature': the number 1e400"),
                          (b'{"a": {"b": [1, 2.5, -1e999]}}', "field 'a.b[2]': the number -1e999"),
                          (b'[0.5, 1E+309]', "field '[1]': the number 1E+309"),
                          (b'1e400', "request body: the number 1e400"),
                          (b'{"x": 1e400, "y": ', "request body: the number 1e400")):  # invalid after it
        with pytest.raises(BodyError, match=re.escape(fragment) + " is out of range"):
            loads_strict(raw)
    v = loads_strict(b'{"t": 1.7976931348623157e308, "u": 1e-400, "n": -0.0, "i": 100000000000000000000}')
    assert v == {"t": 1.7976931348623157e308, "u": 0.0, "n": -0.0, "i": 10 ** 20}
    json.dumps(v, allow_nan=False)  # what the gateway forwards is JSON


def _event_ends(stream: bytes) -> list[int]:
    """Reference: offsets just past each blank line of an SSE byte stream (line ends LF, CR, CRLF)."""
    ends, i, line_start = [], 0, 0
    while i < len(stream):
        c = stream[i:i + 1]
        if c in (b"\r", b"\n"):
            blank = i == line_start
            i += 2 if stream[i:i + 2] == b"\r\n" else 1
            if blank:
                ends.append(i)
            line_start = i
        else:
            i += 1
    return ends


def test_sse_event_ends_are_found_whatever_the_line_ends():
    seed = 20240611
    rng = random.Random(seed)
    for case in range(300):
        style = rng.choice(["lf", "cr", "crlf", "mixed"])
        parts = []
        for e in range(rng.randint(1, 4)):
            for _ in range(rng.randint(1, 3)):
                eol = {"lf": "\n", "cr": "\r", "crlf": "\r\n"}.get(style) or rng.choice(["\n", "\r", "\r\n"])
                parts.append(f"data: {rng.choice(['', 'x', 'é', '{}'])}{e}" + eol)
            parts.append({"lf": "\n", "cr": "\r", "crlf": "\r\n"}.get(style) or rng.choice(["\n", "\r", "\r\n"]))
        stream = "".join(parts).encode()
        ends = _event_ends(stream)
        for n in range(len(stream) + 1):
            prefix = stream[:n]
            want = max([b for b in ends if b <= n], default=0)
            if n + 1 in ends and stream[n - 1:n + 1] == b"\r\n":
                want = n  # the blank line's CR arrived, its LF not yet: the event is complete already
            assert sse_event_end(prefix) == want, (seed, case, prefix)
