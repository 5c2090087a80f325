"""Regression tests for the identity/traces/harness review of 2026-11-29, one per finding:

F1. a real-bytes replay sizes its host tiers by distinct blocks of the whole identity scope (tokenizer and KV
    dtype included), so it takes the same decisions as accounting mode on a trace that varies them;
F2. ``parse_line`` / ``check_record`` refuse a ``block_tokens`` that is not an integer in range, by name;
F4. ``ReplayConfig`` refuses a ``tp_size`` the KV layout cannot hold, naming the field.
"""

from __future__ import annotations

import pytest

from quillcache.harness import ReplayConfig, replay
from quillcache.traces.loader import TraceRequest, parse_line
from quillcache.traces.schemas import check_record

BT = 16


@pytest.mark.parametrize("field, values", [("tokenizer", ["tokA", "tokB", "tokC", "tokD"]),
                                           ("kv_dtype", ["bfloat16", "float16", "float8_e4m3", "float32"])])
def test_real_bytes_and_accounting_agree_when_identities_differ_only_by_tokenizer_or_kv_dtype(field, values):
    ids = tuple(range(8))
    reqs = [TraceRequest(1000 * i, 8 * BT, 4, ids, tenant="acme", block_tokens=BT, **{field: values[i % 4]})
            for i in range(8)]  # the same 8 blocks under 4 scopes, twice
    out = {}
    for account in (True, False):
        res = replay(reqs, ReplayConfig(engines=1, account_bytes=account, gpu_capacity_blocks=8,
                                        dram_capacity_blocks=1024, ssd_capacity_blocks=0))
        try:
            out[account] = ([(r.hit_gpu, r.hit_dram, r.recompute_blocks) for r in res.rows], res.summary.bytes_evicted,
                            res.verify_failures)
        finally:
            res.close()
    assert out[True] == out[False]
    rows, evicted, failures = out[False]
    assert evicted == 0 and failures == 0 and sum(d for _, d, _ in rows) == 28  # second round: DRAM hits, nothing lost


@pytest.mark.parametrize("bad", [0, -1, True, 0.5, "16", 1 << 20])
def test_a_bad_block_tokens_argument_is_refused_by_name(bad):
    line = '{"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}'
    with pytest.raises(ValueError, match="block_tokens"):
        parse_line(line, "t.jsonl:1", block_tokens=bad)
    with pytest.raises(ValueError, match="block_tokens"):
        check_record({"timestamp": 0, "input_length": 32, "output_length": 1, "hash_ids": [1, 2]}, block_tokens=bad)
    assert parse_line(line, "t.jsonl:1", block_tokens=16).block_tokens == 16


def test_replay_config_refuses_a_tp_size_the_kv_layout_cannot_hold():
    with pytest.raises(ValueError, match=r"tp_size=1099511627776 must be in \[1, 4294967295\]"):
        ReplayConfig(tp_size=1 << 40)


# --- second review of the same scope (2026-11-29) -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3"])
def test_a_trace_line_kv_dtype_a_codec_cannot_quantize_is_refused(dtype):
    reqs = [TraceRequest(0, 4 * BT, 4, (0, 1, 2, 3), tenant="acme", block_tokens=BT),
            TraceRequest(10, 4 * BT, 4, (0, 1, 2, 3), tenant="acme", block_tokens=BT, kv_dtype=dtype)]
    with pytest.raises(ValueError, match=f"request 1 of the trace has kv_dtype='{dtype}'.*quantizes 16-bit KV only"):
        replay(reqs, ReplayConfig(engines=1, kv_codec="int8", account_bytes=True))
    res = replay(reqs[:1], ReplayConfig(engines=1, kv_codec="int8", account_bytes=True))  # 16-bit lines replay
    res.close()


def test_collision_config_refuses_what_its_generator_cannot_make():
    from quillcache.traces.collision import CollisionConfig, generate, tokens_for

    with pytest.raises(ValueError, match="max_prompt_blocks=5 must be >= 6 with mix='adversarial'"):
        CollisionConfig(mix="adversarial", public_prompt_blocks=1, max_prompt_blocks=5)
    assert len(generate(CollisionConfig(mix="adversarial", public_prompt_blocks=1, max_prompt_blocks=6,
                                        num_requests=20))) == 20
    for bt in (1, 2, 3):
        with pytest.raises(ValueError, match=f"block_size_tokens={bt} must be >= 4"):
            CollisionConfig(block_size_tokens=bt)
    # from 4 tokens a block, distinct ids give distinct blocks (here: 20,000 ids, no two equal)
    blocks = tokens_for(range(20_000), 4, 80_000).reshape(-1, 4)
    assert len({b.tobytes() for b in blocks}) == 20_000
