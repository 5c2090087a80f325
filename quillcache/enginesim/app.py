"""The STAND-IN engine's HTTP surface: an OpenAI-compatible Starlette app over :class:`SimEngine`.

Routes (vLLM's shapes unless noted):

- ``POST /v1/completions``, ``POST /v1/chat/completions`` — streaming (SSE ``data: {json}\\n\\n`` chunks, then
  ``data: [DONE]\\n\\n``) and not; ``stream_options.include_usage`` adds a final chunk with empty ``choices`` and
  ``usage{prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens}`` (non-streaming
  responses always carry ``usage``). Request fields: ``model`` (the base model or a LoRA adapter name),
  ``prompt``/``messages``, ``max_tokens`` (chat: ``max_completion_tokens`` wins when both are given, as in vLLM
  and SGLang; each given one is validated), ``stream``, ``stream_options``, ``cache_salt`` (vLLM's), ``seed``,
  ``n`` (only the integer 1). Every output has exactly ``max_tokens`` tokens, ``finish_reason="length"`` (a
  benchmark engine, like vLLM's ``ignore_eos``).
- ``GET /v1/models`` (``owned_by`` names the stand-in), ``GET /health``, ``GET /metrics`` (Prometheus),
  ``POST /tokenize``, ``POST /detokenize``, ``POST /reset_prefix_cache``.
- For ``sglang-router`` in front of it (SGLang's worker API): ``GET /health_generate``, ``/get_model_info``,
  ``/model_info``, ``/get_server_info``, ``/server_info``, ``/get_load``, ``POST /flush_cache``, ``GET /version``.

Errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}`` with the status in ``code``: 400 for
malformed JSON or fields (the message names the field), 404 for an unknown model, 413 over the body cap
(``MAX_BODY_BYTES``, checked as the body is read, as the gateway does), 415 for a body declared as something other
than JSON (no Content-Type is accepted), 500 for an injected error (``--error-rate``) or an unexpected exception
raised before the response headers were sent. An unexpected exception during a stream ends it with one SSE error
event ``data: {"error": {...}}`` (the same object, status 500) and no ``[DONE]``, as the gateway ends a stream
whose engine failed. Every unexpected exception is logged once, with its traceback, on the server
(``quillcache.enginesim``); no traceback or exception text ever reaches a client. A message may quote what the
client sent (shortened, and with any character UTF-8 cannot carry, such as a lone surrogate, escaped), so every
error renders. ``--die-mid-stream-after-tokens`` applies to streaming responses only (a
non-streaming response has no middle to die in). Headers of a streaming
response are sent before prefill starts (and after ``--hang-before-headers-s`` when that fault is drawn); a client
that disconnects cancels its request at once (the response races the request against ``http.disconnect``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quillcache.enginesim.config import STAND_IN_NOTE, EngineSimConfig
from quillcache.enginesim.engine import FaultDraw, SimEngine, SimRequest
from quillcache.httpserve.jsonbody import (BodyError, BodyTooLarge, UnsupportedMediaType, check_content_type,
                                           loads_strict, read_capped)
from quillcache.textproc import PromptError, TokenizerError, prompt_tokens
from quillcache.textproc.prompt import chat_render_args

__all__ = ["MAX_BODY_BYTES", "build_app"]

MAX_BODY_BYTES = 32 << 20
OWNED_BY = "quillcache-engine-sim (stand-in engine)"
INTERNAL_ERROR = "internal error in the stand-in engine (its log has the details)"

log = logging.getLogger("quillcache.enginesim")


class _InjectedDeath(Exception):
    """Raised by the die-mid-stream fault knob: the server drops the connection without ending the stream."""


def _error_obj(status: int, message: str, kind: str, param: str | None) -> dict[str, Any]:
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate cannot be sent
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error(status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_obj(status, message, kind, param), status_code=status)


def _internal_error() -> JSONResponse:
    return _error(500, INTERNAL_ERROR, "InternalServerError")


def _guarded(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``endpoint`` with an unexpected exception logged once (traceback, server side) and answered with an
    OpenAI-shaped 500 instead of Starlette's plain-text one."""

    @functools.wraps(endpoint)
    async def guarded(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception:  # noqa: BLE001 - the client gets a 500 naming nothing internal; the log has the rest
            log.exception("%s %s failed", request.method, request.url.path)
            return _internal_error()
    return guarded


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


async def _json_body(request: Request) -> dict[str, Any] | JSONResponse:
    try:
        check_content_type(request.headers.get("content-type"))
        body = loads_strict(await read_capped(request, MAX_BODY_BYTES))
    except ClientDisconnect:  # the client left before its body was complete: nobody to answer
        return _error(499, "client disconnected before the request body was complete")
    except UnsupportedMediaType as e:
        return _error(415, str(e), "UnsupportedMediaTypeError")
    except BodyTooLarge as e:
        return _error(413, str(e), "RequestTooLargeError")
    except BodyError as e:
        return _error(400, str(e))
    if not isinstance(body, dict):
        return _error(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


async def _wait_disconnect(receive: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class _EngineResponse(Response):
    """Runs one request on the engine and writes it (SSE or JSON), racing it against the client's disconnect."""

    def __init__(self, engine: SimEngine, req: SimRequest, fault: FaultDraw, *, chat: bool, stream: bool,
                 include_usage: bool, model: str) -> None:
        self.engine, self.req, self.fault = engine, req, fault
        self.chat, self.stream, self.include_usage, self.model = chat, stream, include_usage, model
        self.created = int(time.time())
        self.background = None
        self.headers_sent = self.body_sent = False  # how far the response got (what a failure can still say)

    def _usage(self) -> dict[str, Any]:
        r = self.req
        return {"prompt_tokens": len(r.prompt_ids), "completion_tokens": r.completion_tokens,
                "total_tokens": len(r.prompt_ids) + r.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    def _chunk(self, text: str | None, finish: str | None, *, role: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        out: dict[str, Any] = {"id": self.req.request_id, "object": obj, "created": self.created,
                               "model": self.model, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return b"data: " + _dumps(out) + b"\n\n"

    def _token_chunk_parts(self) -> tuple[bytes, bytes, bytes]:
        """(head, tail_running, tail_last) of a token chunk: ``head + json(text) + tail`` is exactly what
        :meth:`_chunk` returns for that text (only the text is encoded per token)."""
        marker = "\x00qc-text\x00"
        running, last = self._chunk(marker, None), self._chunk(marker, "length")
        m = _dumps(marker)
        head, _, tail_running = running.partition(m)
        _, _, tail_last = last.partition(m)
        return head, tail_running, tail_last

    async def _run(self, send: Any) -> None:
        gen = self.engine.stream(self.req)
        try:
            if self.fault.hang_s:
                self.engine.metrics.faults.labels("hang").inc()
                await asyncio.sleep(self.fault.hang_s)
            if self.stream:
                await self._run_stream(gen, send)
            else:
                deltas = [d async for d in gen]
                await self._send_json(send, deltas)
        finally:
            await gen.aclose()

    async def _send_json(self, send: Any, deltas: list[str]) -> None:
        r, text = self.req, "".join(deltas)
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": r.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": r.finish_reason}
            obj = "text_completion"
        body = _dumps({"id": r.request_id, "object": obj, "created": self.created, "model": self.model,
                       "choices": [choice], "usage": self._usage()})
        self.headers_sent = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"x-request-id", r.request_id.encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self.body_sent = True

    async def _run_stream(self, gen: Any, send: Any) -> None:
        r, die = self.req, self.fault.die_after_tokens
        self.headers_sent = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-request-id", r.request_id.encode())]})
        if self.chat:
            await send({"type": "http.response.body", "body": self._chunk(None, None, role=True), "more_body": True})
        if die == 0:
            self._die()
        n = 0
        head, tail_running, tail_last = self._token_chunk_parts()
        async for delta in gen:
            n += 1
            body = head + _dumps(delta) + (tail_last if n == r.max_tokens else tail_running)
            await send({"type": "http.response.body", "body": body, "more_body": True})
            if die is not None and n >= die:
                self._die()
        tail = b""
        if self.include_usage:
            usage = {"id": r.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": self.created, "model": self.model, "choices": [], "usage": self._usage()}
            tail = b"data: " + _dumps(usage) + b"\n\n"
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
        self.body_sent = True

    def _die(self) -> None:
        self.req.killed_by_fault = True
        self.engine.metrics.faults.labels("die_mid_stream").inc()
        raise _InjectedDeath(f"die-mid-stream fault after {self.req.completion_tokens} tokens")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        work = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, watch):
                if not t.done():
                    t.cancel()
            outcome = (await asyncio.gather(work, watch, return_exceptions=True))[0]
        if isinstance(outcome, _InjectedDeath):
            raise outcome  # uvicorn drops the connection: the client sees a stream cut short
        if isinstance(outcome, BaseException) and not isinstance(outcome, (asyncio.CancelledError, OSError)):
            if not isinstance(outcome, Exception):
                raise outcome  # KeyboardInterrupt, SystemExit: not a request's failure
            log.error("request %s failed", self.req.request_id, exc_info=outcome)
            with contextlib.suppress(OSError):  # the client may be gone too
                await self._send_failure(scope, receive, send)

    async def _send_failure(self, scope: Any, receive: Any, send: Any) -> None:
        """After an unexpected exception: an OpenAI-shaped 500 if no header was sent, else (a stream) one SSE error
        event with the same object, ending the stream without ``[DONE]`` (the gateway's mid-stream shape)."""
        if not self.headers_sent:
            await _internal_error()(scope, receive, send)
        elif self.stream and not self.body_sent:
            event = b"data: " + _dumps(_error_obj(500, INTERNAL_ERROR + "; the response is incomplete",
                                                  "InternalServerError", None)) + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})
        # else the whole body was sent (a JSON body leaves with its headers): nothing is left to say


def _parse_common(engine: SimEngine, body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], Any]:
    """Validated request options, or an error response. Only an absent or ``null`` field takes its default; any
    other value of the wrong type (``"stream": 0``, ``"model": ""``, ``"stream_options": []``) is a 400 naming the
    field (or, for a string ``model`` naming nothing served, a 404)."""
    cfg = engine.config
    model = body.get("model")
    model = cfg.model if model is None else model
    if not isinstance(model, str):
        return {}, _error(400, f"'model' must be a string, got {type(model).__name__}", param="model")
    try:
        lora = engine.lora_of(model)
    except KeyError:
        return {}, _error(404, f"The model {model!r:.100} does not exist.", "NotFoundError", "model")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):  # vLLM's and SGLang's order
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return {}, _error(400, f"'{name}' must be an integer >= 1, got {value!r:.40}", param=name)
        if max_tokens is None:
            max_tokens = value
    if max_tokens is None:
        max_tokens = cfg.default_max_tokens
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        return {}, _error(400, f"'stream' must be a boolean, got {stream!r:.40}", param="stream")
    opts = body.get("stream_options")
    opts = {} if opts is None else opts
    include_usage = opts.get("include_usage") if isinstance(opts, dict) else None
    include_usage = False if include_usage is None else include_usage
    if not isinstance(opts, dict) or not isinstance(include_usage, bool):
        return {}, _error(400, "'stream_options' must be an object with a boolean 'include_usage', got "
                          f"{opts!r:.40}", param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            return {}, _error(400, "'cache_salt' must be a non-empty string", param="cache_salt")
        try:
            salt.encode("utf-8")  # the engine hashes the salt's UTF-8 bytes into block 0
        except UnicodeEncodeError as ex:
            return {}, _error(400, f"'cache_salt' is not encodable as UTF-8 at position {ex.start}: {ex.reason}",
                              param="cache_salt")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return {}, _error(400, f"'seed' must be an integer, got {seed!r:.40}", param="seed")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n != 1):
        return {}, _error(400, f"'n'={n!r:.20} is not supported by the stand-in engine (only 1)", param="n")
    return {"model": model, "lora": lora, "max_tokens": max_tokens, "stream": stream,
            "include_usage": include_usage and stream, "salt": salt, "seed": seed}, None


def build_app(config: EngineSimConfig, engine: SimEngine | None = None) -> Starlette:
    """The Starlette app of one stand-in engine. The engine is created at startup (inside the serving loop)
    unless given, and closed at shutdown; ``app.state.engine`` holds it."""

    def eng(request: Request) -> SimEngine:
        return request.app.state.engine

    async def generate(request: Request, chat: bool) -> Response:
        e = eng(request)
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        opts, err = _parse_common(e, body, chat)
        if err is not None:
            return err
        try:
            prompt = prompt_tokens("chat" if chat else "completion", body, e.tokenizer, e.chat_template)
        except PromptError as ex:
            return _error(400, str(ex), param="messages" if chat else "prompt")
        if prompt.num_tokens + opts["max_tokens"] > e.config.max_model_len:
            return _error(400, f"This model's maximum context length is {e.config.max_model_len} tokens; the request "
                               f"has {prompt.num_tokens} prompt tokens and max_tokens={opts['max_tokens']}",
                          param="max_tokens")
        fault = e.draw_faults()
        if fault.error:
            e.metrics.faults.labels("error").inc()
            return _error(500, "injected error (stand-in engine --error-rate)", "InternalServerError")
        rid = request.headers.get("x-request-id") or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        req = SimRequest(rid, prompt.token_ids, opts["max_tokens"], opts["lora"], opts["salt"], opts["seed"])
        return _EngineResponse(e, req, fault, chat=chat, stream=opts["stream"], include_usage=opts["include_usage"],
                               model=opts["model"])

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def models(request: Request) -> Response:
        e, created = eng(request), int(time.time())
        data = [{"id": name, "object": "model", "created": created, "owned_by": OWNED_BY,
                 "root": e.config.model, "parent": None if name == e.config.model else e.config.model,
                 "max_model_len": e.config.max_model_len} for name in e.config.served_names]
        return JSONResponse({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(eng(request).metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(request: Request) -> Response:
        e = eng(request)
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        special = body.get("add_special_tokens", "messages" not in body)
        if not isinstance(special, bool):
            return _error(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        try:
            if "messages" in body:  # rendered as a chat completion's prompt is (tools, flags, template kwargs)
                text = e.chat_template.render(body["messages"], **chat_render_args(body))
            else:
                text = body.get("prompt")
                if not isinstance(text, str):
                    return _error(400, "'prompt' must be a string (or give 'messages')", param="prompt")
            tokens = e.tokenizer.encode(text, add_special_tokens=special)
        except (ValueError, TypeError) as ex:
            return _error(400, str(ex))
        return JSONResponse({"count": len(tokens), "max_model_len": e.config.max_model_len, "tokens": tokens,
                             "token_strs": None})

    async def detokenize(request: Request) -> Response:
        e = eng(request)
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            return _error(400, "'tokens' must be a list of token ids", param="tokens")
        try:
            return JSONResponse({"prompt": e.tokenizer.decode(tokens)})
        except (TokenizerError, TypeError) as ex:
            return _error(400, str(ex), param="tokens")

    async def reset_prefix_cache(request: Request) -> Response:
        eng(request).reset_prefix_cache()
        return Response(status_code=200)

    def _info(e: SimEngine) -> dict[str, Any]:
        c = e.config
        return {"model_path": c.model, "served_model_name": c.model, "tokenizer_path": c.tokenizer or "bytes",
                "is_generation": True, "page_size": c.block_size, "max_total_num_tokens": e.capacity_blocks *
                c.block_size, "max_running_requests": c.max_num_seqs, "context_length": c.max_model_len,
                "version": "quillcache-engine-sim", "stand_in": STAND_IN_NOTE}

    async def model_info(request: Request) -> Response:
        e = eng(request)
        return JSONResponse({"model_path": e.config.model, "tokenizer_path": e.config.tokenizer or "bytes",
                             "is_generation": True, "stand_in": STAND_IN_NOTE})

    async def server_info(request: Request) -> Response:
        return JSONResponse(_info(eng(request)))

    async def get_load(request: Request) -> Response:
        e = eng(request)
        return JSONResponse([{"dp_rank": 0, "num_reqs": e.num_running + e.num_waiting,
                              "num_waiting_reqs": e.num_waiting, "num_tokens": e.kv_tokens}])

    async def version(request: Request) -> Response:
        return JSONResponse({"version": "quillcache-engine-sim", "stand_in": STAND_IN_NOTE})

    async def startup() -> None:
        if getattr(app.state, "engine", None) is None:
            app.state.engine = SimEngine(config)

    async def shutdown() -> None:
        app.state.engine.close()

    routes = [Route(path, _guarded(endpoint), methods=methods) for path, endpoint, methods in [
        ("/v1/completions", completions, ["POST"]),
        ("/v1/chat/completions", chat_completions, ["POST"]),
        ("/v1/models", models, ["GET"]),
        ("/health", health, ["GET"]),
        ("/health_generate", health, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/tokenize", tokenize, ["POST"]),
        ("/detokenize", detokenize, ["POST"]),
        ("/reset_prefix_cache", reset_prefix_cache, ["POST"]),
        ("/flush_cache", reset_prefix_cache, ["POST"]),
        ("/get_model_info", model_info, ["GET"]),
        ("/model_info", model_info, ["GET"]),
        ("/get_server_info", server_info, ["GET"]),
        ("/server_info", server_info, ["GET"]),
        ("/get_load", get_load, ["GET"]),
        ("/version", version, ["GET"]),
    ]]
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: Starlette):
        await startup()
        try:
            yield
        finally:
            await shutdown()

    app = Starlette(routes=routes, lifespan=lifespan)  # the body cap is _json_body's (an OpenAI-shaped 413)
    app.state.engine = engine
    return app
