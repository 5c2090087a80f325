"""Multi-tenant, multi-turn session traces with shared system prompts (deterministic from a seed).

A session belongs to one tenant (tenants drawn with Zipf-like skew) and runs on that tenant's
deployment (model, tokenizer, optional LoRA adapter). Its first prompt is

    [global system prompt]? + [tenant system prompt]? + user message

and turn ``t + 1`` re-sends the whole conversation: turn ``t``'s prompt + its answer
(``output_length`` tokens) + a new user message. Sessions start as a Poisson process
(``session_rate_per_s``); turns per session are geometric (mean ``mean_turns``, at most
``max_turns``); the gap between a turn's arrival and the next turn's is log-normal think time
(median ``think_time_median_s``); user messages and answers are log-normal in length. A session
ends early once its prompt would exceed ``max_input_tokens``.

Invariants (tested):

- same config (and seed) -> the same trace; records are sorted by ``timestamp`` (ties keep
  generation order);
- ``hash_ids`` are prefix-chained and interned by (parent id, block content): two requests share
  ``hash_ids[:k]`` exactly when their first ``k`` blocks hold the same content (the same global
  prompt, tenant prompt, or earlier turns of the same session); ids are numbered from 0 in order
  of first use, as in the Mooncake release;
- ``len(hash_ids) == ceil(input_length / block_tokens)``; the last block may be partial and then
  has its own id (it differs from the full block the next turn puts there);
- every line is the ``generated`` schema of :mod:`quillcache.traces.schemas`, which
  :func:`quillcache.traces.loader.load_trace` reads back to the same values: the knobs are bounded
  by the schema's limits (``max_input_tokens``, ``max_turns`` and the token means below ``2**31``,
  the median think time and mean session gap within ``MAX_TIMESTAMP_MS``), and :func:`generate`
  checks every request against the limits a random draw can still break, so one that does (say a
  timestamp past ``MAX_TIMESTAMP_MS`` ms) is a ``ValueError`` naming the knobs to change (``DRAWN_LIMITS``), never a
  trace the loader refuses; :func:`write_jsonl` runs the loader's full line check on every line and
  writes nothing if one fails;
- a trace is never empty: when no session has a request (every first prompt exceeds
  ``max_input_tokens``), :func:`generate` raises ``ValueError`` in both size modes;
- a trace is held in memory whole: ``num_sessions``, ``num_requests`` and ``num_tenants`` are at most
  ``MAX_TRACE_REQUESTS`` / ``MAX_TENANTS``, and ``generate(cfg, max_bytes=B)`` stops with
  :class:`TraceTooLargeError` (a ``ValueError`` naming the knobs) as soon as the requests made so far
  would need more than ``B`` bytes by ``trace_bytes`` (turns, prompt lengths and block size decide the
  size of a request, so only a budget checked while generating bounds it).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from quillcache._checks import check_choice, check_float, check_int
from quillcache.identity.scope import NAME_RE
from quillcache.traces.loader import TraceError, TraceRequest, parse_line
from quillcache.traces.schemas import MAX_BLOCK_TOKENS, MAX_TIMESTAMP_MS
from quillcache.types import _KNOWN_DTYPES, KvLayout

__all__ = ["MAX_TENANTS", "MAX_TRACE_REQUESTS", "SessionRequest", "SessionsConfig", "TraceTooLargeError", "generate",
           "trace_bytes", "write_jsonl"]

# (model, tokenizer) of tenant deployments, assigned round-robin
DEFAULT_MODELS: tuple[tuple[str, str], ...] = (("llama-3-8b", "llama3"), ("qwen2.5-7b", "qwen2.5"))
MAX_TOKENS = (1 << 31) - 1  # the schema's limit on input_length / output_length (and turn)
MAX_GAP_S = MAX_TIMESTAMP_MS / 1000.0  # a mean session gap or median think time longer than a whole trace
# a generated trace is built in memory whole (then every line is checked before one is written): far
# above the Mooncake release (12,031 requests), far below what a machine holds
MAX_TRACE_REQUESTS = 1_000_000  # num_requests, and num_sessions (a session has at least one request)
MAX_TENANTS = 100_000  # num_tenants (each has a deployment and a weight)
# memory a generated request takes until it is written (object, its JSON line, interned ids), an
# upper estimate: a fixed part and a part per hash id (trace_bytes)
REQUEST_BYTES = 1024
HASH_ID_BYTES = 64


class TraceTooLargeError(ValueError):
    """The trace being generated would need more memory than the budget ``generate`` was given."""


def trace_bytes(num_requests: int, num_hash_ids: int) -> int:
    """The memory (an upper estimate, see ``REQUEST_BYTES``) of ``num_requests`` generated requests
    holding ``num_hash_ids`` hash ids in all, until they are written."""
    return num_requests * REQUEST_BYTES + num_hash_ids * HASH_ID_BYTES
# the schema limits a random draw can still break after the knobs are bounded: field -> (largest
# value the loader accepts, the knobs that drive it); checked on every generated request
DRAWN_LIMITS: dict[str, tuple[int, str]] = {
    "timestamp": (MAX_TIMESTAMP_MS, "raise session_rate_per_s or lower think_time_median_s"),
    "output_length": (MAX_TOKENS, "lower output_tokens_mean"),
}


@dataclass(frozen=True, kw_only=True)
class SessionsConfig:
    """Parameters of a session trace. Either ``num_sessions`` sessions (all their turns), or, when
    ``num_requests`` is set, exactly the first ``num_requests`` requests by arrival."""

    num_sessions: int = 1_000
    num_requests: int | None = None
    seed: int = 0
    block_tokens: int = 16
    num_tenants: int = 8
    tenant_skew: float = 0.8  # tenant t is drawn with weight 1 / (t + 1) ** tenant_skew
    models: tuple[tuple[str, str], ...] = DEFAULT_MODELS
    adapter_fraction: float = 0.25  # tenants that serve a LoRA adapter ("lora-<tenant>")
    kv_dtype: str = "bfloat16"
    num_global_prompts: int = 2  # provider-wide system prompts shared by every tenant
    global_prompt_tokens: int = 1_024
    global_prompt_fraction: float = 0.5  # sessions that start with a global prompt
    prompts_per_tenant: int = 2  # tenant-private system prompts
    tenant_prompt_tokens: int = 512  # 0 = no tenant prompt
    mean_turns: float = 4.0  # geometric, >= 1
    max_turns: int = 32
    think_time_median_s: float = 20.0  # log-normal gap between turns
    think_time_sigma: float = 1.0
    first_user_tokens_mean: float = 400.0  # log-normal user message of the first turn
    turn_user_tokens_mean: float = 120.0  # log-normal user message of later turns (prompt growth)
    output_tokens_mean: float = 250.0  # log-normal answer length
    length_sigma: float = 0.8  # log-normal shape of message and answer lengths
    session_rate_per_s: float = 1.0  # Poisson session arrivals
    max_input_tokens: int = 32_768  # a session ends before its prompt would exceed this

    def __post_init__(self) -> None:
        # every bad value is a ValueError naming SessionsConfig.<field> (a wrong type too)
        ints = [("num_sessions", 1, None), ("seed", 0, None), ("block_tokens", 1, MAX_BLOCK_TOKENS),
                ("num_tenants", 1, None), ("num_global_prompts", 1, None), ("global_prompt_tokens", 0, None),
                ("prompts_per_tenant", 1, None), ("tenant_prompt_tokens", 0, None), ("max_turns", 1, MAX_TOKENS + 1),
                ("max_input_tokens", 1, MAX_TOKENS)]
        if self.num_requests is not None:
            ints.append(("num_requests", 1, None))
        for name, lo, hi in ints:
            check_int(f"SessionsConfig.{name}", getattr(self, name), lo, hi, type_error=ValueError)
        # the sizes of a trace held in memory whole (after the low bounds: "must be >= 1" is the familiar one)
        for name, hi in (("num_sessions", MAX_TRACE_REQUESTS), ("num_requests", MAX_TRACE_REQUESTS),
                         ("num_tenants", MAX_TENANTS)):
            if getattr(self, name) is not None:
                check_int(f"SessionsConfig.{name}", getattr(self, name), None, hi, type_error=ValueError)
        for name, lo, hi in (("tenant_skew", 0.0, 10.0), ("adapter_fraction", 0.0, 1.0),
                             ("global_prompt_fraction", 0.0, 1.0), ("think_time_sigma", 0.0, 10.0),
                             ("length_sigma", 0.0, 10.0)):
            check_float(f"SessionsConfig.{name}", getattr(self, name), lo, hi, type_error=ValueError)
        # upper bounds (checked after the lower one) keep every draw finite (no OverflowError) and
        # within the schema's limits
        for name, lo, lo_open, hi in (("mean_turns", 1.0, False, MAX_TOKENS + 1),
                                      ("think_time_median_s", 0.0, True, MAX_GAP_S),
                                      ("first_user_tokens_mean", 0.0, True, MAX_TOKENS),
                                      ("turn_user_tokens_mean", 0.0, True, MAX_TOKENS),
                                      ("output_tokens_mean", 0.0, True, MAX_TOKENS)):
            check_float(f"SessionsConfig.{name}", getattr(self, name), lo, lo_open=lo_open, type_error=ValueError)
            check_float(f"SessionsConfig.{name}", getattr(self, name), hi=hi, type_error=ValueError)
        # a mean gap between sessions (1 / rate) of at most the whole timestamp range
        check_float("SessionsConfig.session_rate_per_s", self.session_rate_per_s, 1.0 / MAX_GAP_S,
                    type_error=ValueError)
        if not self.models or any(not (isinstance(m, tuple) and len(m) == 2) for m in self.models):
            raise ValueError(f"SessionsConfig.models={self.models!r}; expected a non-empty tuple of (model, tokenizer)")
        for m, tok in self.models:
            for what, v in (("model", m), ("tokenizer", tok)):
                if not isinstance(v, str) or NAME_RE.fullmatch(v) is None:
                    raise ValueError(f"SessionsConfig.models: {what} {v!r} is malformed; "
                                     "expected 1-256 characters from [A-Za-z0-9._:@/+=-]")
        check_choice("SessionsConfig.kv_dtype", self.kv_dtype, _KNOWN_DTYPES)
        KvLayout(dtype=self.kv_dtype, block_size_tokens=self.block_tokens)  # the layout every line names
        system = self.global_prompt_tokens + self.tenant_prompt_tokens
        if system >= self.max_input_tokens:
            raise ValueError(f"global_prompt_tokens + tenant_prompt_tokens = {system} leaves no room under "
                             f"max_input_tokens={self.max_input_tokens}")


@dataclass(frozen=True, slots=True)
class SessionRequest:
    """One turn of one session, as written to JSONL (field names are the trace schema's)."""

    timestamp: int  # ms from trace start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int
    tenant: str
    model: str
    tokenizer: str
    adapter: str
    kv_dtype: str
    session_id: int
    turn: int  # 0-based

    def to_trace_request(self) -> TraceRequest:
        """The :class:`TraceRequest` that ``load_trace`` returns for this line."""
        return TraceRequest(self.timestamp, self.input_length, self.output_length, self.hash_ids,
                            tenant=self.tenant, model=self.model, tokenizer=self.tokenizer, adapter=self.adapter,
                            kv_dtype=self.kv_dtype, session_id=self.session_id, block_tokens=self.block_tokens)

    def to_json(self) -> str:
        d = {"timestamp": self.timestamp, "input_length": self.input_length, "output_length": self.output_length,
             "hash_ids": list(self.hash_ids), "block_tokens": self.block_tokens, "tenant": self.tenant,
             "model": self.model, "tokenizer": self.tokenizer, "adapter": self.adapter, "kv_dtype": self.kv_dtype,
             "session_id": self.session_id, "turn": self.turn}
        return json.dumps(d, separators=(",", ":"))


class _Interner:
    """Prefix-chained block ids: id of (parent id, block content), numbered from 0 by first use."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple], int] = {}

    def get(self, parent: int, content: tuple) -> int:
        key = (parent, content)
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self._ids)
        return i


class _Conversation:
    """A session's token stream as segments ``(segment key, length)``; full-block ids are cached
    because a conversation only grows."""

    def __init__(self, bt: int) -> None:
        self.bt = bt
        self.segments: list[tuple[object, int]] = []
        self.starts: list[int] = []  # token offset of each segment
        self.length = 0
        self.full_ids: list[int] = []

    def append(self, key: object, n_tokens: int) -> None:
        if n_tokens > 0:
            self.segments.append((key, n_tokens))
            self.starts.append(self.length)
            self.length += n_tokens

    def _block_content(self, lo: int, hi: int) -> tuple:
        """Content key of tokens [lo, hi): the (segment, start, end) pieces covering them."""
        out = []
        k = max(0, _bisect_right(self.starts, lo) - 1)
        while k < len(self.segments) and self.starts[k] < hi:
            s0 = self.starts[k]
            key, n = self.segments[k]
            a, b = max(lo, s0), min(hi, s0 + n)
            if a < b:
                out.append((key, a - s0, b - s0))
            k += 1
        return tuple(out)

    def hash_ids(self, ids: _Interner) -> tuple[int, ...]:
        bt = self.bt
        n_full = self.length // bt
        for j in range(len(self.full_ids), n_full):
            parent = self.full_ids[-1] if self.full_ids else -1
            self.full_ids.append(ids.get(parent, self._block_content(j * bt, (j + 1) * bt)))
        out = self.full_ids[:n_full]
        if self.length % bt:
            parent = out[-1] if out else -1
            out = out + [ids.get(parent, self._block_content(n_full * bt, self.length))]
        return tuple(out)


def _bisect_right(a: list[int], x: int) -> int:
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < a[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _lognormal_int(rng: random.Random, mean: float, sigma: float, lo: int = 1) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
    return max(lo, round(rng.lognormvariate(mu, sigma)))


def _turns(rng: random.Random, cfg: SessionsConfig) -> int:
    if cfg.mean_turns <= 1:
        return 1
    p = 1.0 / cfg.mean_turns  # P(stop after each turn)
    u = 1.0 - rng.random()  # (0, 1]
    return min(cfg.max_turns, 1 + int(math.log(u) / math.log1p(-p)))


def _session(cfg: SessionsConfig, rng: random.Random, ids: _Interner, sid: int, start_ms: float,
             deployments: list[tuple[str, str, str, str]], cum_weights: list[float]) -> list[SessionRequest]:
    t = rng.choices(range(cfg.num_tenants), cum_weights=cum_weights)[0]  # = weights=, without O(tenants) a draw
    tenant, model, tokenizer, adapter = deployments[t]
    conv = _Conversation(cfg.block_tokens)
    if cfg.global_prompt_tokens and rng.random() < cfg.global_prompt_fraction:
        conv.append(("global", rng.randrange(cfg.num_global_prompts)), cfg.global_prompt_tokens)
    conv.append(("tenant", t, rng.randrange(cfg.prompts_per_tenant)), cfg.tenant_prompt_tokens)
    out: list[SessionRequest] = []
    ts = start_ms
    for turn in range(_turns(rng, cfg)):
        mean = cfg.first_user_tokens_mean if turn == 0 else cfg.turn_user_tokens_mean
        user = _lognormal_int(rng, mean, cfg.length_sigma)
        answer = _lognormal_int(rng, cfg.output_tokens_mean, cfg.length_sigma)
        if conv.length + user > cfg.max_input_tokens:
            break
        conv.append(("user", sid, turn), user)
        out.append(SessionRequest(timestamp=int(ts), input_length=conv.length, output_length=answer,
                                  hash_ids=conv.hash_ids(ids), block_tokens=cfg.block_tokens, tenant=tenant,
                                  model=model, tokenizer=tokenizer, adapter=adapter, kv_dtype=cfg.kv_dtype,
                                  session_id=sid, turn=turn))
        conv.append(("answer", sid, turn), answer)
        ts += 1000.0 * rng.lognormvariate(math.log(cfg.think_time_median_s), cfg.think_time_sigma)
    return out


def generate(cfg: SessionsConfig, *, max_bytes: int | None = None) -> list[SessionRequest]:
    """The requests of ``cfg``, sorted by timestamp (same config and seed -> the same list).
    ``max_bytes``: the memory the trace may take (``trace_bytes``), checked after every session;
    past it, :class:`TraceTooLargeError` (None: no budget)."""
    if not isinstance(cfg, SessionsConfig):
        raise TypeError(f"generate() takes a SessionsConfig, got {type(cfg).__name__}")
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, 1)
    rng = random.Random(cfg.seed)
    deployments = []
    for t in range(cfg.num_tenants):
        model, tokenizer = cfg.models[t % len(cfg.models)]
        adapter = f"lora-{t:02d}" if rng.random() < cfg.adapter_fraction else ""
        deployments.append((f"tenant-{t:02d}", model, tokenizer, adapter))
    cum_weights = list(itertools.accumulate(1.0 / (t + 1) ** cfg.tenant_skew for t in range(cfg.num_tenants)))
    ids = _Interner()
    held_ids = 0  # hash ids of the requests in out
    out: list[tuple[int, int, SessionRequest]] = []  # (timestamp, generation order, request)
    newest: list[int] = []  # max-heap (negated) of the num_requests smallest timestamps so far
    start_ms = 0.0
    sid = 0
    while True:
        if cfg.num_requests is None and sid >= cfg.num_sessions:
            break
        if cfg.num_requests is not None and len(newest) >= cfg.num_requests and start_ms > -newest[0]:
            break  # every later session starts after the num_requests-th arrival: nothing can enter
        if cfg.num_requests is not None and not newest and sid >= 1000:
            raise _no_request(cfg, sid)
        for r in _session(cfg, rng, ids, sid, start_ms, deployments, cum_weights):
            out.append((r.timestamp, len(out), r))
            held_ids += len(r.hash_ids)
            if cfg.num_requests is not None:
                if len(newest) < cfg.num_requests:
                    heapq.heappush(newest, -r.timestamp)
                elif r.timestamp < -newest[0]:
                    heapq.heapreplace(newest, -r.timestamp)
        if max_bytes is not None and trace_bytes(len(out), held_ids) > max_bytes:
            raise TraceTooLargeError(
                f"the trace would need more than {max_bytes / 2**30:,.1f} GiB of memory (its first {sid + 1:,} "
                f"sessions made {len(out):,} requests of {held_ids:,} hash ids, about "
                f"{trace_bytes(len(out), held_ids) / 2**30:,.1f} GiB); lower num_sessions or num_requests, "
                f"mean_turns or max_input_tokens, or raise block_tokens")
        sid += 1
        start_ms += 1000.0 * rng.expovariate(cfg.session_rate_per_s)
    if not out:
        raise _no_request(cfg, sid)
    out.sort(key=lambda x: (x[0], x[1]))
    reqs = [r for _, _, r in out]
    reqs = _renumber(reqs[: cfg.num_requests] if cfg.num_requests is not None else reqs)
    for i, r in enumerate(reqs):
        for field, (hi, knobs) in DRAWN_LIMITS.items():
            if getattr(r, field) > hi:
                raise ValueError(f"request {i} (session {r.session_id}, turn {r.turn}) would have {field} "
                                 f"{getattr(r, field)}, past the trace schema's limit {hi}; {knobs}")
    return reqs


def _no_request(cfg: SessionsConfig, n_sessions: int) -> ValueError:
    return ValueError(f"{n_sessions} sessions produced no request: every first prompt exceeds "
                      f"max_input_tokens={cfg.max_input_tokens}; lower first_user_tokens_mean or "
                      "raise max_input_tokens")


def _renumber(reqs: list[SessionRequest]) -> list[SessionRequest]:
    """Ids numbered from 0 in order of first use in arrival order (as in the Mooncake release)."""
    new: dict[int, int] = {}
    return [replace(r, hash_ids=tuple(new.setdefault(h, len(new)) for h in r.hash_ids)) for r in reqs]


def write_jsonl(requests: Iterable[SessionRequest], path: str | Path) -> int:
    """Write one JSON object per line (Mooncake fields first); returns the number written.

    Every line is checked with the loader's :func:`~quillcache.traces.loader.parse_line` first, and
    the timestamps must not decrease; any failure raises :class:`~quillcache.traces.loader.TraceError`
    (``request N: what``) before ``path`` is opened, so nothing is written."""
    lines = [r.to_json() for r in requests]
    last = -1
    for i, line in enumerate(lines):
        ts = parse_line(line, f"request {i}").timestamp_ms
        if ts < last:
            raise TraceError(f"request {i}: timestamp {ts} is earlier than the previous request's {last}")
        last = ts
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(line + "\n" for line in lines)
    return len(lines)
