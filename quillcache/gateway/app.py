"""The gateway's ASGI application: an OpenAI-compatible streaming proxy with cache-aware routing.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``GET /health`` (liveness: the process serves), ``GET /ready`` (readiness: at
least one engine answered its last health probe, and every engine with KV events has had its start-up
replay applied to the residency, so no request is routed on a half-replayed history), ``GET /metrics`` (:mod:`.metrics`).

Per request, in order (each refusal is an OpenAI-style JSON error ``{"error": {"message", "type",
"code"}}`` with the status named; never a traceback or an internal detail):

1. API key -> tenant (401 when missing or unknown);
2. the body, declared as JSON or not declared (415 naming the Content-Type otherwise), at most
   ``limits.max_body_bytes`` (413), parsed as a JSON object nested at most
   ``limits.max_json_depth`` deep (400; ``NaN``/``Infinity``/``-Infinity``, which are not JSON, are refused
   naming the constant, a number that overflows a float (``1e400``) naming its field, and nesting deeper
   than the parser's recursion says "nested too deeply", as engine-sim does); ``"stream": null`` is false,
   as in the OpenAI API;
3. ``model`` -> base model and LoRA adapter (404 when not served, or when its identity is malformed,
   naming the model); a client ``cache_salt`` narrows the tenant's scope to ``tenant:salt``;
4. the tenant's in-flight limit (429);
5. prompt tokens exactly as the engine computes them (:mod:`quillcache.textproc`, 400 when the
   prompt is malformed);
6. the decision (:mod:`.decision`): plan over the residency index, load counted before the call;
7. the body forwarded with ``cache_salt`` set to the scope's salt (:func:`.tenants.salt_for`), so
   the engine's blocks and its ``usage.prompt_tokens_details.cached_tokens`` are per scope;
8. a failure before the first byte retries on the next-best worker after a backoff
   (``retry.max_retries``; a retry is counted and its backoff slept only when an engine not yet
   tried this request is healthy), else 502 (the engines failed) or 503 (no engine available). An
   engine that could not be reached (``connect``) is taken for down until its next probe answers; one
   that answered a malformed response (``protocol``), an error status or nothing in time is not;
9. a stream is passed through event by event (SSE line ends LF, CR or CRLF; a last event without its
   blank line is still sent when the engine's stream ends cleanly); the response headers - ``x-quillcache-worker``,
   ``x-quillcache-cached-tokens``, ``x-quillcache-timing-class``, ``x-quillcache-request-id`` -
   leave as soon as the engine's headers arrive, before the first token (no compression
   middleware); a failure mid-stream ends the stream with one SSE error event; a client
   disconnect cancels the stream, which closes the upstream connection (the engine sees it). A client
   disconnect while the gateway waits for the engine's headers or reads a whole (non-streaming) body
   does the same: from admission to the end of the response, ``ClientWatch`` cancels the request's
   task on ``http.disconnect`` (status 499).

Refusals are logged, rate-limited (``RefusalLog``, a ``quillcache._ratelog.BurstLog``): per ``REFUSAL_LOG_S``
window the first at once, the rest summed up by status once the window is over; WARNING for 401/403 (a key
being guessed shows), INFO for the other 4xx; a 500 is an error on its own. Never a key in the log.

Invariants: the load lease and the tenant's in-flight slot are released exactly once per admitted
request, whatever ends it (``_Exchange.finish`` runs from ``finally`` and from the response's own
``finally``); a request that ends before the engine produced output takes its speculative
residency entries back; headers and errors name only the tenant's own scope.

Longer than 600 lines because the admission, decision, forward, stream and release steps above share
one request's exchange state, whose exactly-once release is the module's invariant; the pieces that
stand alone (config, tenants, decision, residency, upstream clients, metrics, peers, and the SSE cuts
and client-disconnect watch in ``proxying``) are modules of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quillcache._ratelog import BurstLog
from quillcache.gateway.config import GatewayConfig, ModelConfig
from quillcache.gateway.decision import Decider, Decision, NoWorkerError
from quillcache.gateway.metrics import GatewayMetrics
from quillcache.gateway.proxying import ClientWatch, sse_error_event, sse_event_end
from quillcache.gateway.residency import EntryState, EventSink, ResidencyTracker
from quillcache.gateway.tenants import TenantKey, TenantLimiter, TenantTable, salt_for, scope_tenant
from quillcache.gateway.clients import UPSTREAM_CLIENTS
from quillcache.gateway.upstream import UpstreamFailure
from quillcache.httpserve.jsonbody import (BodyError, BodyTooLarge, UnsupportedMediaType, check_content_type,
                                           loads_strict, read_capped)
from quillcache.identity.scope import make_identity
from quillcache.index import open_index
from quillcache.textproc import (ChatTemplate, PromptError, Tokenizer, load_chat_template, load_tokenizer,
                                 prompt_token_array)
from quillcache.types import Identity, KvLayout

__all__ = ["Gateway", "GatewayStartError", "build_app"]

log = logging.getLogger("quillcache.gateway")

_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
_PROXY_KINDS = {_COMPLETIONS: "completion", _CHAT: "chat"}


REFUSAL_LOG_S = 10.0  # a refusal on its own line at most once per window of this length (module docstring)


class RefusalLog(BurstLog):
    """Rate-limited log lines for refused requests (module docstring; ``quillcache._ratelog``): the first
    refusal of each window on a line of its own, the rest summed up by status."""

    def __init__(self, window_s: float = REFUSAL_LOG_S, clock=time.monotonic) -> None:
        super().__init__(log, "requests refused", window_s=window_s, burst=1, clock=clock)

    def refused(self, status: int, message: str) -> None:
        level = logging.WARNING if status in (401, 403) else logging.INFO
        self.note(f"x {status}", "refused a request: %d %s", status, message, level=level)


class GatewayStartError(RuntimeError):
    """``Gateway.start`` failed on a part of the config its message names."""


class GatewayError(Exception):
    """A refusal with an HTTP status and a client-safe message."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _error_body(status: int, message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "code": status}}


