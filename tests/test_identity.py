import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.identity.scope import (
    PUBLIC_TENANT,
    IdentityRegistry,
    ReuseReason,
    SharingPolicy,
    audit_reuse,
    make_identity,
    reuse_reason,
    validate_identity,
    validate_salt,
    validate_tenant_id,
)
from quillcache.hashing.blocks import hash_blocks
from quillcache.index.keys import ResidencyEntry
from quillcache.types import CacheTier, Identity, KvLayout

BASE = dict(model="llama-3-8b", tokenizer="llama3", adapter="", tenant="acme")


def ident(**kw) -> Identity:
    return make_identity(**{**BASE, **kw})


@pytest.mark.parametrize("good", ["a", "acme", "Tenant_01", "org.team:prod@eu-1", "x" * 128])
def test_tenant_and_salt_accept_the_documented_charset(good):
    assert validate_tenant_id(good) == good
    assert validate_salt(good) == good


@pytest.mark.parametrize("bad", ["", "x" * 129, "a b", "a/b", "tenant\n", "t\x00", "ténant", "a*b", "a;b"])
def test_tenant_and_salt_refuse_anything_else_naming_the_value(bad):
    for fn, kind in ((validate_tenant_id, "tenant"), (validate_salt, "salt")):
        with pytest.raises(ValueError) as exc:
            fn(bad)
        assert kind in str(exc.value) and repr(bad)[:20] in str(exc.value)


@pytest.mark.parametrize("bad", [None, 3, b"acme", ["acme"]])
def test_tenant_must_be_a_string(bad):
    with pytest.raises(TypeError, match="tenant must be str"):
        validate_tenant_id(bad)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(model=""), "model"),
        (dict(model="llama 3"), "model"),
        (dict(tokenizer="tok\t"), "tokenizer"),
        (dict(adapter="a" * 300), "adapter"),
        (dict(tenant=""), "tenant"),
        (dict(tenant="acme corp"), "tenant"),
    ],
)
def test_malformed_identity_fields_are_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        ident(**kw)


def test_validate_identity_refuses_public_and_non_identities():
    with pytest.raises(ValueError, match="tenant"):
        validate_identity(Identity(model="m", tenant=PUBLIC_TENANT))
    with pytest.raises(TypeError):
        validate_identity("acme")
    assert validate_identity(ident()) == ident()


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(), ReuseReason.SAME_SCOPE),
        (dict(tenant="globex"), ReuseReason.CROSS_TENANT),
        (dict(adapter="sql-lora"), ReuseReason.CROSS_ADAPTER),
        (dict(model="llama-3-70b"), ReuseReason.CROSS_MODEL),
        (dict(tokenizer="llama3-r2"), ReuseReason.CROSS_TOKENIZER),
        (dict(layout=KvLayout(dtype="float8_e4m3")), ReuseReason.LAYOUT_MISMATCH),
        (dict(layout=KvLayout(tp_rank=1, tp_size=2)), ReuseReason.LAYOUT_MISMATCH),
    ],
)
def test_reuse_reason_names_the_mismatching_field(kw, reason):
    got, mism = reuse_reason(ident(), ident(**kw), 7)
    assert got is reason and got.safe == (reason is ReuseReason.SAME_SCOPE)
    assert mism == (() if reason.safe else (reason,))


def test_several_mismatches_report_all_and_the_first_in_order():
    got, mism = reuse_reason(ident(), ident(tenant="globex", adapter="x-lora", model="qwen2.5-7b"), 1)
    assert got is ReuseReason.CROSS_MODEL
    assert mism == (ReuseReason.CROSS_MODEL, ReuseReason.CROSS_ADAPTER, ReuseReason.CROSS_TENANT)


def test_public_blocks_are_shared_only_as_registered():
    policy = SharingPolicy(public_blocks=frozenset({11, 12}))
    pub = ident().with_tenant(PUBLIC_TENANT)
    assert reuse_reason(ident(tenant="globex"), pub, 11, policy)[0] is ReuseReason.SHARED_PUBLIC
    assert reuse_reason(ident(), pub, 12, policy)[0] is ReuseReason.SHARED_PUBLIC
    # an unregistered block, another model, another adapter: never shared
    assert reuse_reason(ident(), pub, 13, policy)[0] is ReuseReason.CROSS_TENANT
    assert reuse_reason(ident(model="llama-3-70b"), pub, 11, policy)[0] is ReuseReason.CROSS_MODEL
    assert reuse_reason(ident(adapter="a-lora"), pub, 11, policy)[0] is ReuseReason.CROSS_ADAPTER
    # a tenant's private block is not public even if its hash is registered
    assert reuse_reason(ident(tenant="globex"), ident(), 11, policy)[0] is ReuseReason.CROSS_TENANT
    only = SharingPolicy(public_blocks=frozenset({11}), shared_tenants=frozenset({"acme"}))
    assert reuse_reason(ident(), pub, 11, only)[0] is ReuseReason.SHARED_PUBLIC
    assert reuse_reason(ident(tenant="globex"), pub, 11, only)[0] is ReuseReason.CROSS_TENANT


