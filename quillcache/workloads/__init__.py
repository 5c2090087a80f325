"""Generated workloads (deterministic from a seed, Mooncake-format JSONL).

``collision``: tenants x adapters x models x shared system prompts x user prompts, with a
``realistic`` and an ``adversarial`` mix (the safety study's input).
"""

from quillcache.workloads.collision import (
    MIXES,
    CollisionConfig,
    CollisionRequest,
    generate,
    read_jsonl,
    tokens_for,
    write_jsonl,
)

__all__ = ["MIXES", "CollisionConfig", "CollisionRequest", "generate", "read_jsonl", "tokens_for", "write_jsonl"]
