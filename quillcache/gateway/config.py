"""Gateway configuration: engines, served models, limits, timeouts, retries (frozen dataclasses).

A configuration comes from ``--engines URL[,URL...]`` alone (every engine ``approximate`` prefix
state, models discovered from the engines' ``/v1/models``) or from a JSON file (``--config``)::

    {"engines": [{"url": "http://127.0.0.1:8001", "name": "e0",
                  "kv_events": "tcp://127.0.0.1:5557", "kv_events_replay": "tcp://127.0.0.1:5558"}],
     "models": {"m": {"base": "m"}, "m-sql": {"base": "m", "adapter": "m-sql"}},
     "tokenizer": "bytes", "chat_template": null, "chat_template_content_format": "auto", "block_size_tokens": 16,
     "limits": {"max_body_bytes": 4194304, "max_json_depth": 32, "tenant_max_concurrency": 256,
                "max_head_bytes": 65536},
     "timeouts": {"connect_s": 2, "first_byte_s": 30, "idle_s": 60, "client_head_s": 15, "client_body_s": 60},
     "retry": {"max_retries": 2, "backoff_s": 0.05}, "speculative_ttl_s": 2.0,
     "router": "cache_aware", "router_options": {"cache_threshold": 0.3},
     "peer_bind": "tcp://127.0.0.1:7701", "peers": ["tcp://127.0.0.1:7702"]}

Invariants: every value is validated when the dataclass is built, and a bad one raises
``ConfigError`` naming the field (with its JSON path for a file) and the value; engine names and
URLs are unique; an engine with ``kv_events`` has ``prefix_state == "events"`` and one without
has ``"approximate"`` (the gateway's own record of what it routed, bounded by
``approx_capacity_blocks``).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from quillcache._checks import check_float, check_int
from quillcache.identity.scope import NAME_RE as _IDENTITY_NAME_RE
from quillcache.textproc.content_format import CONTENT_FORMATS

__all__ = [
    "ConfigError",
    "EngineConfig",
    "GatewayConfig",
    "LimitsConfig",
    "ModelConfig",
    "RetryConfig",
    "TimeoutsConfig",
    "load_config",
    "parse_engine_urls",
]

PREFIX_STATES = ("events", "approximate")
_NAME_RE = re.compile(r"[A-Za-z0-9._:@-]{1,64}")


class ConfigError(ValueError):
    """A configuration value that is missing, of the wrong type or out of range (named)."""


def _check_url(field_name: str, url: object, schemes: tuple[str, ...]) -> str:
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{field_name} must be a non-empty URL string, got {url!r:.80}")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in schemes or not parsed.hostname:
        raise ConfigError(f"{field_name}={url!r:.120} is not a {'/'.join(schemes)} URL with a host")
    try:
        parsed.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise ConfigError(f"{field_name}={url!r:.120} has a malformed port") from None
    return url.rstrip("/")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """One upstream engine: its base URL, its name (the index node name) and its prefix-state source."""

    url: str
    name: str = ""
    kv_events: str | None = None  # ZMQ PUB endpoint of vLLM-format KV events
    kv_events_replay: str | None = None  # ZMQ ROUTER replay endpoint
    prefix_state: str = ""  # "events" or "approximate"; derived from kv_events when empty
    approx_capacity_blocks: int = 65536  # approximate mode: blocks remembered per engine (LRU)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", _check_url("engine url", self.url, ("http", "https")))
        if not self.name:
            p = urllib.parse.urlsplit(self.url)
            object.__setattr__(self, "name", f"{p.hostname}:{p.port or (443 if p.scheme == 'https' else 80)}")
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ConfigError(f"engine name {self.name!r:.80} must be 1-64 characters from [A-Za-z0-9._:@-]")
        for f in ("kv_events", "kv_events_replay"):
            v = getattr(self, f)
            if v is not None:
                _check_url(f"engine {self.name} {f}", v, ("tcp", "ipc", "inproc"))
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ConfigError(f"engine {self.name}: kv_events_replay needs kv_events")
        state = self.prefix_state or ("events" if self.kv_events else "approximate")
        if state not in PREFIX_STATES:
            raise ConfigError(f"engine {self.name}: prefix_state={state!r}; expected one of {PREFIX_STATES}")
        if state == "events" and self.kv_events is None:
            raise ConfigError(f"engine {self.name}: prefix_state 'events' needs a kv_events endpoint")
        object.__setattr__(self, "prefix_state", state)
        check_int(f"engine {self.name} approx_capacity_blocks", self.approx_capacity_blocks, 1,
                  error=ConfigError, type_error=ConfigError)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A served model name: the base model and the LoRA adapter it names ("" = the base model).

    ``base`` (``name`` when left empty) and a non-empty ``adapter`` follow the identity name rule
    (:data:`quillcache.identity.scope.NAME_RE`), since they become the request identity's model and
    adapter; ``name`` itself is only matched against the client's ``model`` and may be any non-empty
    string. A value outside the rule is a ``ConfigError`` naming the model, never a request that fails
    later."""

    name: str
    base: str = ""
    adapter: str = ""

    def __post_init__(self) -> None:
        for f in ("name", "base", "adapter"):
            if not isinstance(getattr(self, f), str):
                raise ConfigError(f"model {f} must be a string, got {getattr(self, f)!r:.80}")
        if not self.name:
            raise ConfigError("a model needs a non-empty name")
        if not self.base:
            object.__setattr__(self, "base", self.name)
        for f in ("base", "adapter"):
            v = getattr(self, f)
            if (v or f == "base") and not _IDENTITY_NAME_RE.fullmatch(v):
                what = "its name (the base model when no base is given)" if f == "base" and v == self.name else f
                raise ConfigError(f"model {self.name!r:.80}: {what} {v!r:.80} must be 1-256 characters from "
                                  "[A-Za-z0-9._:@/+=-] (the identity name rule)")


