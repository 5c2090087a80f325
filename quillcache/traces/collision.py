"""Collision workload: tenants x adapters x models x shared system prompts x user prompts.

Each request is a Mooncake-format record (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``: one prefix-chained id per ``block_tokens``-token block, equal ids = equal prefix) plus
its identity scope (``tenant``, ``model``, ``tokenizer``, ``adapter``, ``kv_dtype``), the number of
leading blocks that are a registered public system prompt (``public_prefix_blocks``) and the
generator's ``intent``: the branch that made the request (how it relates to its prefix's writer, as the
generator meant it). In the realistic mix ``fresh`` is a new session on one of its tenant's own system
prompts, which an earlier session of the tenant may have written (on the same or another deployment), so
a ``fresh`` request can hit; the safety study audits every hit instead of trusting the label. Token ids are
derived from the block ids (:func:`tokens_for`), so the real hashing code runs on real token arrays
and equal content hashes happen exactly where the ids are equal.

Mixes (both deterministic from ``seed``):

- ``realistic``: mostly same-identity reuse - multi-turn sessions of one tenant and deployment,
  tenant-private system prompts - plus what crosses scopes in practice: provider-wide public system
  prompts (registered as public), used by tenants running different models, adapters and KV dtypes,
  and popular user templates typed by many tenants after the same public prompt.
- ``adversarial``: every cache hit a collision. Each group is a fresh prompt written first by a
  victim identity, then requested by five identities that each differ from the victim in exactly
  one scope field (tenant, adapter, model with the same tokenizer, tokenizer revision, KV dtype).

Invariants: ids are interned per (parent id, block content), so a prefix shared by two requests has
the same ids in both; every identity in a trace passes :func:`quillcache.identity.scope.make_identity`;
every request passes the loader's record check (:func:`quillcache.traces.schemas.check_record`):
the knobs are bounded by the schema's limits (``block_size_tokens <= MAX_BLOCK_TOKENS``, a prompt of
``max_prompt_blocks`` blocks under ``2**31`` tokens, ``mean_interarrival_ms <= MAX_TIMESTAMP_MS``),
:func:`generate` refuses a stream whose timestamps would pass ``MAX_TIMESTAMP_MS`` and
:func:`write_jsonl` checks every line before writing any. The adversarial mix needs two tenants or
more (its cross-tenant attacker is another tenant). A trace is held in memory whole: ``num_requests`` and
``num_tenants`` are at most the sessions workload's ``MAX_TRACE_REQUESTS`` / ``MAX_TENANTS``, and
``generate(cfg, max_bytes=B)`` refuses, before generating, a config whose longest prompts would need
more than ``B`` bytes (:func:`memory_bound`). :func:`read_jsonl` reads with the loader's file
and line checks plus the collision fields, so it refuses everything ``load_trace`` refuses.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from quillcache._checks import check_choice, check_float, check_int
from quillcache._mix import splitmix64_array
from quillcache.identity.scope import make_identity
from quillcache.traces.loader import TraceError, _decode, parse_line, trace_lines
from quillcache.traces.schemas import MAX_BLOCK_TOKENS, MAX_TIMESTAMP_MS, SchemaError, check_record
from quillcache.traces.sessions import MAX_TENANTS, MAX_TRACE_REQUESTS, TraceTooLargeError, trace_bytes
from quillcache.types import Identity, KvLayout

__all__ = [
    "INTENTS",
    "MIXES",
    "CollisionConfig",
    "CollisionRequest",
    "generate",
    "memory_bound",
    "read_jsonl",
    "tokens_for",
    "write_jsonl",
]

MIXES = ("realistic", "adversarial")
INTENTS = ("fresh", "same-scope", "public-prompt", "cross-tenant", "cross-adapter", "cross-model",
           "cross-tokenizer", "layout-mismatch")
VOCAB = 128_256  # Llama-3 vocabulary size: token ids are drawn below it
MIN_BLOCK_TOKENS = 4  # below it, tokens_for gives distinct ids equal blocks (about half of all ids at 1 token)
# (model, tokenizer): each model has a sibling with the same tokenizer (cross-model collisions)
MODEL_FAMILIES: tuple[tuple[str, str], ...] = (
    ("llama-3-8b", "llama3"), ("llama-3-70b", "llama3"), ("qwen2.5-7b", "qwen2.5"), ("qwen2.5-14b", "qwen2.5"),
)
SIBLING = {"llama-3-8b": "llama-3-70b", "llama-3-70b": "llama-3-8b", "qwen2.5-7b": "qwen2.5-14b",
           "qwen2.5-14b": "qwen2.5-7b"}
ADAPTERS = ("", "sql-lora", "chat-lora", "legal-lora")
KV_DTYPES = ("bfloat16", "float8_e4m3")
_MAX_TOKENS = 1 << 31  # the schema's (exclusive) limit on input_length
_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids", "block_tokens", "tenant", "model",
             "tokenizer", "adapter", "kv_dtype", "public_prefix_blocks", "intent")


@dataclass(frozen=True, kw_only=True)
class CollisionConfig:
    mix: str = "realistic"
    num_requests: int = 10_000
    seed: int = 0
    block_size_tokens: int = 16
    num_tenants: int = 16
    num_public_prompts: int = 4
    public_prompt_blocks: int = 8
    num_templates: int = 24
    max_prompt_blocks: int = 64
    mean_interarrival_ms: float = 5.0

    def __post_init__(self) -> None:
        check_choice("CollisionConfig.mix", self.mix, MIXES)
        for name in ("num_requests", "num_tenants", "num_public_prompts", "public_prompt_blocks", "num_templates",
                     "max_prompt_blocks"):
            check_int(f"CollisionConfig.{name}", getattr(self, name), 1, type_error=ValueError)
        for name, hi in (("num_requests", MAX_TRACE_REQUESTS), ("num_tenants", MAX_TENANTS)):
            check_int(f"CollisionConfig.{name}", getattr(self, name), None, hi, type_error=ValueError)
        check_int("CollisionConfig.block_size_tokens", self.block_size_tokens, 1, MAX_BLOCK_TOKENS,
                  type_error=ValueError)
        check_int("CollisionConfig.seed", self.seed, 0, type_error=ValueError)
        if self.block_size_tokens < MIN_BLOCK_TOKENS:
            raise ValueError(f"CollisionConfig.block_size_tokens={self.block_size_tokens} must be >= {MIN_BLOCK_TOKENS}: "
                             f"tokens_for draws a block's tokens from its id, and with fewer tokens per block two "
                             f"different ids give the same tokens (a content collision the workload did not intend)")
        if self.mix == "adversarial" and self.max_prompt_blocks < 6:
            raise ValueError(f"max_prompt_blocks={self.max_prompt_blocks} must be >= 6 with mix='adversarial' (a "
                             f"victim's prompt has at least 4 blocks, then its own and a partial tail block)")
        if self.max_prompt_blocks < self.public_prompt_blocks + 4:
            raise ValueError(f"max_prompt_blocks={self.max_prompt_blocks} must leave room after a "
                             f"{self.public_prompt_blocks}-block public prompt (>= public_prompt_blocks + 4)")
        # a realistic session may pass max_prompt_blocks by one turn (<= 6 blocks) before it ends, a new
        # prompt has up to 16 blocks, and a partial tail block may follow: the longest prompt, in blocks
        longest = max(self.max_prompt_blocks, 16) + 7
        if longest * self.block_size_tokens >= _MAX_TOKENS:
            raise ValueError(f"max_prompt_blocks={self.max_prompt_blocks} with block_size_tokens={self.block_size_tokens}"
                             f" allows prompts of {longest} blocks, 2**31 tokens or more (the trace schema's limit)")
        check_float("CollisionConfig.mean_interarrival_ms", self.mean_interarrival_ms, 0.0, MAX_TIMESTAMP_MS,
                    lo_open=True, type_error=ValueError)
        if self.mix == "adversarial" and self.num_tenants < 2:
            raise ValueError(f"CollisionConfig.num_tenants={self.num_tenants}: mix='adversarial' needs >= 2 "
                             "tenants (its cross-tenant attacker requests the victim's prompt as another tenant)")


@dataclass(frozen=True, slots=True)
class CollisionRequest:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int
    tenant: str
    model: str
    tokenizer: str
    adapter: str
    kv_dtype: str
    public_prefix_blocks: int
    intent: str

    def identity(self) -> Identity:
        """The validated identity scope of this request."""
        return make_identity(model=self.model, tenant=self.tenant, tokenizer=self.tokenizer, adapter=self.adapter,
                             layout=KvLayout(dtype=self.kv_dtype, block_size_tokens=self.block_tokens))

    @property
    def num_full_blocks(self) -> int:
        return self.input_length // self.block_tokens

    def tokens(self) -> np.ndarray:
        return tokens_for(self.hash_ids, self.block_tokens, self.input_length)


def tokens_for(hash_ids: Iterable[int], block_tokens: int, input_length: int) -> np.ndarray:
    """Token ids (uint32, below ``VOCAB``) of a prompt: block ``j``'s tokens are a pure function of
    ``hash_ids[j]``, so equal ids give equal blocks; the last block may be partial. Distinct ids give distinct
    blocks only with high probability, and only from ``MIN_BLOCK_TOKENS`` tokens per block."""
    ids = np.fromiter(hash_ids, dtype=np.uint64)
    if input_length > len(ids) * block_tokens or input_length <= (len(ids) - 1) * block_tokens:
        raise ValueError(f"{len(ids)} hash_ids cannot cover input_length {input_length} at {block_tokens} tokens/block")
    pos = np.arange(block_tokens, dtype=np.uint64)
    with np.errstate(over="ignore"):
        toks = splitmix64_array(ids[:, None] * np.uint64(block_tokens) + pos[None, :]).reshape(-1)[:input_length]
    return (toks % np.uint64(VOCAB)).astype(np.uint32)


class _Ids:
    """Prefix-chained block ids, interned by (parent id, content)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}
        self._fresh = 0

    def chain(self, parent: int, contents: Iterable[object]) -> list[int]:
        out = []
        for c in contents:
            key = (parent, c)
            i = self._ids.get(key)
            if i is None:
                i = self._ids[key] = len(self._ids) + 1
            out.append(i)
            parent = i
        return out

    def fresh(self, n: int) -> list[tuple[str, int]]:
        self._fresh += n
        return [("fresh", self._fresh - k) for k in range(n)]