def _parse_body(raw: bytes, max_depth: int) -> Any:
    """A request body's strict JSON value (``httpserve.jsonbody``); ``GatewayError`` 400 naming what is wrong."""
    try:
        return loads_strict(raw, max_depth)
    except BodyError as exc:
        raise GatewayError(400, str(exc), "invalid_request_error") from None


def _json_depth_ok(value: Any, max_depth: int) -> bool:
    """Whether arrays/objects nest at most ``max_depth`` deep (iterative; strings are not walked)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > max_depth:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return True


_MID_STREAM_ERROR = b"data: " + json.dumps(
    _error_body(502, "the engine failed mid-stream; the response is incomplete", "upstream_error")).encode() + b"\n\n"


class _ProxyStream:
    """The streaming pass-through as one lean ASGI response (what Starlette's ``StreamingResponse``
    does under ASGI 2.3, without its anyio task group and async-generator layer): headers first,
    then the engine's SSE stream whole events at a time (a partial event at a failure is dropped and
    replaced by one error event; at a clean end, bytes after the last blank line are sent as they
    are); an error event of the engine's (``sse_error_event``) is passed on and counted (``error_event``), and
    neither it nor what follows is output: one before any output leaves the request unconfirmed (no TTFT
    sample; its speculative residency is taken back); a client disconnect (``ex.watch``) cancels it, which
    closes the upstream connection; ``_Exchange.finish`` runs however it ends (also when the client is gone
    before the body started)."""

    def __init__(self, gw: Gateway, ex: _Exchange, resp, t0: float, headers: dict[str, str]) -> None:
        self._gw = gw
        self._ex = ex
        self._resp = resp
        self._t0 = t0
        self._raw_headers = [(b"content-type", b"text/event-stream")] + [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        ex, resp = self._ex, self._resp
        metrics = self._gw.metrics
        completed = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self._raw_headers})
            lease = ex.decision.lease
            perf = time.perf_counter
            first = True
            last_t = 0.0
            pending = b""
            failure = None
            errored = False  # the engine sent an error event (OpenAI's shape): what follows is not output
            chunks = resp.content.iter_any().__aiter__()
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    completed = True
                    chunk, pending = pending, b""  # a last event the engine ended without its blank line
                    if not chunk:
                        break
                except (Exception, asyncio.TimeoutError) as exc:  # noqa: BLE001 - any upstream failure mid-stream
                    failure = exc
                    break
                if pending:
                    chunk = pending + chunk
                    pending = b""
                if not completed:
                    cut = sse_event_end(chunk)
                    if cut == 0:
                        pending = chunk
                        continue
                    if cut < len(chunk):
                        pending = chunk[cut:]
                        chunk = chunk[:cut]
                output = not errored  # after the engine's error event ([DONE] and the like): no output
                if output:
                    at = sse_error_event(chunk)
                    if at is not None:  # passed on as the engine sent it; only events before it are output
                        errored, output = True, at > 0
                        metrics.upstream_error(ex.decision.worker, "error_event")
                        log.info("upstream %s sent an error event%s", ex.decision.worker,
                                 " before any output" if first and not output else " mid-stream")
                now = perf()
                if output:
                    if first:
                        first = False
                        ex.ok = True
                        lease.prefill_done()
                        metrics.ttft.observe(now - self._t0)
                    else:
                        metrics.itl.observe(now - last_t)
                    last_t = now
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if completed:
                    break
            if failure is not None:
                metrics.upstream_error(ex.decision.worker, "mid_stream")
                log.info("upstream %s failed mid-stream: %r", ex.decision.worker, failure)
                await send({"type": "http.response.body", "body": _MID_STREAM_ERROR, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if ex.watch is None or not ex.watch.fired:
                raise  # a cancellation that is not the client's (server shutdown)
            ex.watch.absorb()
            metrics.disconnects.inc()
            ex.status = 499
        finally:
            if completed:
                resp.release()
                ex.resp = None
            ex.finish()


class _Exchange:
    """One admitted request's resources: released exactly once by ``finish``."""

    __slots__ = ("decision", "done", "endpoint", "gw", "ok", "resp", "status", "tenant", "watch")

    def __init__(self, gw: Gateway, endpoint: str, tenant: str) -> None:
        self.gw = gw
        self.endpoint = endpoint
        self.tenant = tenant
        self.decision: Decision | None = None
        self.resp = None
        self.status = 0
        self.done = False
        self.ok = False  # the engine produced output (a first stream chunk, or a whole 2xx body)
        self.watch: ClientWatch | None = None

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        if self.watch is not None:
            self.watch.close()
        if self.resp is not None:
            self.resp.close()
        if self.decision is not None:
            self.decision.lease.release()
            if not self.ok:  # the engine may never have stored this prompt: take the speculation back
                self.gw.decider.retract(self.decision)
        self.gw.limiter.release(self.tenant)
        self.gw.metrics.request_done(self.endpoint, self.status)


