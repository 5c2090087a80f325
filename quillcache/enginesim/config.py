"""``EngineSimConfig``: every knob of the STAND-IN engine (``quillcache engine-sim``), validated once.

The stand-in replaces a GPU inference engine (vLLM) that cannot run here: its compute is the
:class:`~quillcache.harness.engine_model.EngineModel` (``engine_model`` x ``gpu``), its prefix cache is a real block
cache (:mod:`quillcache.enginesim.blockcache`), its KV events are vLLM's wire format. Times: ``ttft_scale``
multiplies the engine model's prefill time; ``fixed_ttft_ms`` replaces it (tests set e.g. 500 ms);
``decode_ms_per_token`` replaces the engine model's decode step. Faults are drawn from ``fault_seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quillcache.kvevents.codec import ENCODINGS, HASH_FORMS
from quillcache.textproc.content_format import CONTENT_FORMATS

__all__ = ["EngineSimConfig", "STAND_IN_NOTE"]

STAND_IN_NOTE = "quillcache engine-sim: a STAND-IN engine (engine-model timing, real block cache), not a GPU engine"


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True, kw_only=True)
class EngineSimConfig:
    """Configuration of one stand-in engine (module docstring). ``ValueError`` names a bad field."""

    model: str = "quillcache-sim"
    lora_adapters: tuple[str, ...] = ()
    tokenizer: str | None = None  # "bytes" (None) or a tokenizer.json path
    chat_template: str | None = None  # "chatml" (None) or a tokenizer_config.json path
    chat_template_content_format: str = "auto"  # "auto" (detected from the template, as vLLM), "string", "openai"
    engine_model: str = "llama-3-8b"
    gpu: str = "h100-sxm"
    block_size: int = 16
    gpu_blocks: int | None = None  # None: the engine model's GPU capacity
    max_model_len: int = 32_768
    max_num_seqs: int = 256
    prefill_concurrency: int = 1  # prefills run one at a time (compute bound); 0 = no limit
    ttft_scale: float = 1.0
    fixed_ttft_ms: float | None = None
    decode_ms_per_token: float | None = None
    default_max_tokens: int = 16
    seed: int = 0
    # faults (seeded by fault_seed)
    error_rate: float = 0.0
    hang_before_headers_s: float = 0.0
    hang_rate: float = 1.0
    die_mid_stream_after_tokens: int | None = None
    die_rate: float = 1.0
    fault_seed: int = 0
    # KV events (vLLM wire format)
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = ""
    kv_events_encoding: str = "tagged"
    hash_signedness: str = "u64"
    kv_events_buffer_steps: int = 10_000
    kv_events_drop_rate: float = 0.0

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and bool(self.model), "model must be a non-empty string")
        _check(self.chat_template_content_format in CONTENT_FORMATS,
               f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, "
               f"got {self.chat_template_content_format!r:.40}")
        for name in self.lora_adapters:
            _check(isinstance(name, str) and bool(name) and name != self.model,
                   f"LoRA adapter name {name!r} must be a non-empty string other than the model's name")
        _check(len(set(self.lora_adapters)) == len(self.lora_adapters), "LoRA adapter names must be distinct")
        for name in ("block_size", "max_model_len", "max_num_seqs", "default_max_tokens", "kv_events_buffer_steps"):
            v = getattr(self, name)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{name} must be an int >= 1, got {v!r}")
        _check(self.block_size <= 65536, f"block_size must be <= 65536, got {self.block_size}")
        _check(isinstance(self.prefill_concurrency, int) and self.prefill_concurrency >= 0,
               f"prefill_concurrency must be an int >= 0, got {self.prefill_concurrency!r}")
        if self.gpu_blocks is not None:
            _check(isinstance(self.gpu_blocks, int) and self.gpu_blocks >= 1,
                   f"gpu_blocks must be an int >= 1, got {self.gpu_blocks!r}")
        _check(math.isfinite(self.ttft_scale) and self.ttft_scale >= 0, f"ttft_scale must be >= 0, got {self.ttft_scale}")
        for name in ("fixed_ttft_ms", "decode_ms_per_token"):
            v = getattr(self, name)
            _check(v is None or (math.isfinite(v) and v >= 0), f"{name} must be a finite number >= 0, got {v}")
        for name in ("error_rate", "hang_rate", "die_rate", "kv_events_drop_rate"):
            v = getattr(self, name)
            _check(0.0 <= v <= 1.0, f"{name} must be in [0, 1], got {v}")
        _check(self.kv_events_drop_rate < 1.0, "kv_events_drop_rate must be < 1")
        _check(math.isfinite(self.hang_before_headers_s) and self.hang_before_headers_s >= 0,
               f"hang_before_headers_s must be a finite number >= 0, got {self.hang_before_headers_s}")
        if self.die_mid_stream_after_tokens is not None:
            _check(self.die_mid_stream_after_tokens >= 0,
                   f"die_mid_stream_after_tokens must be >= 0, got {self.die_mid_stream_after_tokens}")
        _check(self.kv_events_encoding in ENCODINGS,
               f"kv_events_encoding {self.kv_events_encoding!r} unknown; known: {list(ENCODINGS)}")
        _check(self.hash_signedness in HASH_FORMS,
               f"hash_signedness {self.hash_signedness!r} unknown; known: {list(HASH_FORMS)}")
        _check(self.kv_events_replay is None or self.kv_events is not None,
               "kv_events_replay needs kv_events (the PUB endpoint)")

    @property
    def served_names(self) -> tuple[str, ...]:
        """Names a request's ``model`` may take: the base model, then each LoRA adapter."""
        return (self.model, *self.lora_adapters)