@dataclass(slots=True)
class _Deployment:
    model: str
    tokenizer: str
    adapter: str
    kv_dtype: str


def _deployments(rng: random.Random, n_tenants: int) -> list[list[_Deployment]]:
    out = []
    for t in range(n_tenants):
        model, tok = MODEL_FAMILIES[t % len(MODEL_FAMILIES)]
        deps = [_Deployment(model, tok, ADAPTERS[0] if rng.random() < 0.6 else rng.choice(ADAPTERS[1:]),
                            KV_DTYPES[1] if rng.random() < 0.25 else KV_DTYPES[0])]
        if rng.random() < 0.4:  # a second deployment: another model or adapter
            m2, t2 = rng.choice(MODEL_FAMILIES)
            deps.append(_Deployment(m2, t2, rng.choice(ADAPTERS), KV_DTYPES[0]))
        out.append(deps)
    return out


def _record(cfg: CollisionConfig, ts: int, ids: list[int], tail: int, out_len: int, tenant: str,
            dep: _Deployment, public_blocks: int, intent: str) -> CollisionRequest:
    return CollisionRequest(
        timestamp=ts, input_length=len(ids) * cfg.block_size_tokens + tail - (cfg.block_size_tokens if tail else 0),
        output_length=out_len, hash_ids=tuple(ids), block_tokens=cfg.block_size_tokens, tenant=tenant,
        model=dep.model, tokenizer=dep.tokenizer, adapter=dep.adapter, kv_dtype=dep.kv_dtype,
        public_prefix_blocks=public_blocks, intent=intent,
    )


