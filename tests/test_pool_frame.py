"""The pool's object frame (``quillcache.pool.frame``): a round trip returns the payload; any flipped
byte, another key, a truncated or extended copy is refused with ``CorruptObjectError``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.pool.errors import CorruptObjectError
from quillcache.pool.frame import TRAILER_BYTES, check, digest_of, encode_trailer, frame, framed_size

keys = st.text(min_size=1, max_size=40)
payloads = st.binary(min_size=0, max_size=4096)


@given(keys, payloads)
def test_round_trip(key, payload):
    f = frame(key, payload)
    assert len(f) == framed_size(len(payload)) == len(payload) + TRAILER_BYTES
    assert bytes(check(f, key)) == payload
    assert bytes(check(memoryview(bytearray(f)), key)) == payload
    assert encode_trailer(key, memoryview(payload)) == f[len(payload):]


@given(keys, payloads, st.data())
@settings(max_examples=300)
def test_any_flipped_byte_is_refused(key, payload, data):
    f = bytearray(frame(key, payload))
    i = data.draw(st.integers(0, len(f) - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    f[i] ^= 1 << bit
    with pytest.raises(CorruptObjectError):
        check(f, key)


@given(keys, keys, payloads)
def test_another_key_is_refused(key, other, payload):
    if other == key:
        return
    with pytest.raises(CorruptObjectError):
        check(frame(key, payload), other)


@given(keys, payloads, st.data())
def test_truncated_or_extended_is_refused(key, payload, data):
    f = frame(key, payload)
    cut = data.draw(st.integers(0, len(f) - 1), label="cut")
    with pytest.raises(CorruptObjectError):
        check(f[:cut], key)
    extra = data.draw(st.binary(min_size=1, max_size=64), label="extra")
    with pytest.raises(CorruptObjectError):
        check(f + extra, key)
    with pytest.raises(CorruptObjectError):
        check(extra + f, key)


def test_same_size_object_of_another_key_in_the_same_range_is_refused():
    """A range reused by another object of the same size (lease over, evicted) never verifies as the old key."""
    a, b = frame("block-a", b"\x01" * 1000), frame("block-b", b"\x01" * 1000)
    assert len(a) == len(b)
    with pytest.raises(CorruptObjectError, match="crc32c"):
        check(b, "block-a")


def test_digest_is_length_and_crc():
    t1, t2 = encode_trailer("k", b"abc"), encode_trailer("k", b"abd")
    assert len(digest_of(t1)) == 12 and digest_of(t1) != digest_of(t2)
    assert digest_of(t1) == digest_of(encode_trailer("k", bytearray(b"abc")))


def test_bad_key_type():
    with pytest.raises(TypeError):
        frame(b"k", b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        check(frame("k", b"x"), "")
