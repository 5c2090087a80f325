"""``SimEngine``: the core of the STAND-IN engine — admission, prefix cache, engine-model timing, KV events.

Per request (:meth:`SimEngine.stream`, an async generator of text deltas, one per output token):

1. wait for one of ``max_num_seqs`` batch slots (``vllm:num_requests_waiting`` counts the wait);
2. hash the prompt's full blocks (``blockcache.engine_block_digests``: LoRA adapter and ``cache_salt`` are extra
   keys), pin the cached prefix; ``cached_tokens`` = that prefix in tokens, at most the prompt minus one token
   rounded down to a block (vLLM recomputes the last token of a fully cached prompt);
3. prefill: sleep ``ttft_s(new, cached)`` = ``fixed_ttft_ms`` if set, else ``ttft_scale x EngineModel.prefill_s``
   of the uncached tokens, with at most ``prefill_concurrency`` prefills at a time (0: no limit);
4. cache the prompt's blocks (LRU eviction) and publish ``BlockStored``/``BlockRemoved`` (vLLM wire format);
5. decode: the first token at the end of prefill, then one per step of ``decode_ms_per_token`` or
   ``EngineModel.decode_step_s(KV tokens of every running request)``;
6. at the end, cache the full blocks that the output completed (vLLM caches generated blocks too) and release.

Time only passes in ``asyncio.sleep`` (no CPU burn). A generator closed before its end (client disconnect,
cancellation) releases everything in ``finally`` and counts in ``quillcache_sim_cancelled_total``; one that raises
(a failure of the engine itself, which its caller logs) releases everything too and is not counted as cancelled;
counters and gauges return to zero when no request is in flight. ``cached_tokens`` and the timing of a request
depend only on what requests of the SAME scope (model/adapter and cache salt) stored: other scopes' blocks have
other hashes.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from quillcache.enginesim.blockcache import SimBlockCache, StoreResult, engine_block_digests
from quillcache.enginesim.config import EngineSimConfig
from quillcache.enginesim.metrics import SimMetrics
from quillcache.enginesim.textgen import check_output_tokenizer, plan_output
from quillcache.harness.engine_model import EngineModel
from quillcache.kvevents.publisher import KvEventPublisher
from quillcache.kvevents.types import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from quillcache.textproc import ChatTemplate, Tokenizer, load_chat_template, load_tokenizer
from quillcache.types import KvLayout

__all__ = ["FaultDraw", "SimEngine", "SimRequest"]


@dataclass(slots=True)
class SimRequest:
    """One admitted request. ``cached_tokens``/``completion_tokens``/``finish_reason`` are filled while it runs."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    lora_name: str | None = None
    cache_salt: str | None = None
    seed: int | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    killed_by_fault: bool = False  # the die-mid-stream knob ended it (not counted as a cancellation)
    output_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class FaultDraw:
    """The fault knobs' decision for one request (three seeded uniforms drawn per request, always)."""

    error: bool
    hang_s: float
    die_after_tokens: int | None