def _realistic(cfg: CollisionConfig, rng: random.Random) -> list[CollisionRequest]:
    ids = _Ids()
    tenants = [f"tenant-{t:02d}" for t in range(cfg.num_tenants)]
    deps = _deployments(rng, cfg.num_tenants)
    cum_weights = list(itertools.accumulate(1.0 / (t + 1) ** 0.8 for t in range(cfg.num_tenants)))  # a few big
    sessions: list[list[dict]] = [[] for _ in tenants]
    out: list[CollisionRequest] = []
    ts = 0.0
    for _ in range(cfg.num_requests):
        ts += rng.expovariate(1.0 / cfg.mean_interarrival_ms)
        t = rng.choices(range(cfg.num_tenants), cum_weights=cum_weights)[0]  # = weights=, O(log tenants)
        live = sessions[t]
        if live and rng.random() < 0.7:
            s = rng.choice(live)
            s["contents"] += ids.fresh(rng.randint(1, 3)) + ids.fresh(rng.randint(1, 3))  # answer + new turn
            intent = "same-scope"
            if len(s["contents"]) + 1 >= cfg.max_prompt_blocks:
                live.remove(s)
        else:
            dep = rng.choice(deps[t])
            if rng.random() < 0.5:
                p = rng.randrange(cfg.num_public_prompts)
                system = [("public", p, i) for i in range(cfg.public_prompt_blocks)]
                public_blocks = cfg.public_prompt_blocks
                intent = "public-prompt"
            else:
                p = rng.randrange(2)
                system = [("system", t, p, i) for i in range(rng.randint(4, 12))]
                public_blocks = 0
                intent = "fresh"
            if rng.random() < 0.3:
                k = rng.randrange(cfg.num_templates)
                user = [("template", k, i) for i in range(1 + k % 3)]
            else:
                user = ids.fresh(rng.randint(1, 4))
            s = {"dep": dep, "contents": system + user, "public": public_blocks}
            live.append(s)
            if len(live) > 32:
                live.pop(0)
        chain = ids.chain(0, s["contents"])
        tail = rng.randrange(cfg.block_size_tokens)
        if tail:
            chain = chain + ids.chain(chain[-1], ids.fresh(1))
        out.append(_record(cfg, int(ts), chain, tail, rng.randint(16, 512), tenants[t], s["dep"], s["public"], intent))
    return out