def test_policy_validation_and_public_prompt_registration():
    with pytest.raises(ValueError, match="public block hash=-1"):
        SharingPolicy(public_blocks=frozenset({-1}))
    with pytest.raises(TypeError):
        SharingPolicy(public_blocks=frozenset({"x"}))
    with pytest.raises(ValueError, match="tenant"):
        SharingPolicy(public_blocks=frozenset({1}), shared_tenants=frozenset({"bad tenant"}))
    p = SharingPolicy().with_public_prompt(list(range(40)), 16)
    assert len(p.public_blocks) == 2 and list(p.public_sorted) == sorted(p.public_blocks)
    with pytest.raises(ValueError, match="full block"):
        SharingPolicy().with_public_prompt([1, 2, 3], 16)


def test_scope_allowed_digests_and_write_digests():
    public = list(range(100, 132))
    h0, h1 = (int(h) for h in hash_blocks(public, 16))
    policy = SharingPolicy(public_blocks=frozenset({5})).with_public_prompt(public, 16)
    reg = IdentityRegistry(policy)
    sc = reg.scope(ident())
    assert sc.digest == ident().digest() and sc.public_digest == ident().with_tenant("").digest()
    assert sc.allowed.shape == (2, 16) and bytes(sc.allowed[0]) == sc.digest and sc.public_slot == 1
    assert not sc.allowed.flags.writeable
    # public only where the tokens ARE the registered prompt's; a hash registered without tokens
    # (5) and any request given without tokens are written under the own scope
    assert sc.write_digests([h0, h1, 6], public + [0] * 16) == [sc.public_digest, sc.public_digest, sc.digest]
    assert sc.write_digests([h0, h1]) == [sc.digest, sc.digest]
    assert sc.write_digests([5, 6], list(range(32))) == [sc.digest, sc.digest]
    assert sc.write_digests([], public) == []
    assert reg.scope(ident()) is sc  # cached
    assert reg.identity_of(sc.public_digest) == ident().with_tenant("")
    no_share = IdentityRegistry().scope(ident())
    assert no_share.public_digest is None and no_share.allowed.shape == (1, 16) and no_share.public_slot == -1
    with pytest.raises(ValueError):
        reg.scope(Identity(model="m", tenant="bad tenant"))


def test_public_mask_needs_the_registered_tokens_through_each_block():
    public = list(range(100, 164))  # 4 blocks of 16
    policy = SharingPolicy().with_public_prompt(public, 16)
    assert set(policy.public_prefixes) == policy.public_blocks and len(policy.public_blocks) == 4
    hashes = hash_blocks(public, 16)
    assert policy.public_mask(hashes, public, 16).tolist() == [True] * 4
    # one token changed in block 2: blocks 0-1 are still the registered prefix, 2-3 are not,
    # even when the hashes passed in are the registered ones (a forged collision)
    bad = public[:40] + [7] + public[41:]
    assert policy.public_mask(hashes, bad, 16).tolist() == [True, True, False, False]
    assert policy.public_mask(hashes, [7] + public[1:], 16).tolist() == [False] * 4
    assert policy.public_mask(hashes, np.array(public, dtype=np.uint64), 16).tolist() == [True] * 4
    with pytest.raises(ValueError, match="fewer than 4 full blocks"):
        policy.public_mask(hashes, public[:50], 16)
    # an excluded tenant writes its own scope even with the registered tokens
    only = IdentityRegistry(SharingPolicy(shared_tenants=frozenset({"acme"})).with_public_prompt(public, 16))
    globex = only.scope(ident(tenant="globex"))
    assert globex.write_digests(hashes, public) == [globex.digest] * 4
    acme = only.scope(ident())
    assert acme.write_digests(hashes, public) == [acme.public_digest] * 4