class SimEngine:
    """A stand-in engine (module docstring). Create it inside the serving event loop; ``close()`` it."""

    def __init__(self, config: EngineSimConfig, *, tokenizer: Tokenizer | None = None,
                 chat_template: ChatTemplate | None = None) -> None:
        """``tokenizer`` / ``chat_template``: ``config.tokenizer`` and ``config.chat_template`` already loaded (the
        CLI loads them once, to refuse a bad one before serving); None loads them here."""
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
        check_output_tokenizer(self.tokenizer)  # TokenizerError: it cannot encode the output words
        self.chat_template = chat_template if chat_template is not None else load_chat_template(config.chat_template,
                                                                      content_format=config.chat_template_content_format)
        self.engine_model = EngineModel.from_names(config.engine_model, config.gpu,
                                                   layout=KvLayout(block_size_tokens=config.block_size))
        self.capacity_blocks = config.gpu_blocks or self.engine_model.gpu_capacity_blocks
        self.cache = SimBlockCache(self.capacity_blocks)
        self.metrics = SimMetrics(config.model)
        m = self.metrics
        self._gauges = (m.running.labels(config.model), m.waiting.labels(config.model),
                        m.kv_usage.labels(config.model), m.cached_blocks)
        self._generated = m.generation_tokens.labels(config.model)
        self._lora_ids = {name: i + 1 for i, name in enumerate(config.lora_adapters)}
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self._prefill_gate = asyncio.Semaphore(config.prefill_concurrency) if config.prefill_concurrency else None
        self._fault_rng = random.Random(config.fault_seed)
        self.num_running = 0
        self.num_waiting = 0
        self.kv_tokens = 0  # KV tokens of running requests (the decode step's batch term)
        self.num_cancelled = 0
        self.publisher: KvEventPublisher | None = None
        if config.kv_events:
            self.publisher = KvEventPublisher(
                config.kv_events, replay_endpoint=config.kv_events_replay, buffer_steps=config.kv_events_buffer_steps,
                topic=config.kv_events_topic, encoding=config.kv_events_encoding,  # type: ignore[arg-type]
                hash_form=config.hash_signedness, drop_rate=config.kv_events_drop_rate,  # type: ignore[arg-type]
                seed=config.fault_seed)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    # ---- decisions ------------------------------------------------------------------------------
    def lora_of(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); KeyError if it names neither."""
        if model == self.config.model:
            return None
        if model in self._lora_ids:
            return model
        raise KeyError(model)

    def draw_faults(self) -> FaultDraw:
        c = self.config
        u_err, u_hang, u_die = (self._fault_rng.random() for _ in range(3))
        return FaultDraw(error=u_err < c.error_rate,
                         hang_s=c.hang_before_headers_s if c.hang_before_headers_s and u_hang < c.hang_rate else 0.0,
                         die_after_tokens=(c.die_mid_stream_after_tokens
                                           if c.die_mid_stream_after_tokens is not None and u_die < c.die_rate
                                           else None))

    def ttft_s(self, new_tokens: int, cached_tokens: int) -> float:
        if self.config.fixed_ttft_ms is not None:
            return self.config.fixed_ttft_ms / 1000.0
        return self.config.ttft_scale * self.engine_model.prefill_s(max(1, new_tokens), cached_tokens)

    def decode_step_s(self) -> float:
        if self.config.decode_ms_per_token is not None:
            return self.config.decode_ms_per_token / 1000.0
        return self.engine_model.decode_step_s(self.kv_tokens)

    # ---- gauges and events --------------------------------------------------------------------------
    def _update_gauges(self) -> None:
        g = self._gauges
        g[0].set(self.num_running)
        g[1].set(self.num_waiting)
        g[2].set(self.cache.num_pinned_blocks / self.capacity_blocks)
        g[3].set(self.cache.num_cached_blocks)

    def _publish(self, res: StoreResult, tokens: tuple[int, ...] | list[int], req: SimRequest) -> None:
        if self.publisher is None or not (res.runs or res.evicted):
            return
        bs = self.config.block_size
        events: list = []
        if res.evicted:  # evictions happen before the stores that needed their room
            events.append(BlockRemoved(tuple(res.evicted), MEDIUM_GPU))  # type: ignore[arg-type]
        for run in res.runs:
            lo = run.first_block * bs
            events.append(BlockStored(
                run.digests, run.parent, tuple(tokens[lo:lo + len(run.digests) * bs]), bs,  # type: ignore[arg-type]
                self._lora_ids.get(req.lora_name) if req.lora_name else None, MEDIUM_GPU, req.lora_name))
        self.publisher.publish(EventBatch(time.time(), tuple(events), 0))
        self.metrics.kv_event_batches.inc()

    def reset_prefix_cache(self) -> int:
        """Drop every unpinned block and publish ``AllBlocksCleared`` when nothing is pinned, else the removals."""
        pinned = self.cache.num_pinned_blocks
        gone = self.cache.clear()
        if self.publisher is not None and (gone or not pinned):
            ev = AllBlocksCleared() if not pinned else BlockRemoved(tuple(gone), MEDIUM_GPU)  # type: ignore[arg-type]
            self.publisher.publish(EventBatch(time.time(), (ev,), 0))
            self.metrics.kv_event_batches.inc()
        self._update_gauges()
        return len(gone)

    # ---- the request ----------------------------------------------------------------------------------
    async def stream(self, req: SimRequest) -> AsyncIterator[str]:
        """Text deltas of ``req``'s output, one per token, timed by the engine model (module docstring)."""
        cfg, bs, m, name = self.config, self.config.block_size, self.metrics, self.config.model
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        prompt = req.prompt_ids
        pinned: list[bytes] = []
        context = 0
        acquired = False
        finished = failed = False
        self.num_waiting += 1
        self._update_gauges()
        try:
            await self._slots.acquire()
            acquired = True
            self.num_waiting -= 1
            self.num_running += 1
            digests = engine_block_digests(prompt, bs, lora_name=req.lora_name, cache_salt=req.cache_salt)
            pinned = self.cache.pin_prefix(digests)
            cached = min(len(pinned) * bs, (len(prompt) - 1) // bs * bs)
            req.cached_tokens = cached
            m.prefix_queries.labels(name).inc(len(prompt))
            m.prefix_hits.labels(name).inc(cached)
            m.prompt_tokens.labels(name).inc(len(prompt))
            self._update_gauges()
            if self._prefill_gate is not None:
                async with self._prefill_gate:
                    await asyncio.sleep(self.ttft_s(len(prompt) - cached, cached))
            else:
                await asyncio.sleep(self.ttft_s(len(prompt) - cached, cached))
            res = self.cache.store(digests, len(pinned))
            pinned += res.pinned
            self._publish(res, prompt, req)
            context = len(prompt)
            self.kv_tokens += context
            self._update_gauges()
            plan = plan_output(self.tokenizer, prompt, req.max_tokens, engine_seed=cfg.seed, request_seed=req.seed)
            for k, (tok, delta) in enumerate(zip(plan.token_ids, plan.deltas)):
                if k:
                    await asyncio.sleep(self.decode_step_s())
                else:
                    req.ttft_s = loop.time() - t0
                    m.ttft.labels(name).observe(req.ttft_s)
                req.output_ids.append(tok)
                req.completion_tokens += 1
                context += 1
                self.kv_tokens += 1
                self._generated.inc()
                yield delta
            req.finish_reason = "length"
            # cache the blocks the output completed (only when the whole prompt chain is cached: it is their parent)
            if len(pinned) >= len(digests) and not res.num_uncached:
                full = list(prompt) + req.output_ids
                n = len(digests)
                more = engine_block_digests(full, bs, lora_name=req.lora_name, cache_salt=req.cache_salt,
                                            start_block=n, parent=digests[-1] if n else None)
                if more:
                    all_digests = digests + more
                    res2 = self.cache.store(all_digests, n)
                    pinned += res2.pinned
                    self._publish(res2, full, req)
            finished = True
            m.success.labels(name, req.finish_reason).inc()
            m.e2e.labels(name).observe(loop.time() - t0)
        except Exception:  # the engine's own failure (a cancellation or close is a BaseException, not this)
            failed = True
            raise
        finally:
            if acquired:
                self.num_running -= 1
                self._slots.release()
            else:
                self.num_waiting -= 1
            self.kv_tokens -= context
            self.cache.release(pinned)
            if not finished and not failed and not req.killed_by_fault:
                self.num_cancelled += 1
                m.cancelled.inc()
            self._update_gauges()