_ATTACKS = ("cross-tenant", "cross-adapter", "cross-model", "cross-tokenizer", "layout-mismatch")


def _attacker(victim_tenant: str, dep: _Deployment, kind: str, tenants: list[str], rng: random.Random):
    d = _Deployment(dep.model, dep.tokenizer, dep.adapter, dep.kv_dtype)
    tenant = victim_tenant
    if kind == "cross-tenant":  # = rng.choice of the others, without listing them (the same draw)
        i = rng.choice(range(len(tenants) - 1))
        tenant = tenants[i + (i >= int(victim_tenant.removeprefix("tenant-")))]
    elif kind == "cross-adapter":
        d.adapter = rng.choice([a for a in ADAPTERS if a != dep.adapter])
    elif kind == "cross-model":
        d.model = SIBLING[dep.model]
    elif kind == "cross-tokenizer":
        d.tokenizer = dep.tokenizer + "-r2"
    else:
        d.kv_dtype = KV_DTYPES[1] if dep.kv_dtype == KV_DTYPES[0] else KV_DTYPES[0]
    return tenant, d


def _adversarial(cfg: CollisionConfig, rng: random.Random) -> list[CollisionRequest]:
    ids = _Ids()
    tenants = [f"tenant-{t:02d}" for t in range(cfg.num_tenants)]
    out: list[CollisionRequest] = []
    active: list[list[tuple]] = []
    ts = 0.0
    group = 0
    while len(out) < cfg.num_requests:
        while len(active) < 8:  # keep 8 groups in flight so attacks interleave
            group += 1
            model, tok = rng.choice(MODEL_FAMILIES)
            dep = _Deployment(model, tok, rng.choice(ADAPTERS), KV_DTYPES[0])
            victim = rng.choice(tenants)
            prompt = ids.chain(0, [("adv", group, i) for i in range(rng.randint(4, min(32, cfg.max_prompt_blocks - 2)))])
            steps = [(victim, dep, "fresh")] + [(*_attacker(victim, dep, k, tenants, rng), k)
                                                for k in rng.sample(_ATTACKS, len(_ATTACKS))]
            active.append([prompt, steps])
        g = rng.randrange(len(active))
        prompt, steps = active[g]
        tenant, dep, intent = steps.pop(0)
        if not steps:
            active.pop(g)
        ts += rng.expovariate(1.0 / cfg.mean_interarrival_ms)
        chain = prompt + ids.chain(prompt[-1], ids.fresh(1))  # the prefix plus one own block
        tail = rng.randrange(cfg.block_size_tokens)
        if tail:
            chain = chain + ids.chain(chain[-1], ids.fresh(1))
        out.append(_record(cfg, int(ts), chain, tail, rng.randint(16, 512), tenant, dep, 0, intent))
    return out


def memory_bound(cfg: CollisionConfig) -> int:
    """The most memory ``cfg``'s trace can take until it is written (sessions' ``trace_bytes`` with
    every request as long as the longest prompt the config allows)."""
    return trace_bytes(cfg.num_requests, cfg.num_requests * (max(cfg.max_prompt_blocks, 16) + 7))


