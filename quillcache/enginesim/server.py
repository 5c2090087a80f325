"""Serve one STAND-IN engine with uvicorn (uvloop + httptools under ``quillcache.httpserve.guard``'s limits)
and announce it with one JSON line on stdout.

The line (printed once the socket accepts connections)::

    {"address": "http://HOST:PORT", "pid": int, "model": str, "gpu_blocks": int, "block_size": int,
     "kv_events": "tcp://..." | null, "kv_events_replay": "tcp://..." | null, "stand_in": true}

A port of 0 binds a free port (the line says which); SIGTERM/SIGINT stop it (in-flight streams get
``GRACEFUL_S`` seconds). Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys

from quillcache.enginesim.app import build_app
from quillcache.enginesim.config import EngineSimConfig
from quillcache.textproc import ChatTemplate, Tokenizer

__all__ = ["GRACEFUL_S", "serve"]

GRACEFUL_S = 2


def serve(config: EngineSimConfig, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
          tokenizer: Tokenizer | None = None, chat_template: ChatTemplate | None = None) -> int:
    """Serve until signalled; returns the exit status. ``tokenizer`` / ``chat_template``: the config's, already
    loaded (None: the engine loads them)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        print(f"quillcache engine-sim: cannot listen on {host}:{port}: {e.strerror}", file=sys.stderr)
        sock.close()
        return 1
    sock.listen(4096)
    bound_port = sock.getsockname()[1]
    import zmq

    from quillcache.enginesim.engine import SimEngine

    try:  # built before serving, so a bad KV-event endpoint is one line, not a lifespan traceback
        engine = SimEngine(config, tokenizer=tokenizer, chat_template=chat_template)
    except (ValueError, zmq.ZMQError) as e:
        print(f"quillcache engine-sim: KV events: {e} (--kv-events / --kv-events-replay)", file=sys.stderr)
        sock.close()
        return 2 if isinstance(e, ValueError) else 1
    app = build_app(config, engine)
    from quillcache.httpserve.guard import guarded_protocol

    # httptools under quillcache.httpserve.guard's default limits (head size and time, body silence)
    uv = uvicorn.Config(app, loop="uvloop", http=guarded_protocol(), log_level=log_level, access_log=False,
                        lifespan="on", timeout_graceful_shutdown=GRACEFUL_S, backlog=4096)
    server = uvicorn.Server(uv)

    async def main() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
        if server.started:
            engine = app.state.engine
            pub = engine.publisher
            print(json.dumps({"address": f"http://{host}:{bound_port}", "pid": os.getpid(), "model": config.model,
                              "gpu_blocks": engine.capacity_blocks, "block_size": config.block_size,
                              "kv_events": pub.endpoint if pub else None,
                              "kv_events_replay": pub.replay_endpoint if pub else None, "stand_in": True}),
                  flush=True)
        await task

    try:
        try:
            import uvloop
        except ImportError:  # uvicorn[standard] brings it; plain asyncio still works
            asyncio.run(main())
        else:
            uvloop.run(main())
    finally:
        sock.close()
    return 0 if server.started else 1
