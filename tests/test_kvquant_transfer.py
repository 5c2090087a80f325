"""Quantized KV blocks move through the transfer engine as they are stored: a block put into a
``LocalKvStore`` segment, READ by a peer engine (TCP, another process's view of the same protocol),
decodes with no outside context to exactly what was quantized, and its bytes are the quantized size."""

from __future__ import annotations

import numpy as np
import pytest

from quillcache.kvquant import decode_block, encode_block, make_codec
from quillcache.store.dram import LocalKvStore
from quillcache.store.keys import StoreKey
from quillcache.transfer import TransferEngine

SECRET = "kvquant-transfer-test-secret-01"


@pytest.mark.parametrize("codec_name", ["int8", "fp8_e4m3", "int4", "int2"])
@pytest.mark.parametrize("backend", ["local", "tcp"])
def test_a_quantized_block_read_over_the_transfer_engine_decodes_to_what_was_stored(codec_name, backend):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 4, 32)).astype(np.float16)
    codec = make_codec(codec_name)
    q = codec.quantize(x, kind="key")
    blob = encode_block(q)
    assert len(blob) < x.nbytes  # the quantized bytes are what is stored and moved
    opts = {} if backend == "local" else {"secret": SECRET}
    with LocalKvStore(1 << 20, alignment_bytes=64) as store, \
            TransferEngine(backend, **opts) as server, TransferEngine(backend, **opts) as client:
        loc = store.put(StoreKey(1, b"\x00" * 16), blob)
        (region,) = server.register_store(store)
        dest = bytearray(len(blob))
        mine = client.register_region(dest)
        seg = client.open_segment(server.address)
        client.read(mine, 0, seg, region.region_id, loc.offset_bytes, len(blob))
    assert bytes(dest) == blob
    got = decode_block(bytes(dest))
    np.testing.assert_array_equal(codec.dequantize(got), codec.dequantize(q))
