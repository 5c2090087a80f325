import pytest

from quillcache.types import CacheTier, Identity, KvLayout


def test_identity_digest_is_stable_and_field_sensitive():
    base = Identity(model="llama-3-8b", tokenizer="llama3", adapter="", tenant="acme")
    assert base.digest() == Identity(model="llama-3-8b", tokenizer="llama3", tenant="acme").digest()
    assert len(base.digest()) == 16
    variants = [
        Identity(model="llama-3-70b", tokenizer="llama3", tenant="acme"),
        Identity(model="llama-3-8b", tokenizer="llama3.1", tenant="acme"),
        Identity(model="llama-3-8b", tokenizer="llama3", adapter="sql-lora", tenant="acme"),
        base.with_tenant("globex"),
        Identity(model="llama-3-8b", tokenizer="llama3", tenant="acme", layout=KvLayout(dtype="float16")),
        Identity(model="llama-3-8b", tokenizer="llama3", tenant="acme", layout=KvLayout(block_size_tokens=32)),
        Identity(model="llama-3-8b", tokenizer="llama3", tenant="acme", layout=KvLayout(tp_rank=1, tp_size=2)),
    ]
    digests = {v.digest() for v in variants} | {base.digest()}
    assert len(digests) == len(variants) + 1


def test_identity_encoding_is_unambiguous():
    # Moving characters between adjacent fields must change the digest (length-prefixed encoding).
    a = Identity(model="ab", tokenizer="c")
    b = Identity(model="a", tokenizer="bc")
    assert a.digest() != b.digest()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model=""), "model"),
        (dict(model="m", tenant="x" * 300), "tenant"),
        (dict(model="m", adapter="a\nb"), "adapter"),
        (dict(model=3), "model"),
        (dict(model="m\ud800"), "model.*UTF-8"),  # a lone surrogate: canonical_bytes could not encode it
        (dict(model="m", tenant="t\udfff"), "tenant.*UTF-8"),
    ],
)
def test_identity_rejects_bad_fields(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Identity(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype="float64"), "dtype"),
        (dict(block_size_tokens=0), "block_size_tokens"),
        (dict(block_size_tokens=True), "block_size_tokens"),
        (dict(tp_size=0), "tp_size"),
        (dict(tp_rank=2, tp_size=2), "tp_rank"),
        (dict(tp_size=2**32), "tp_size"),  # canonical_bytes packs it into 4 bytes
    ],
)
def test_layout_rejects_bad_fields(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KvLayout(**kwargs)


def test_every_identity_that_constructs_has_a_digest():
    ident = Identity(model="m\u00e9\U0001f600", tenant="t", layout=KvLayout(tp_size=2**32 - 1, tp_rank=7))
    assert len(ident.digest()) == 16


def test_tier_order():
    assert CacheTier.GPU < CacheTier.DRAM < CacheTier.SSD < CacheTier.REMOTE
