"""EngineModel: capacity from memory minus weights, prefill with the context term, decode per token."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.harness.engine_model import GPU_MEMORY, EngineModel
from quillcache.planner.profiles import GPUS, MODELS
from quillcache.types import KvLayout


def model(name: str = "llama-3-8b", gpu: str = "h100-sxm", bs: int = 512, tp: int = 1) -> EngineModel:
    return EngineModel.from_names(name, gpu, layout=KvLayout(block_size_tokens=bs, tp_size=tp))


def test_block_bytes_follow_reference_table() -> None:
    # REFERENCE §2: Llama-3-8B 128 KiB/token -> 2 MiB per 16-token block, 64 MiB per 512 tokens
    assert model(bs=16).block_bytes == 2 << 20
    assert model(bs=512).block_bytes == 64 << 20
    assert model("llama-3.2-1b", bs=512).block_bytes == 16 << 20


def test_gpu_capacity_is_memory_minus_weights_over_block_bytes() -> None:
    m = model()
    want = math.floor((80e9 * 0.9 - 8.03e9 * 2) / (64 << 20))
    assert m.gpu_capacity_blocks == want == 833
    # tensor parallelism splits weights and KV: more blocks per rank
    assert model(tp=2).gpu_capacity_blocks > m.gpu_capacity_blocks
    assert set(GPU_MEMORY) == set(GPUS)


def test_weights_that_do_not_fit_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="llama-3-70b on h100-sxm.*weights per GPU"):
        model("llama-3-70b").gpu_capacity_blocks  # noqa: B018
    assert model("llama-3-70b", tp=4).gpu_capacity_blocks > 0


def test_prefill_has_the_attention_term_that_grows_with_context() -> None:
    m = model()
    a, c = m.cost_model.prefill_coeffs
    assert m.prefill_s(1000, 0) == pytest.approx(a * 1000 + c * 1000 * 999 / 2)
    # the same new tokens cost more after a longer cached context, and reuse is cheaper than recompute
    assert m.prefill_s(512, 8192) > m.prefill_s(512, 0)
    assert m.prefill_s(512, 8192) < m.prefill_s(8192 + 512, 0)
    with pytest.raises(ValueError, match="new_tokens=0"):
        m.prefill_s(0, 100)
    with pytest.raises(ValueError, match="cached_tokens"):
        m.prefill_s(10, -1)


def test_decode_is_memory_bound_weights_plus_kv() -> None:
    m = model()
    bw = GPUS["h100-sxm"].hbm_bytes_per_s * 0.6
    assert m.decode_step_s(0) == pytest.approx(8.03e9 * 2 / bw)
    assert m.decode_step_s(1000) == pytest.approx((8.03e9 * 2 + 1000 * 128 * 1024) / bw)
    assert m.decode_s(0, 100) == 0.0
    with pytest.raises(ValueError, match="output_tokens"):
        m.decode_s(-1, 10)


@given(out=st.integers(0, 300), ctx=st.integers(0, 50_000), batch=st.integers(0, 500_000),
       name=st.sampled_from(sorted(MODELS)), bs=st.sampled_from([16, 256, 512]))
def test_decode_closed_form_matches_step_by_step_reference(out: int, ctx: int, batch: int, name: str, bs: int) -> None:
    m = model(name, bs=bs, tp=4)
    assert m.decode_s(out, ctx, batch) == pytest.approx(m.decode_s_reference(out, ctx, batch), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("kw, match", [
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ({"decode_mbu": -0.1}, "decode_mbu"),
])
def test_bad_parameters_are_refused(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineModel(**kw)


def test_unknown_profiles_are_refused_listing_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown model 'gpt-9'; known"):
        EngineModel.from_names("gpt-9", "h100-sxm")
    with pytest.raises(ValueError, match="unknown GPU 'tpu'"):
        EngineModel.from_names("llama-3-8b", "tpu")
    with pytest.raises(TypeError, match="layout"):
        EngineModel(layout="bf16")  # type: ignore[arg-type]
