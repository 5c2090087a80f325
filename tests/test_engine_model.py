"""EngineModel: capacity from memory minus weights, prefill with the context term, decode per token.

Expected figures are computed by hand from the cited datasheet and model-card numbers (the
derivation is beside each literal), or are scaling properties; none reuses the code's own formula.
"""

from __future__ import annotations

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
    # H100 SXM 80 GB x 0.9 = 72e9 B; Llama-3-8B bf16 weights 8.03e9 x 2 = 16.06e9 B;
    # (72e9 - 16.06e9) / 64 MiB per 512-token block = 55.94e9 / 67_108_864 = 833.57 -> 833 blocks
    assert m.gpu_capacity_blocks == 833
    # tensor parallelism splits weights and KV: more blocks per rank
    assert model(tp=2).gpu_capacity_blocks > m.gpu_capacity_blocks
    assert set(GPU_MEMORY) == set(GPUS)


def test_weights_that_do_not_fit_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="llama-3-70b on h100-sxm.*weights per GPU"):
        model("llama-3-70b").gpu_capacity_blocks  # noqa: B018
    assert model("llama-3-70b", tp=4).gpu_capacity_blocks > 0


def test_prefill_matches_the_hand_computed_flop_count() -> None:
    m = model()
    # Kaplan et al. 2020 FLOPs for Llama-3-8B (8.03e9 params, 32 layers, attn_dim 32 x 128 = 4096)
    # on an H100 SXM (989e12 dense BF16 FLOP/s) at MFU 0.5 -> 4.945e14 FLOP/s:
    #   weights: 2 x 8.03e9 FLOP/token / 4.945e14 = 3.2477e-5 s per token -> 1000 tokens 32.477 ms
    #   attention: 4 x 32 x 4096 = 524_288 FLOP per token per earlier token / 4.945e14 = 1.0602e-9 s,
    #     token t attends to t earlier ones: sum_{t<1000} t = 499_500 -> 0.52959 ms
    assert m.prefill_s(1000, 0) == pytest.approx(0.0330068, rel=1e-5)
    # 512 new tokens after 8192 cached: 512 x 3.2477e-5 + 1.0602e-9 x (8704 x 8703 - 8192 x 8191) / 2
    assert m.prefill_s(512, 8192) == pytest.approx(0.0212140, rel=1e-5)
    # the A100 SXM 80GB (312e12 FLOP/s) is 989 / 312 = 3.17x slower on the same work
    assert model(gpu="a100-sxm-80gb").prefill_s(1000, 0) == pytest.approx(0.1046274, rel=1e-5)


@given(n=st.integers(1, 20_000), cached=st.integers(0, 50_000), name=st.sampled_from(sorted(MODELS)))
def test_prefill_scaling_properties(n: int, cached: int, name: str) -> None:
    m = model(name, tp=4)
    # twice the tokens cost between twice (weights dominate) and four times (attention dominates)
    assert 2 * m.prefill_s(n, 0) <= m.prefill_s(2 * n, 0) * (1 + 1e-12) <= 4 * m.prefill_s(n, 0) * (1 + 1e-9)
    # the same prompt with more of it cached is never slower; a faster GPU is never slower
    isl = n + cached
    assert m.prefill_s(n, cached) <= m.prefill_s(isl, 0)
    if cached:
        assert m.prefill_s(n, cached) <= m.prefill_s(n + 1, cached - 1)
    slow = EngineModel.from_names(name, "a100-sxm-80gb", layout=KvLayout(block_size_tokens=512, tp_size=4))
    assert m.prefill_s(n, cached) < slow.prefill_s(n, cached)
    assert m.decode_s(min(n, 300), cached) <= slow.decode_s(min(n, 300), cached)


def test_prefill_has_the_attention_term_that_grows_with_context() -> None:
    m = model()
    # the same new tokens cost more after a longer cached context, and reuse is cheaper than recompute
    assert m.prefill_s(512, 8192) > m.prefill_s(512, 0)
    assert m.prefill_s(512, 8192) < m.prefill_s(8192 + 512, 0)
    with pytest.raises(ValueError, match="new_tokens=0"):
        m.prefill_s(0, 100)
    with pytest.raises(ValueError, match="cached_tokens"):
        m.prefill_s(10, -1)


def test_decode_is_memory_bound_weights_plus_kv() -> None:
    m = model()
    # one step reads the 16.06e9 B of bf16 weights at 3.35e12 B/s (H100 SXM HBM3) x 0.6 = 2.01e12 B/s:
    # 7.990 ms per token; 1000 tokens of KV add 1000 x 128 KiB = 1.31e8 B -> 8.0553 ms
    assert m.decode_step_s(0) == pytest.approx(7.99005e-3, rel=1e-5)
    assert m.decode_step_s(1000) == pytest.approx(8.05526e-3, rel=1e-5)
    # 3 tokens after a 1000-token prompt: steps over 1000, 1001 and 1002 tokens of KV
    assert m.decode_s(3, 1000) == pytest.approx((3 * 16.06e9 + 3003 * 131072) / 2.01e12, rel=1e-9)
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