def generate(cfg: CollisionConfig, *, max_bytes: int | None = None) -> list[CollisionRequest]:
    """The request stream of ``cfg`` (same config and seed -> the same stream). ``max_bytes``: the
    memory the trace may take; a config whose :func:`memory_bound` is larger is refused up front
    with :class:`TraceTooLargeError` (None: no budget)."""
    if not isinstance(cfg, CollisionConfig):
        raise TypeError(f"generate() takes a CollisionConfig, got {type(cfg).__name__}")
    if max_bytes is not None and memory_bound(cfg) > max_bytes:
        raise TraceTooLargeError(f"{cfg.num_requests:,} requests of up to {max(cfg.max_prompt_blocks, 16) + 7} "
                                 f"blocks could need {memory_bound(cfg) / 2**30:,.1f} GiB of memory, more than "
                                 f"{max_bytes / 2**30:,.1f} GiB; lower num_requests")
    rng = random.Random(cfg.seed)
    out = _realistic(cfg, rng) if cfg.mix == "realistic" else _adversarial(cfg, rng)
    longest = max(r.input_length for r in out)
    if longest >= _MAX_TOKENS:  # the config's bound makes this impossible; never write what the loader refuses
        raise ValueError(f"a prompt of {longest} tokens is past the trace schema's limit 2**31; lower max_prompt_blocks")
    if out[-1].timestamp > MAX_TIMESTAMP_MS:  # timestamps never decrease: the last is the largest
        raise ValueError(f"{cfg.num_requests} requests {cfg.mean_interarrival_ms} ms apart reach timestamp "
                         f"{out[-1].timestamp}, past the trace schema's limit {MAX_TIMESTAMP_MS}; lower "
                         "num_requests or mean_interarrival_ms")
    return out


# --------------------------------------------------------------------------- JSONL
def write_jsonl(requests: Iterable[CollisionRequest], path: str | Path) -> int:
    """Write one JSON object per line (Mooncake fields first); returns the number written.

    Every line is checked with the loader's :func:`~quillcache.traces.loader.parse_line` first, and
    the timestamps must not decrease; any failure raises :class:`TraceError` (``request N: what``)
    before ``path`` is opened, so nothing is written."""
    lines = []
    last = -1
    for i, r in enumerate(requests):
        d = asdict(r)
        d["hash_ids"] = list(r.hash_ids)
        line = json.dumps(d, separators=(",", ":"))
        ts = parse_line(line, f"request {i}").timestamp_ms
        if ts < last:
            raise TraceError(f"request {i}: timestamp {ts} is earlier than the previous request's {last}")
        last = ts
        lines.append(line)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(line + "\n" for line in lines)
    return len(lines)


def _parse(raw: bytes, where: str) -> CollisionRequest:
    """One line: the loader's decoding and record rules, then the collision fields and identity."""
    try:
        obj = _decode(raw)
        check_record(obj)  # ranges, hash_ids, identity strings: exactly what load_trace refuses
    except SchemaError as exc:
        raise TraceError(f"{where}: {exc}") from None
    assert isinstance(obj, dict)  # check_record refuses anything else
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {missing} (a collision trace carries all of {list(_REQUIRED)})")
    if obj["intent"] not in INTENTS:
        raise TraceError(f"{where}: intent {obj['intent']!r} is not one of {INTENTS}")
    req = CollisionRequest(**{k: tuple(obj[k]) if k == "hash_ids" else obj[k] for k in _REQUIRED})
    try:
        req.identity()
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: malformed identity ({exc})") from None
    return req


def read_jsonl(path: str | Path) -> list[CollisionRequest]:
    """Read and validate a collision trace; a bad line is refused with its line number.

    File and line checks are the loader's (:func:`quillcache.traces.loader.load_trace`: file-level
    errors, UTF-8, a byte-order mark on line 1, blank lines, field ranges, sorted timestamps), plus
    every collision field present and a valid identity; every problem is a :class:`TraceError`."""
    p = Path(path)
    out = []
    last = -1
    with contextlib.closing(trace_lines(p)) as lines:
        for lineno, raw in lines:
            if not raw.strip():
                continue
            r = _parse(raw, f"{p}:{lineno}")
            if r.timestamp < last:
                raise TraceError(f"{p}:{lineno}: timestamp {r.timestamp} < previous {last}; traces must be sorted")
            last = r.timestamp
            out.append(r)
    if not out:
        raise TraceError(f"trace file {p} is empty (expected one JSON object per line)")
    return out