@dataclass(frozen=True, kw_only=True)
class LimitsConfig:
    max_body_bytes: int = 4 << 20  # a request body above this is refused with 413
    max_json_depth: int = 32  # deeper nesting of arrays/objects is refused with 400
    tenant_max_concurrency: int = 256  # default per-tenant in-flight limit (429 above it)
    max_upstream_connections: int = 4096  # the aiohttp pool (>= 1,000 concurrent streams)
    max_head_bytes: int = 64 << 10  # a client's request line + headers above this: 431 (quillcache.httpserve.guard)

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f"limits.{f.name}", getattr(self, f.name), 256 if f.name == "max_head_bytes" else 1,
                      error=ConfigError, type_error=ConfigError)


@dataclass(frozen=True, kw_only=True)
class TimeoutsConfig:
    connect_s: float = 2.0  # TCP connect to an engine
    first_byte_s: float = 30.0  # request sent -> the engine's response headers
    idle_s: float = 60.0  # longest silence between two chunks of a streaming response
    health_interval_s: float = 1.0  # between /health probes of each engine
    keepalive_s: float = 15.0  # an idle pooled upstream connection is closed after this
    client_head_s: float = 15.0  # a client's request head (or a new connection's first) must be complete by then: 408
    client_body_s: float = 60.0  # longest silence while a client's request body arrives: 408 (quillcache.httpserve)

    def __post_init__(self) -> None:
        for f in fields(self):
            check_float(f"timeouts.{f.name}", getattr(self, f.name), 0.0, lo_open=True,
                        error=ConfigError, type_error=ConfigError)