def test_public_prefix_registration_is_validated():
    policy = SharingPolicy().with_public_prompt(list(range(32)), 16)
    h0 = min(policy.public_prefixes)
    with pytest.raises(ValueError, match="already registered with other tokens"):
        SharingPolicy(public_prefixes={h0: b"\x00" * 16}).with_public_prompt(list(range(32)), 16)
    with pytest.raises(ValueError, match="16-byte digest"):
        SharingPolicy(public_prefixes={1: b"short"})
    with pytest.raises(TypeError, match="public_prefixes must be a mapping"):
        SharingPolicy(public_prefixes=[(1, b"\x00" * 16)])
    again = policy.with_public_prompt(list(range(48)), 16)  # extends the same prefix: no conflict
    assert len(again.public_blocks) == 3 and dict(again.public_prefixes).items() >= dict(policy.public_prefixes).items()


def test_audit_reuse_on_index_entries_names_reasons_and_refuses_unknown_digests():
    reg = IdentityRegistry(SharingPolicy(public_blocks=frozenset({1})))
    me, other, pub = ident(), ident(tenant="globex"), ident().with_tenant("")
    for i in (me, other, pub):
        reg.register(i)
    cands = [
        ResidencyEntry(1, "n0", CacheTier.GPU, me.digest(), 0, 0, 1),
        ResidencyEntry(2, "n0", CacheTier.GPU, other.digest(), 0, 0, 1),
        ResidencyEntry(1, "n1", CacheTier.DRAM, pub.digest(), 0, 0, 1),
        ResidencyEntry(3, "n1", CacheTier.DRAM, pub.digest(), 0, 0, 1),
        ResidencyEntry(4, "n1", CacheTier.SSD, b"\x01" * 16, 0, 0, 1),
        (5, ident(adapter="b-lora")),
    ]
    got = [(v.block_hash, v.reason) for v in audit_reuse(me, cands, registry=reg)]
    assert got == [
        (1, ReuseReason.SAME_SCOPE),
        (2, ReuseReason.CROSS_TENANT),
        (1, ReuseReason.SHARED_PUBLIC),
        (3, ReuseReason.CROSS_TENANT),
        (4, ReuseReason.UNKNOWN_IDENTITY),
        (5, ReuseReason.CROSS_ADAPTER),
    ]
    with pytest.raises(TypeError):
        audit_reuse(me, [object()], registry=reg)
    with pytest.raises(TypeError):
        audit_reuse(me, [(1, b"short")], registry=reg)


names = st.sampled_from(["m1", "m2"])
identities = st.builds(
    lambda m, t, a, ten, dt: make_identity(model=m, tokenizer=t, adapter=a, tenant=ten, layout=KvLayout(dtype=dt)),
    names, st.sampled_from(["t1", "t2"]), st.sampled_from(["", "lora"]), st.sampled_from(["a", "b"]),
    st.sampled_from(["bfloat16", "float8_e4m3"]),
)


@given(req=identities, cand=identities, public_cand=st.booleans(), h=st.integers(0, 3), shared=st.booleans())
def test_digest_guard_agrees_with_the_reference_audit(req, cand, public_cand, h, shared):
    """The planner's guard (digest in the scope's allowed rows; a public row only for registered
    blocks) accepts exactly the candidates the reason-building audit calls safe."""
    policy = SharingPolicy(public_blocks=frozenset({0, 1}), shared_tenants=None if shared else frozenset({"a"}))
    reg = IdentityRegistry(policy)
    scope = reg.scope(req)
    c = cand.with_tenant(PUBLIC_TENANT) if public_cand else cand
    reg.register(c)
    d = c.digest()
    rows = [bytes(r) for r in scope.allowed]
    guard_ok = d in rows and (rows.index(d) != scope.public_slot or h in policy.public_blocks)
    (verdict,) = audit_reuse(req, [(h, d)], registry=reg)
    assert guard_ok == verdict.safe


def test_a_sharing_policy_and_its_registry_pickle_and_copy_with_their_prompt_digests():
    import copy
    import pickle

    from quillcache.identity.scope import IdentityRegistry, SharingPolicy

    policy = SharingPolicy(shared_tenants=["acme"]).with_public_prompt(list(range(64)), 16)
    for clone in (pickle.loads(pickle.dumps(policy)), copy.deepcopy(policy)):
        assert clone == policy and dict(clone.public_prefixes) == dict(policy.public_prefixes)
        assert clone.public_mask(list(policy.public_prefixes), list(range(64)), 16).all()
    registry = pickle.loads(pickle.dumps(IdentityRegistry(policy)))
    assert dict(registry.policy.public_prefixes) == dict(policy.public_prefixes)
