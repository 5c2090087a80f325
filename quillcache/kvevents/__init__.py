"""vLLM KV events: typed events, the wire codec (both encodings, i64/u64/bytes hashes), the ZeroMQ publisher the
stand-in engine uses, and the subscriber the gateway uses (gap detection, replay, resync)."""

from quillcache.kvevents.codec import ENCODINGS, HASH_FORMS, KvEventDecodeError, decode_batch, encode_batch
from quillcache.kvevents.publisher import KvEventPublisher
from quillcache.kvevents.subscriber import (
    KvEventSink,
    KvEventSubscriber,
    RemovedHashes,
    StoredBlocks,
    SubscriberStats,
    chain_step,
)
from quillcache.kvevents.types import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    EventBatch,
    KvEvent,
    normalize_hash,
)

__all__ = [
    "ENCODINGS",
    "HASH_FORMS",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineBlockHash",
    "EventBatch",
    "KvEvent",
    "KvEventDecodeError",
    "KvEventPublisher",
    "KvEventSink",
    "KvEventSubscriber",
    "RemovedHashes",
    "StoredBlocks",
    "SubscriberStats",
    "chain_step",
    "decode_batch",
    "encode_batch",
    "normalize_hash",
]