@dataclass(frozen=True, kw_only=True)
class RetryConfig:
    max_retries: int = 2  # further workers tried after a failure before the first byte
    backoff_s: float = 0.05  # wait before retry k (k = 0, 1, ...) is backoff_s * 2**k

    def __post_init__(self) -> None:
        check_int("retry.max_retries", self.max_retries, 0, 16, error=ConfigError, type_error=ConfigError)
        check_float("retry.backoff_s", self.backoff_s, 0.0, 10.0, error=ConfigError, type_error=ConfigError)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    engines: tuple[EngineConfig, ...]
    models: tuple[ModelConfig, ...] = ()  # empty: discovered from the engines' /v1/models at start
    tokenizer: str = "bytes"  # "bytes" or a tokenizer.json path (must be the engine's)
    chat_template: str | None = None  # a tokenizer_config.json path, or None for the built-in ChatML
    # messages' content as the template gets it (quillcache.textproc.content_format): "auto" (detected from the
    # template, vLLM's default), "string" or "openai"; must be what the engines use (vLLM's same-named flag)
    chat_template_content_format: str = "auto"
    block_size_tokens: int = 16
    index_kind: str = "art"  # residency index backend (quillcache.index.INDEX_BACKENDS) that opens in memory
    # a quillcache.routing.ROUTERS name; cache_aware (SGLang's rule on the exact index) by the gateway study's
    # measurement: Dynamo's cost ("dynamo") trades prefix hits for balance there (results/gateway)
    router: str = "cache_aware"
    router_options: dict = field(default_factory=dict)  # its constructor options, e.g. {"cache_threshold": 0.5}
    speculative_ttl_s: float = 2.0  # llm-d's TTL of a routing-time entry an event has not confirmed
    # events mode: new blocks speculated per request, 0 = all of them. All: the next decision then sees the whole
    # prompt on its engine whatever the events' latency (a cap left later turns to events that had not arrived yet
    # and sent them elsewhere; measured on workload seeds the gateway study does not use, experiments/gateway_study)
    speculative_max_blocks: int = 0
    # what the gateway remembers per events engine, each a bounded LRU (the bound of its memory; defaults: a few
    # times a large engine's GPU blocks): engine block hash -> chain hash (the KV-event subscriber: a block stored
    # under a parent it no longer maps is not attributed), unattributed blocks (residency rule 3) and the scopes of
    # removed blocks (rule 4; 0 turns either rule off)
    max_mapped_blocks: int = 1 << 21
    max_unattributed_blocks: int = 1 << 18
    max_known_blocks: int = 1 << 18
    peer_bind: str | None = None  # replicas: PUB endpoint of this replica's speculation (quillcache.gateway.peers)
    peers: tuple[str, ...] = ()  # replicas: the other replicas' peer_bind endpoints
    # quillcache.gateway.clients.UPSTREAM_CLIENTS: "native" (asyncio + httptools; plain http engines) or "aiohttp"
    # (https too). native by a same-run A/B (the gateway study's overhead part): lower added TTFT and CPU/request
    upstream_client: str = "native"
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    seed: int | None = None  # the routers' tie-break generator: None (fresh entropy) or an integer >= 0

    def __post_init__(self) -> None:
        engines = tuple(self.engines)
        if not engines or not all(isinstance(e, EngineConfig) for e in engines):
            raise ConfigError("at least one engine is needed (--engines URL[,URL...] or \"engines\" in the config)")
        for attr in ("name", "url"):
            seen = [getattr(e, attr) for e in engines]
            dup = sorted({v for v in seen if seen.count(v) > 1})
            if dup:
                raise ConfigError(f"duplicate engine {attr}s {dup}")
        object.__setattr__(self, "engines", engines)
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate model names {sorted({n for n in names if names.count(n) > 1})}")
        object.__setattr__(self, "models", tuple(self.models))
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError(f"tokenizer must be 'bytes' or a tokenizer.json path, got {self.tokenizer!r:.80}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise ConfigError("chat_template must be null or a tokenizer_config.json path, "
                              f"got {self.chat_template!r:.80}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ConfigError(f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, "
                              f"got {self.chat_template_content_format!r:.80}")
        check_int("block_size_tokens", self.block_size_tokens, 1, 65536, error=ConfigError, type_error=ConfigError)
        if self.seed is not None:
            check_int("seed", self.seed, 0, error=ConfigError, type_error=ConfigError)
        _check_index_kind(self.index_kind)
        check_float("speculative_ttl_s", self.speculative_ttl_s, 0.0, lo_open=True, error=ConfigError,
                    type_error=ConfigError)
        check_int("speculative_max_blocks", self.speculative_max_blocks, 0, error=ConfigError, type_error=ConfigError)
        check_int("max_mapped_blocks", self.max_mapped_blocks, 1, error=ConfigError, type_error=ConfigError)
        check_int("max_unattributed_blocks", self.max_unattributed_blocks, 0, error=ConfigError, type_error=ConfigError)
        check_int("max_known_blocks", self.max_known_blocks, 0, error=ConfigError, type_error=ConfigError)
        if not isinstance(self.router_options, dict) or not all(isinstance(k, str) for k in self.router_options):
            raise ConfigError(f"router_options must be an object of option: value, got {self.router_options!r:.80}")
        from quillcache.routing import ROUTERS, make_router

        if not isinstance(self.router, str) or self.router not in ROUTERS:
            raise ConfigError(f"router {self.router!r:.40} is not registered; known: {sorted(ROUTERS)}")
        try:
            make_router(self.router, **self.router_options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"router_options for {self.router!r}: {exc}") from None
        from quillcache.gateway.clients import UPSTREAM_CLIENTS

        if not isinstance(self.upstream_client, str) or self.upstream_client not in UPSTREAM_CLIENTS:
            raise ConfigError(f"upstream_client {self.upstream_client!r:.40} is not registered; "
                              f"known: {sorted(UPSTREAM_CLIENTS)}")
        tls = [e.url for e in engines if e.url.lower().startswith("https:")]
        if tls and self.upstream_client == "native":
            raise ConfigError(f"upstream_client 'native' speaks plain http only; engines {tls[:3]} need "
                              "upstream_client 'aiohttp'")
        if self.peer_bind is not None:
            _check_url("peer_bind", self.peer_bind, ("tcp", "ipc", "inproc"))
        if isinstance(self.peers, (str, bytes)) or not all(isinstance(p, str) for p in self.peers):
            raise ConfigError(f"peers must be a list of endpoint strings, got {self.peers!r:.80}")
        object.__setattr__(self, "peers", tuple(_check_url("peers[]", p, ("tcp", "ipc", "inproc")) for p in self.peers))
        if self.peers and self.peer_bind is None:
            raise ConfigError("peers need peer_bind (this replica's own endpoint, which the peers connect to)")

    def with_models(self, models: tuple[ModelConfig, ...]) -> GatewayConfig:
        return replace(self, models=tuple(models))


