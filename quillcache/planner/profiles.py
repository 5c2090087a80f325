"""Model, GPU and link profiles for the planner's cost model; every figure names its source.

KV bytes per token follow REFERENCE section 2: ``2 (K and V) x layers x kv_heads x head_dim x
dtype bytes`` (fp16/bf16: 2 bytes), e.g. Llama-3-8B 32 x 8 x 128 -> 128 KiB per token, 2 MiB per
16-token block. Architecture figures are the models' published ``config.json`` values
(Hugging Face model cards); parameter counts are the published totals.

Prefill compute uses the standard transformer FLOP count (Kaplan et al. 2020, "Scaling Laws for
Neural Language Models", Table 1): ``2 x params`` per token for the weights plus the attention
score and value products, ``4 x layers x attn_dim x context`` per token at position ``context``.
Time = FLOPs / (dense BF16 peak x MFU). The MFU is an ASSUMPTION (0.5 by default), to be replaced
with a figure measured on your engine.

Link figures are line rates or vendor/paper figures as cited; latencies are stated assumptions
(per transfer, not per block). Nothing here was measured on this machine except where it says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from quillcache._checks import check_float

__all__ = [
    "DTYPE_BYTES",
    "GPUS",
    "LINKS",
    "MODELS",
    "GpuProfile",
    "LinkProfile",
    "ModelProfile",
]

# bytes per KV element by KvLayout.dtype
DTYPE_BYTES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3": 1,
    "float8_e5m2": 1,
    "int8": 1,
}


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """A decoder-only transformer's shape, for KV bytes and prefill FLOPs."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int
    hidden_size: int
    num_params: float
    source: str

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_kv_heads", "head_dim", "num_attention_heads", "hidden_size", "num_params"):
            check_float(f"ModelProfile.{f}", getattr(self, f), 0.0, lo_open=True)

    @property
    def attn_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """``2 x layers x kv_heads x head_dim x dtype_bytes`` (REFERENCE section 2)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def weight_flops_per_token(self) -> float:
        return 2.0 * self.num_params

    @property
    def attn_flops_per_token_per_context(self) -> float:
        """FLOPs per token per token of context: QK^T and AV, ``4 x layers x attn_dim``."""
        return 4.0 * self.num_layers * self.attn_dim


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    name: str
    dense_bf16_flops: float
    hbm_bytes_per_s: float
    source: str

    def __post_init__(self) -> None:
        check_float("GpuProfile.dense_bf16_flops", self.dense_bf16_flops, 0.0, lo_open=True)
        check_float("GpuProfile.hbm_bytes_per_s", self.hbm_bytes_per_s, 0.0, lo_open=True)


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    """A path KV bytes take into GPU memory: sustained bandwidth and per-transfer latency."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    source: str

    def __post_init__(self) -> None:
        check_float("LinkProfile.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, 0.0, lo_open=True)
        check_float("LinkProfile.latency_s", self.latency_s, 0.0)


_HF = "Hugging Face config.json of {}"
MODELS: dict[str, ModelProfile] = {
    "llama-3.2-1b": ModelProfile(
        name="llama-3.2-1b", num_layers=16, num_kv_heads=8, head_dim=64, num_attention_heads=32,
        hidden_size=2048, num_params=1.24e9, source=_HF.format("meta-llama/Llama-3.2-1B") + "; REFERENCE §2 (32 KiB/token)",
    ),
    "qwen2.5-7b": ModelProfile(
        name="qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128, num_attention_heads=28,
        hidden_size=3584, num_params=7.61e9, source=_HF.format("Qwen/Qwen2.5-7B") + "; REFERENCE §2 (56 KiB/token)",
    ),
    "llama-3-8b": ModelProfile(
        name="llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, num_attention_heads=32,
        hidden_size=4096, num_params=8.03e9, source=_HF.format("meta-llama/Meta-Llama-3-8B") + "; REFERENCE §2 (128 KiB/token)",
    ),
    "llama-3-70b": ModelProfile(
        name="llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128, num_attention_heads=64,
        hidden_size=8192, num_params=70.6e9, source=_HF.format("meta-llama/Meta-Llama-3-70B") + "; REFERENCE §2 (320 KiB/token)",
    ),
}

GPUS: dict[str, GpuProfile] = {
    "h100-sxm": GpuProfile(
        name="h100-sxm", dense_bf16_flops=989e12, hbm_bytes_per_s=3.35e12,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS dense BF16, 3.35 TB/s HBM3)",
    ),
    "a100-sxm-80gb": GpuProfile(
        name="a100-sxm-80gb", dense_bf16_flops=312e12, hbm_bytes_per_s=2.039e12,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS dense BF16, 2,039 GB/s HBM2e)",
    ),
}

LINKS: dict[str, LinkProfile] = {
    "pcie5-x16": LinkProfile(
        name="pcie5-x16", bandwidth_bytes_per_s=55e9, latency_s=10e-6,
        source="PCIe 5.0 x16 line rate 63 GB/s per direction (PCI-SIG; 32 GT/s x 16, 128b/130b), "
               "derated to 55 GB/s sustained (assumption); 10 us per transfer (assumption)",
    ),
    "pcie4-x16": LinkProfile(
        name="pcie4-x16", bandwidth_bytes_per_s=25e9, latency_s=10e-6,
        source="PCIe 4.0 x16 line rate 31.5 GB/s per direction (PCI-SIG), derated to 25 GB/s (assumption); "
               "10 us per transfer (assumption)",
    ),
    "nvme-gen4": LinkProfile(
        name="nvme-gen4", bandwidth_bytes_per_s=7.0e9, latency_s=100e-6,
        source="PCIe 4.0 NVMe SSD sequential read ~7 GB/s (e.g. Samsung 990 PRO datasheet: 7,450 MB/s); "
               "100 us per read (assumption)",
    ),
    "rdma-4x200g": LinkProfile(
        name="rdma-4x200g", bandwidth_bytes_per_s=87e9, latency_s=20e-6,
        source="Mooncake transfer engine, 4x200 Gbps RDMA: 87 GB/s (REFERENCE §4); 20 us per transfer (assumption)",
    ),
    "tcp-loopback": LinkProfile(
        name="tcp-loopback", bandwidth_bytes_per_s=4.3e9, latency_s=50e-6,
        source="loopback TCP, 1 MiB sends: 4.3-4.6 GB/s measured on this machine kind (REFERENCE §6); "
               "50 us per transfer (assumption)",
    ),
}
