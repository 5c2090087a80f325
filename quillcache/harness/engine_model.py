"""``EngineModel``: a model of an inference engine's timing and GPU KV capacity (NOT an engine).

The replay cannot run a GPU engine here, so this stands in for its compute, and is named as such.
Every figure comes from :mod:`quillcache.planner.profiles` (model shapes, GPU peak FLOPs and HBM
bandwidth, links; each cites its source) and :class:`quillcache.planner.CostModel` (prefill and
fetch formulas), so the planner's predictions and the replay's "actual" times use one model.

- GPU KV capacity in blocks (per engine): ``floor((gpu_memory_bytes x gpu_memory_utilization -
  weight_bytes / tp_size) / block_bytes)`` with ``weight_bytes = num_params x 2`` (bf16 weights)
  and ``block_bytes`` the KV of one block on one tensor-parallel rank (REFERENCE section 2).
  ``gpu_memory_utilization`` (0.9) is vLLM's default ``--gpu-memory-utilization``; activations
  and CUDA graphs are inside the remaining 10% (an assumption).
- Prefill time of ``new_tokens`` after ``cached_tokens``: ``CostModel.prefill_s(cached, cached +
  new)`` = ``a new + c (e(e-1)/2 - s(s-1)/2)``: a per-token weight term and the attention term that
  grows with context (Kaplan et al. 2020 FLOP count, MFU an assumption), at least one token.
- Decode time per token (memory bound): one step reads every weight once and the KV of every
  sequence in the batch: ``step_s(kv_tokens) = (weight_bytes + kv_bytes_per_token x kv_tokens) /
  tp_size / (hbm_bytes_per_s x decode_mbu)`` (``decode_mbu`` 0.6 is an assumption: achieved
  memory-bandwidth utilisation). ``decode_s(output_tokens, context_tokens, batch_kv_tokens)`` sums
  the steps while the request's own context grows by one token per step and the rest of the batch
  stays ``batch_kv_tokens`` (closed form; :meth:`EngineModel.decode_s_reference` is the
  step-by-step specification it is tested against).

- Fetching from quantized tiers (``tier_block_bytes`` > 0: the DRAM/SSD tiers hold a
  ``quillcache.kvquant`` codec's blocks of that many bytes, see ``quillcache.store.tier_codec``):
  a block from a host tier (local or peer DRAM/SSD) moves ``tier_block_bytes`` over its links and is
  then dequantized on the GPU, ``dequantize_block_s = (tier_block_bytes + block_bytes) /
  (hbm_bytes_per_s x dequant_hbm_share)`` (the kernel reads the codes and scales and writes 16-bit
  KV: memory bound). ``hbm_bytes_per_s`` is the GPU datasheet's figure (``profiles.GPUS``);
  ``dequant_hbm_share`` (0.7) is an ASSUMPTION, a stand-in like the rest of this model: issue 17's
  target for the ``numba.cuda`` kernels (>= 70% of a device-to-device copy), not a measurement. A
  peer GPU's block is 16-bit KV (``block_bytes``, no dequantize). Fetch and dequantize add up (no
  overlap: a conservative figure). Quantizing on the way out (GPU -> DRAM offload) is off the
  request's path and not charged.

GPU memory capacities (``GPU_MEMORY``) are the datasheets' figures (cited per GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from quillcache._checks import check_float, check_int
from quillcache.planner.cost_model import CostModel
from quillcache.planner.profiles import GPUS, MODELS
from quillcache.types import KvLayout

__all__ = ["GPU_MEMORY", "EngineModel"]

# GPU name (quillcache.planner.profiles.GPUS) -> (memory bytes, source)
GPU_MEMORY: dict[str, tuple[float, str]] = {
    "h100-sxm": (80e9, "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 80 GB HBM3)"),
    "a100-sxm-80gb": (80e9, "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 80 GB HBM2e)"),
}
assert set(GPU_MEMORY) == set(GPUS), "every GPU profile needs a memory figure"

WEIGHT_BYTES_PER_PARAM = 2  # bf16 weights
_GPU_KINDS = (0, 3)  # local GPU, peer GPU (CostModel.SOURCE_NAMES): 16-bit KV, never quantized


@dataclass(frozen=True, kw_only=True)
class EngineModel:
    """Timing and GPU KV capacity of one engine (see the module docstring for every formula)."""

    cost_model: CostModel = field(default_factory=CostModel)
    layout: KvLayout = field(default_factory=KvLayout)
    gpu_memory_utilization: float = 0.9
    decode_mbu: float = 0.6  # ASSUMPTION
    tier_block_bytes: int = 0  # bytes of a block in the DRAM/SSD tiers; 0 = block_bytes (no codec)
    dequant_hbm_share: float = 0.7  # ASSUMPTION (module docstring)

    def __post_init__(self) -> None:
        if not isinstance(self.cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(self.cost_model).__name__}")
        if not isinstance(self.layout, KvLayout):
            raise TypeError(f"layout must be a KvLayout, got {type(self.layout).__name__}")
        check_float("EngineModel.gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
        check_float("EngineModel.decode_mbu", self.decode_mbu, 0.0, 1.0, lo_open=True)
        check_int("EngineModel.tier_block_bytes", self.tier_block_bytes, 0)
        check_float("EngineModel.dequant_hbm_share", self.dequant_hbm_share, 0.0, 1.0, lo_open=True)
        if self.cost_model.gpu.name not in GPU_MEMORY:
            raise ValueError(f"no memory figure for GPU {self.cost_model.gpu.name!r}; known: {sorted(GPU_MEMORY)}")

    @classmethod
    def from_names(cls, model: str, gpu: str, *, layout: KvLayout | None = None, prefill_mfu: float = 0.5,
                   gpu_memory_utilization: float = 0.9, decode_mbu: float = 0.6) -> EngineModel:
        """An engine model from profile names (ValueError lists the known ones)."""
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; known: {sorted(MODELS)}")
        if gpu not in GPUS:
            raise ValueError(f"unknown GPU {gpu!r}; known: {sorted(GPUS)}")
        cm = CostModel(model=MODELS[model], gpu=GPUS[gpu], prefill_mfu=prefill_mfu)
        return cls(cost_model=cm, layout=layout or KvLayout(), gpu_memory_utilization=gpu_memory_utilization,
                   decode_mbu=decode_mbu)

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def block_tokens(self) -> int:
        return self.layout.block_size_tokens

    @property
    def block_bytes(self) -> int:
        """KV bytes of one block on one tensor-parallel rank."""
        return self.cost_model.block_bytes(self.layout)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes of one token on one tensor-parallel rank."""
        return self.block_bytes / self.block_tokens

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.cost_model.model.num_params * WEIGHT_BYTES_PER_PARAM / self.layout.tp_size

    @property
    def gpu_memory_bytes(self) -> float:
        return GPU_MEMORY[self.cost_model.gpu.name][0]

    @property
    def gpu_capacity_blocks(self) -> int:
        """KV blocks one engine's GPU holds (module docstring); ValueError if the weights do not fit."""
        free = self.gpu_memory_bytes * self.gpu_memory_utilization - self.weight_bytes_per_gpu
        n = math.floor(free / self.block_bytes) if free > 0 else 0
        if n < 1:
            raise ValueError(
                f"{self.cost_model.model.name} on {self.cost_model.gpu.name} (tp_size={self.layout.tp_size}): "
                f"{self.weight_bytes_per_gpu / 1e9:.1f} GB of weights per GPU leave no room for one "
                f"{self.block_bytes} B KV block in {self.gpu_memory_bytes * self.gpu_memory_utilization / 1e9:.1f} GB; "
                f"raise tp_size or pick a smaller model")
        return n

    # ---- time -------------------------------------------------------------------------------
    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` of reused context."""
        n = check_int("new_tokens", new_tokens, 0)
        c = check_int("cached_tokens", cached_tokens, 0)
        if n < 1:
            raise ValueError("new_tokens=0; an engine computes at least the last prompt token")
        return self.cost_model.prefill_s(c, c + n)

    def _step_rate(self) -> float:
        return self.cost_model.gpu.hbm_bytes_per_s * self.decode_mbu

    def decode_step_s(self, kv_tokens: int) -> float:
        """Seconds of one decode step whose batch holds ``kv_tokens`` tokens of KV (all sequences)."""
        k = check_int("kv_tokens", kv_tokens, 0)
        return (self.weight_bytes_per_gpu + self.kv_bytes_per_token * k) / self._step_rate()

    def decode_s(self, output_tokens: int, context_tokens: int, batch_kv_tokens: int = 0) -> float:
        """Seconds to generate ``output_tokens`` after a prompt of ``context_tokens`` while the rest of
        the batch holds ``batch_kv_tokens`` of KV: the sum of ``decode_step_s`` over the steps, the
        request's own context growing by one token per step (closed form of the reference)."""
        m = check_int("output_tokens", output_tokens, 0)
        c = check_int("context_tokens", context_tokens, 0)
        b = check_int("batch_kv_tokens", batch_kv_tokens, 0)
        if m == 0:
            return 0.0
        kv = m * (b + c) + m * (m - 1) / 2  # sum over steps i < m of (b + c + i)
        return (m * self.weight_bytes_per_gpu + self.kv_bytes_per_token * kv) / self._step_rate()

    def decode_s_reference(self, output_tokens: int, context_tokens: int, batch_kv_tokens: int = 0) -> float:
        """Step-by-step specification of :meth:`decode_s`."""
        return sum(self.decode_step_s(batch_kv_tokens + context_tokens + i) for i in range(output_tokens))

    @property
    def dequantize_block_s(self) -> float:
        """Seconds to dequantize one block from a quantized tier on the GPU (0 without a codec)."""
        if not self.tier_block_bytes:
            return 0.0
        rate = self.cost_model.gpu.hbm_bytes_per_s * self.dequant_hbm_share
        return (self.tier_block_bytes + self.block_bytes) / rate

    def fetch_s(self, kinds: list[int]) -> float:
        """Seconds to bring one block from each source kind (``CostModel.SOURCE_NAMES`` order); with
        quantized tiers, host-tier blocks move ``tier_block_bytes`` and are dequantized (docstring)."""
        if not kinds:
            return 0.0
        if not self.tier_block_bytes:
            return self.cost_model.fetch_s(kinds, self.block_bytes)
        gpu = [k for k in kinds if k in _GPU_KINDS]
        host = [k for k in kinds if k not in _GPU_KINDS]
        t = self.cost_model.fetch_s(gpu, self.block_bytes) if gpu else 0.0
        if host:
            t += self.cost_model.fetch_s(host, self.tier_block_bytes) + len(host) * self.dequantize_block_s
        return t