def _check_index_kind(kind: object) -> None:
    """``ConfigError`` unless ``kind`` names a registered index backend the gateway can open in memory
    (it opens ``open_index(kind)`` without a path; a throwaway one is opened and closed here)."""
    from quillcache.index import INDEX_BACKENDS, open_index

    if not isinstance(kind, str) or kind not in INDEX_BACKENDS:
        raise ConfigError(f"index_kind {kind!r:.40} is not a registered index backend; known: {sorted(INDEX_BACKENDS)}")
    try:
        with open_index(kind):
            pass
    except (ImportError, ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"index_kind {kind!r}: the gateway keeps its index in memory and this backend cannot "
                          f"be opened there ({exc})") from None


def parse_engine_urls(text: str) -> tuple[EngineConfig, ...]:
    """``URL[,URL...]`` (the ``--engines`` flag) as engine configs named ``e0``, ``e1``, ..."""
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if not urls:
        raise ConfigError(f"--engines {text!r:.80} names no URL")
    return tuple(EngineConfig(url=u, name=f"e{i}") for i, u in enumerate(urls))


def _section(cls, raw: Any, where: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    try:
        return cls(**raw)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def config_from_dict(raw: Any, *, engines: tuple[EngineConfig, ...] = ()) -> GatewayConfig:
    """Build a :class:`GatewayConfig` from parsed JSON; ``engines`` (from ``--engines``) replace the file's."""
    if not isinstance(raw, dict):
        raise ConfigError(f"the gateway config must be a JSON object, got {type(raw).__name__}")
    known = {f.name for f in fields(GatewayConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown config keys {unknown}; known: {sorted(known)}")
    kw = dict(raw)
    if not engines:
        items = kw.get("engines", [])
        if not isinstance(items, list):
            raise ConfigError("engines must be a list of objects")
        engines = tuple(_section(EngineConfig, e, f"engines[{i}]") if isinstance(e, dict)
                        else _raise(f"engines[{i}] must be an object") for i, e in enumerate(items))
    kw["engines"] = engines
    models = kw.get("models", {})
    if not isinstance(models, dict):
        raise ConfigError("models must be an object {served name: {base, adapter}}")
    out = []
    for name, m in models.items():
        m = {} if m is None else m
        if not isinstance(m, dict):
            raise ConfigError(f"models[{name!r}] must be an object")
        if "name" in m:  # the served name is the entry's key; a second one would silently replace it
            raise ConfigError(f"models[{name!r}]: 'name' is not a model entry key (the served name is the key "
                              f"{name!r} itself); known keys: ['adapter', 'base']")
        out.append(_section(ModelConfig, {"name": name, **m}, f"models[{name!r}]"))
    kw["models"] = tuple(out)
    kw["limits"] = _section(LimitsConfig, kw.get("limits"), "limits")
    kw["timeouts"] = _section(TimeoutsConfig, kw.get("timeouts"), "timeouts")
    kw["retry"] = _section(RetryConfig, kw.get("retry"), "retry")
    try:
        return GatewayConfig(**kw)
    except TypeError as exc:
        raise ConfigError(f"bad config value: {exc}") from None


def _raise(message: str):
    raise ConfigError(message)


def load_config(path: str | Path | None, *, engines: tuple[EngineConfig, ...] = (), **overrides) -> GatewayConfig:
    """The configuration of a JSON file (or none), ``engines`` and keyword ``overrides`` applied."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config {p}: {exc.strerror or exc}") from None
        except (ValueError, RecursionError) as exc:
            raise ConfigError(f"config {p} is not valid JSON: {exc}") from None
    cfg = config_from_dict(raw, engines=engines)
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None}) if overrides else cfg
