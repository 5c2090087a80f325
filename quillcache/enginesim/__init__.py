"""``quillcache engine-sim``: a STAND-IN inference engine (not a GPU engine) for the gateway and its study.

OpenAI-compatible and streaming (``app``), with a real hash-chained block cache (``blockcache``) whose TTFT grows
with uncached tokens through the engine model (``engine``), vLLM-format KV events (``quillcache.kvevents``),
``vllm:*`` metrics (``metrics``) and fault knobs. ``EngineSimProcess`` runs one in a subprocess.
"""

from quillcache.enginesim.blockcache import SimBlockCache, engine_block_digests
from quillcache.enginesim.config import STAND_IN_NOTE, EngineSimConfig
from quillcache.enginesim.process import EngineSimProcess, parse_metrics

__all__ = ["STAND_IN_NOTE", "EngineSimConfig", "EngineSimProcess", "SimBlockCache", "engine_block_digests",
           "parse_metrics"]