class Gateway:
    """State of one gateway: configuration, tenants, the planner, the residency tracker, the
    upstream pool, health, metrics. ``app`` is its Starlette application; ``asgi`` the entry a server
    runs (the proxy routes without Starlette's per-request layers, the rest through ``app``)."""

    def __init__(self, config: GatewayConfig, tenants: TenantTable, *, secret: bytes = b"",
                 tokenizer: Tokenizer | None = None, template: ChatTemplate | None = None) -> None:
        """``tokenizer`` / ``template``: ``config.tokenizer`` and ``config.chat_template`` already loaded (the CLI
        loads them once, to refuse a bad one before serving); None loads them here."""
        self.config = config
        self.tenants = tenants
        self.secret = secret
        self.engines = {e.name: e for e in config.engines}
        names = [e.name for e in config.engines]
        self.urls = [e.url for e in config.engines]
        self.upstream = UPSTREAM_CLIENTS[config.upstream_client](config.timeouts, config.limits)
        self._targets = [{p: self.upstream.target(u + p) for p in (_COMPLETIONS, _CHAT)} for u in self.urls]
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
        self.template = template if template is not None else load_chat_template(
            config.chat_template, content_format=config.chat_template_content_format)
        self.layout = KvLayout(block_size_tokens=config.block_size_tokens)
        self.index = open_index(config.index_kind)
        self.tracker = ResidencyTracker(
            self.index, {e.name: e.prefix_state for e in config.engines}, ttl_s=config.speculative_ttl_s,
            approx_capacity_blocks={e.name: e.approx_capacity_blocks for e in config.engines},
            max_unattributed_blocks=config.max_unattributed_blocks, max_known_blocks=config.max_known_blocks)
        self.decider = Decider(self.index, names, self.tracker, block_size_tokens=config.block_size_tokens,
                               router=config.router, router_options=config.router_options, seed=config.seed,
                               speculative_max_blocks=config.speculative_max_blocks)
        self.limiter = TenantLimiter(config.limits.tenant_max_concurrency)
        self.metrics = GatewayMetrics(names)
        self.healthy = [False] * len(names)
        self.models: dict[str, ModelConfig] = {m.name: m for m in config.models}
        self._discover = not config.models
        self._skipped_models: set[str] = set()  # discovered names ModelConfig refused (logged once each)
        self._rounds = 0
        self.refusals = RefusalLog()
        self._identities: dict[tuple[str, str], Identity] = {}
        self._tasks: list[asyncio.Task] = []
        self._subscribers: list[Any] = []
        self._catching_up: set[str] = set()  # events-mode engines whose start-up replay is not applied yet
        self.started = False  # start() ran and stop() has not
        self.metrics.attach_live(self._inflight_by_worker, self._health_by_worker, self._residency_counts,
                                 lambda: self.limiter.total, lambda: self.tracker.stats.counts())
        self.app = Starlette(
            routes=[
                Route(_COMPLETIONS, self.completions, methods=["POST"]),
                Route(_CHAT, self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/ready", self.ready, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            ],
            lifespan=self._lifespan,
            exception_handlers={Exception: self._internal_error, 404: self._not_found, 405: self._not_allowed},
        )

    # ---- lifecycle ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _lifespan(self, app) -> AsyncIterator[None]:
        if not self.started:  # ``serve`` starts the gateway itself, before the server (a failure is one line)
            await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        """Warm up, start the upstream client, probe the engines once, start the peer link, the KV-event
        subscribers and the health loop. Should a step fail, what the earlier ones started is stopped
        (:meth:`stop`) before the error propagates (a bad ``peer_bind``: :class:`GatewayStartError` naming it)."""
        self.started = True
        try:
            self.decider.warm_up()
            prompt_token_array("chat", {"messages": [{"role": "user", "content": "warm-up"}]}, self.tokenizer,
                               self.template)
            await self.upstream.start()
            await self._probe_all()
            loop = asyncio.get_running_loop()
            if self.config.peer_bind is not None:
                from quillcache.gateway.peers import PeerLink

                try:
                    peers = PeerLink(self.tracker, loop, bind=self.config.peer_bind, peers=self.config.peers)
                except Exception as exc:  # zmq.ZMQError: the address is taken, not ours, malformed
                    raise GatewayStartError(f"peer_bind {self.config.peer_bind!r}: {exc}") from exc
                self.decider.peers = peers.start()
            for e in self.config.engines:
                if e.prefix_state == "events":
                    self._subscribers.append(self._subscribe(e, loop))
            self._tasks.append(asyncio.create_task(self._health_loop()))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.stop()
            raise

    def _subscribe(self, engine, loop):
        from quillcache.kvevents import KvEventSubscriber

        self._catching_up.add(engine.name)
        sink = EventSink(self.tracker, loop, on_event=lambda w, k: self.metrics.kv_events.labels(w, k).inc(),
                         on_caught_up=self._catching_up.discard)
        sub = KvEventSubscriber(engine.kv_events, replay_endpoint=engine.kv_events_replay, engine_id=engine.name,
                                sink=sink, max_mapped_blocks=self.config.max_mapped_blocks)
        sub.start()
        return sub

    async def stop(self) -> None:
        """Stop what :meth:`start` started (also a partial start); the gateway serves no more."""
        self.started = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        for sub in self._subscribers:
            await asyncio.to_thread(sub.close)
        self._subscribers.clear()
        if self.decider.peers is not None:
            await asyncio.to_thread(self.decider.peers.close)
            self.decider.peers = None
        await self.upstream.close()
        self.index.close()
        self.refusals.tick(final=True)

    async def _probe_all(self) -> None:
        results = await asyncio.gather(*(self.upstream.probe(u + "/health") for u in self.urls))
        self.healthy = list(results)
        self._rounds += 1
        if self._discover and (not self.models or self._rounds % 30 == 1):  # new adapters show up within 30 rounds
            await self._discover_models()

    async def _discover_models(self) -> None:
        for url, ok in zip(self.urls, self.healthy):
            if not ok:
                continue
            data = await self.upstream.get_json(url + "/v1/models")
            items = data.get("data") if isinstance(data, dict) else None
            if not isinstance(items, list):
                continue
            for m in items:
                mid = m.get("id") if isinstance(m, dict) else None
                if not isinstance(mid, str) or not mid or mid in self.models:
                    continue
                parent = m.get("parent")
                try:
                    if isinstance(parent, str) and parent and parent != mid:
                        self.models[mid] = ModelConfig(name=mid, base=parent, adapter=mid)
                    else:
                        self.models[mid] = ModelConfig(name=mid)
                except ValueError as exc:  # not servable (ModelConfig names why): skipped, said once
                    if mid not in self._skipped_models and len(self._skipped_models) < 1000:
                        self._skipped_models.add(mid)
                        log.warning("engine %s serves a model the gateway cannot: %s", url, exc)

    async def _health_loop(self) -> None:
        interval = self.config.timeouts.health_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self._probe_all()
                self.tracker.expire()
                self.refusals.tick()  # a window's summary is not held back until the next refusal
            except Exception:  # a probe must never stop the loop
                log.exception("health probe round failed")

    # ---- live metrics ------------------------------------------------------------------------
    def _inflight_by_worker(self) -> dict[str, int]:
        loads = self.decider.planner.loads
        return {n: int(v) for n, v in zip(loads.names, loads.inflight)}

    def _health_by_worker(self) -> dict[str, bool]:
        return dict(zip(self.decider.names, self.healthy))

    def _residency_counts(self) -> dict[tuple[str, str], int]:
        out = {}
        for w in self.decider.names:
            for st in (EntryState.PENDING, EntryState.CONFIRMED, EntryState.APPROX):
                out[(w, st.value)] = self.tracker.count(w, st)
        return out

    # ---- small endpoints ---------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        n = sum(self.healthy)
        if self._catching_up:  # routing on a half-replayed history would send turns to engines that dropped them
            return JSONResponse({"status": "not ready", "healthy_engines": n,
                                 "catching_up_kv_events": sorted(self._catching_up)}, status_code=503)
        if n:
            return JSONResponse({"status": "ready", "healthy_engines": n})
        return JSONResponse({"status": "not ready", "healthy_engines": 0}, status_code=503)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def list_models(self, request: Request) -> Response:
        if self.tenants.lookup(request.headers.get("authorization")) is None:
            return self._error_response(401, "missing or unknown API key (Authorization: Bearer <key>)",
                                        "authentication_error")
        data = [{"id": m.name, "object": "model", "owned_by": "quillcache-gateway",
                 "root": m.base, "parent": m.base if m.adapter else None} for m in self.models.values()]
        return JSONResponse({"object": "list", "data": data})

    def _error_response(self, status: int, message: str, kind: str, headers: dict | None = None) -> Response:
        if 400 <= status < 500:
            self.refusals.refused(status, message)
        return JSONResponse(_error_body(status, message, kind), status_code=status, headers=headers)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        log.error("internal error on %s: %r", request.url.path, exc)
        return self._error_response(500, "internal gateway error", "internal_error")

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return self._error_response(404, f"no route {request.url.path}", "not_found")

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return self._error_response(405, f"method {request.method} not allowed on {request.url.path}",
                                    "method_not_allowed")

    # ---- the proxy ---------------------------------------------------------------------------
    async def asgi(self, scope, receive, send) -> None:
        """The ASGI entry the server runs: ``POST`` on the two proxy routes goes straight to the proxy
        (no middleware layers or route matching per request and per streamed chunk; an unexpected
        error is the same 500 as ``app``'s), everything else (lifespan, the small endpoints,
        404/405) through the Starlette ``app``."""
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            kind = _PROXY_KINDS.get(path)
            if kind is not None:
                request = Request(scope, receive)
                try:
                    response = await self._proxy(request, path, kind)
                except Exception as exc:  # noqa: BLE001 - what Starlette's ServerErrorMiddleware would answer
                    response = await self._internal_error(request, exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, _COMPLETIONS, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request, _CHAT, "chat")

    async def _read_body(self, request: Request) -> dict:
        try:
            check_content_type(request.headers.get("content-type"))
            raw = await read_capped(request, self.config.limits.max_body_bytes)
        except UnsupportedMediaType as exc:
            raise GatewayError(415, str(exc), "unsupported_media_type") from None
        except BodyTooLarge as exc:
            raise GatewayError(413, str(exc), "request_too_large") from None
        except BodyError as exc:
            raise GatewayError(400, str(exc), "invalid_request_error") from None
        except ClientDisconnect:
            raise GatewayError(400, "client disconnected while sending the body", "invalid_request_error") from None
        body = _parse_body(raw, self.config.limits.max_json_depth)
        if not isinstance(body, dict):
            raise GatewayError(400, f"request body must be a JSON object, got {type(body).__name__}",
                               "invalid_request_error")
        if not _json_depth_ok(body, self.config.limits.max_json_depth):
            raise GatewayError(400, f"request body nests deeper than {self.config.limits.max_json_depth} levels",
                               "invalid_request_error")
        return body

    def _identity(self, model: ModelConfig, tenant_scope: str) -> Identity:
        key = (model.name, tenant_scope)
        ident = self._identities.get(key)
        if ident is None:
            ident = make_identity(model=model.base, tenant=tenant_scope, tokenizer=self.config.tokenizer
                                  if self.config.tokenizer == "bytes" else "hf", adapter=model.adapter,
                                  layout=self.layout)
            self.decider.scope(ident)  # validated now (the registry is LRU-bounded; it re-registers on demand)
            if len(self._identities) < 100_000:
                self._identities[key] = ident
        return ident

    def _excluded(self) -> set[int]:
        return {i for i, ok in enumerate(self.healthy) if not ok}

    async def _proxy(self, request: Request, endpoint: str, kind: str) -> Response:
        t0 = time.perf_counter()
        metrics = self.metrics
        tk: TenantKey | None = self.tenants.lookup(request.headers.get("authorization"))
        if tk is None:
            metrics.request_done(endpoint, 401)
            return self._error_response(401, "missing or unknown API key (Authorization: Bearer <key>)",
                                        "authentication_error")
        try:
            body = await self._read_body(request)
            model_name = body.get("model")
            if not isinstance(model_name, str):
                raise GatewayError(400, "'model' must be a string", "invalid_request_error")
            model = self.models.get(model_name)
            if model is None:
                raise GatewayError(404, f"the model {model_name[:100]!r} is not served here", "model_not_found")
            client_salt = body.get("cache_salt")
            if client_salt is not None and not isinstance(client_salt, str):
                raise GatewayError(400, "'cache_salt' must be a string", "invalid_request_error")
            stream = body.get("stream")
            stream = False if stream is None else stream  # null is false, as in the OpenAI API
            if not isinstance(stream, bool):
                raise GatewayError(400, "'stream' must be true or false", "invalid_request_error")
            try:
                tenant_scope = scope_tenant(tk.tenant, client_salt)
            except ValueError as exc:
                raise GatewayError(400, f"'cache_salt' is malformed: {exc}", "invalid_request_error") from None
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
            out_tokens = max_tokens if type(max_tokens) is int and 0 <= max_tokens <= 1 << 24 else 0
            try:
                token_ids = prompt_token_array(kind, body, self.tokenizer, self.template)
            except PromptError as exc:
                raise GatewayError(400, str(exc), "invalid_request_error") from None
            try:
                identity = self._identity(model, tenant_scope)
            except ValueError as exc:  # ModelConfig keeps such models out; never a 500 if one got through
                raise GatewayError(404, f"the model {model_name[:100]!r} cannot be served here: {exc}",
                                   "model_not_found") from None
        except GatewayError as exc:
            metrics.request_done(endpoint, exc.status)
            return self._error_response(exc.status, str(exc), exc.kind)
        if not self.limiter.try_acquire(tk.tenant, tk.max_concurrency):
            metrics.request_done(endpoint, 429)
            return self._error_response(429, "too many concurrent requests for this API key's tenant",
                                        "rate_limit_error", headers={"retry-after": "1"})
        ex = _Exchange(self, endpoint, tk.tenant)
        ex.watch = ClientWatch(request.receive)
        try:
            return await self._forward(ex, body, token_ids, out_tokens, identity, tenant_scope, stream, t0)
        except asyncio.CancelledError:
            if not ex.watch.fired:
                ex.finish()
                raise  # not the client's (a server shutdown)
            ex.watch.absorb()  # the client left: closing the upstream response stops the engine's work
            metrics.disconnects.inc()
            ex.status = 499
            ex.finish()
            return Response(status_code=499)  # the server drops it: nobody is listening
        except BaseException:
            ex.finish()
            raise

    async def _forward(self, ex: _Exchange, body: dict, token_ids, out_tokens: int, identity: Identity,
                       tenant_scope: str, stream: bool, t0: float) -> Response:
        metrics = self.metrics
        excluded = self._excluded()
        why = "unhealthy"
        body["cache_salt"] = salt_for(tenant_scope, self.secret)
        payload = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()  # loads_strict: all finite
        request_id = f"qc-{uuid.uuid4().hex}"
        up_headers = {"content-type": "application/json", "x-request-id": request_id}
        retry = self.config.retry
        loop = asyncio.get_running_loop()
        last: UpstreamFailure | None = None
        for attempt in range(retry.max_retries + 1):
            try:
                d = self.decider.decide(identity, token_ids, out_tokens, excluded, why, record=False)
            except NoWorkerError:
                break
            except ValueError as exc:
                ex.status = 400
                ex.finish()
                return self._error_response(400, f"the prompt cannot be routed: {exc}", "invalid_request_error")
            ex.decision = d
            metrics.routed(d.worker, d.reason)
            if attempt == 0:  # the gateway's own latency: before the engine is contacted, once per request
                metrics.decision.observe(time.perf_counter() - t0)
            if d.speculation is not None:
                # index writes run while the request is in flight, two loop turns from now: after the
                # request's bytes left (the native client writes them in ``open`` itself, aiohttp from a task it
                # schedules there)
                loop.call_soon(loop.call_soon, self.decider.record, d)
            try:
                ex.resp = await self.upstream.open(self._targets[d.worker_index][ex.endpoint], payload, up_headers)
                break
            except UpstreamFailure as f:
                last = f
                metrics.upstream_error(d.worker, f.kind)
                if f.kind == "connect":  # unreachable: down until a probe answers ("protocol" is not a sign of it)
                    self.healthy[d.worker_index] = False
                d.lease.release()
                self.decider.retract(d)
                ex.decision = None
                excluded.add(d.worker_index)
                why = "retry"
                if attempt >= retry.max_retries or len(excluded) >= len(self.urls):
                    break  # no retry left, or no other engine to retry on: no backoff, no retry counted
                metrics.retried(d.worker)
                if retry.backoff_s:
                    await asyncio.sleep(retry.backoff_s * (2 ** attempt))
        if ex.resp is None:
            if last is None or last.kind == "connect" and not any(self.healthy):
                ex.status = 503
                ex.finish()
                return self._error_response(503, "no engine is available to serve this request",
                                            "service_unavailable")
            ex.status = 502
            ex.finish()
            return self._error_response(502, f"the engines failed to answer: {last}", "upstream_error")
        d = ex.decision
        assert d is not None
        metrics.prompt_tokens.inc(d.prompt_tokens)
        metrics.cached_tokens.inc(d.cached_tokens)
        resp = ex.resp
        headers = {
            "x-quillcache-worker": d.worker,
            "x-quillcache-cached-tokens": str(d.cached_tokens),
            "x-quillcache-timing-class": d.timing_class,
            "x-quillcache-request-id": request_id,
        }
        ex.status = resp.status
        if not stream or resp.status != 200:
            try:
                data = await resp.read()
            except (Exception, asyncio.TimeoutError) as exc:  # noqa: BLE001 - any read failure is a 502
                metrics.upstream_error(d.worker, "mid_stream")
                ex.status = 502
                ex.finish()
                log.info("upstream %s failed mid-response: %r", d.worker, exc)
                return self._error_response(502, "the engine failed while answering", "upstream_error",
                                            headers=headers)
            ctype = resp.headers.get("content-type", "application/json")
            ex.ok = 200 <= resp.status < 300
            ex.finish()
            metrics.ttft.observe(time.perf_counter() - t0)
            return Response(data, status_code=resp.status, headers=headers, media_type=ctype)
        headers["cache-control"] = "no-cache"
        return _ProxyStream(self, ex, resp, t0, headers)


def build_app(config: GatewayConfig, tenants: TenantTable, *, secret: bytes = b"") -> Starlette:
    """The Starlette app of a new :class:`Gateway` (``app.state.gateway`` is the gateway)."""
    gw = Gateway(config, tenants, secret=secret)
    gw.app.state.gateway = gw
    return gw.app
