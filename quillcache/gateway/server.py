"""Run a gateway: in this process (``serve``, what ``quillcache gateway`` does) or as a child process
(``GatewayProcess``, for tests and studies).

``serve`` binds the listening socket itself (so ``--port 0`` gets a free port), runs uvicorn with
uvloop and httptools (``uvicorn[standard]``) under ``quillcache.httpserve.guard``'s limits on client
requests (head size and time, body silence: ``limits.max_head_bytes``, ``timeouts.client_head_s`` /
``client_body_s``), prints ONE JSON line ``{"address", "url", "pid",
"engines", "models"}`` on stdout once the gateway serves (after its first health probe), logs to
stderr, and stops on SIGTERM/SIGINT (uvicorn's handlers: in-flight streams are cancelled, every
lease released). A gateway that cannot start (``Gateway.start`` failed, e.g. ``peer_bind`` on an
address in use) stops what it had started, prints one line naming why on stderr (no traceback),
and ``serve`` returns 1 before the JSON line.

``GatewayProcess(engines=[url...], keys={key: tenant}, **config)`` writes a key file and a config
file into a temporary directory, starts ``python -m quillcache gateway`` on 127.0.0.1 port 0,
waits for its JSON line and ``/ready`` with a deadline (never a fixed sleep), and always stops it
(SIGTERM, then SIGKILL after a grace period) on exit. The directory (``TEMP_PREFIX``) names this
process and the gateway as its users (``quillcache.cluster.tempdirs``): exit removes it, and one a
SIGKILLed process left is removed by the next ``GatewayProcess`` once neither of them runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quillcache.cli.parent import kill_on_parent_death
from quillcache.cluster.tempdirs import add_user, make_owned_dir, sweep_stale_dirs

if TYPE_CHECKING:
    from quillcache.textproc import ChatTemplate, Tokenizer

__all__ = ["TEMP_PREFIX", "GatewayProcess", "serve"]

TEMP_PREFIX = "qc-gateway-"  # GatewayProcess's config/keys/stderr directory under tempfile.gettempdir()


def serve(config, tenants, *, host: str = "127.0.0.1", port: int = 0, secret: bytes = b"",
          log_level: str = "warning", backlog: int = 4096, tokenizer: Tokenizer | None = None,
          template: ChatTemplate | None = None) -> int:
    """Serve until signalled (module doc); returns the exit status. ``tokenizer`` / ``template``: the config's,
    already loaded (None: the gateway loads them)."""
    import uvicorn

    from quillcache.gateway.app import Gateway, GatewayStartError
    from quillcache.httpserve.guard import HttpGuard, guarded_protocol

    gw = Gateway(config, tenants, secret=secret, tokenizer=tokenizer, template=template)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it (Linux): without it Nagle holds each small SSE event behind the
    # client's delayed ACK of the headers (tens of ms per stream)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"quillcache gateway: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    sock.listen(backlog)
    sock.set_inheritable(True)
    bound = sock.getsockname()
    # proxy_headers off: the gateway is the front door (no X-Forwarded-* to trust), and the middleware costs a layer
    # httptools under quillcache.httpserve.guard's limits: no client holds a connection with a stalled or endless request
    guard = HttpGuard(max_head_bytes=config.limits.max_head_bytes, head_timeout_s=config.timeouts.client_head_s,
                      body_timeout_s=config.timeouts.client_body_s)
    ucfg = uvicorn.Config(gw.asgi, interface="asgi3", loop="uvloop", http=guarded_protocol(guard), lifespan="on",
                          log_level=log_level, access_log=False, proxy_headers=False, backlog=backlog,
                          timeout_keep_alive=30, timeout_graceful_shutdown=5)
    server = uvicorn.Server(ucfg)

    async def main() -> bool:
        try:  # here, not in uvicorn's lifespan: a failure is one line, not a traceback, and start() stopped it
            await gw.start()
        except Exception as exc:  # noqa: BLE001 - any start-up failure ends the process with one line
            why = str(exc) if isinstance(exc, GatewayStartError) else f"{type(exc).__name__}: {exc}"
            print(f"quillcache gateway: cannot start: {why}", file=sys.stderr, flush=True)
            return False
        try:
            task = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0.01)
            if server.started:
                addr = f"{bound[0]}:{bound[1]}"
                print(json.dumps({"address": addr, "url": f"http://{addr}", "pid": os.getpid(),
                                  "engines": {e.name: e.url for e in config.engines},
                                  "models": sorted(gw.models),
                                  "peer": gw.decider.peers.endpoint if gw.decider.peers is not None else None}),
                      flush=True)
            await task
        finally:
            if gw.started:  # the server stopped before its lifespan's shutdown (which stops the gateway)
                await gw.stop()
        return server.started

    import gc

    import uvloop

    # the residency tracker holds one small object per cached block (tens of thousands): move what
    # start-up built out of the collector's way and collect the young generation less eagerly, so
    # full collections do not stall streams
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    try:
        return 0 if uvloop.run(main()) else 1
    finally:
        sock.close()




class GatewayProcess:
    """A gateway in a child process (module doc). ``url`` is its base URL once entered; ``wait_ready=False``
    returns once it serves, before any engine is healthy. Should this process die without leaving the
    ``with`` (SIGKILL), the kernel sends the gateway SIGTERM (``quillcache.cli.parent.kill_on_parent_death``;
    Linux, when entered from the main thread)."""

    def __init__(self, engines: list[str] | None = None, *, keys: dict[str, str] | None = None,
                 key_limits: dict[str, int] | None = None, config: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 60.0,
                 log_level: str = "warning", wait_ready: bool = True) -> None:
        self.config = dict(config or {})
        if engines is not None:
            self.config["engines"] = [e if isinstance(e, dict) else {"url": e, "name": f"e{i}"}
                                      for i, e in enumerate(engines)]
        self.keys = keys or {"sk-test-tenant-a": "tenant-a"}
        self.key_limits = key_limits or {}
        self.env = env or {}
        self.start_timeout_s = start_timeout_s
        self.log_level = log_level
        self.wait_ready = wait_ready
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.info: dict[str, Any] = {}
        self.dir: Path | None = None  # the temporary directory (module doc) while entered

    def __enter__(self) -> GatewayProcess:
        sweep_stale_dirs(TEMP_PREFIX)  # what a SIGKILLed owner left (no exit ran)
        self.dir = d = make_owned_dir(TEMP_PREFIX)
        try:
            (d / "config.json").write_text(json.dumps(self.config))
            keys = [{"key": k, "tenant": t,
                     **({"max_concurrency": self.key_limits[k]} if k in self.key_limits else {})}
                    for k, t in self.keys.items()]
            (d / "keys.json").write_text(json.dumps({"keys": keys}))
            cmd = [sys.executable, "-m", "quillcache", "gateway", "--config", str(d / "config.json"),
                   "--keys", str(d / "keys.json"), "--host", "127.0.0.1", "--port", "0",
                   "--log-level", self.log_level]
            env = {**os.environ, **self.env}
            # the kernel stops the gateway should this process die without stopping it (a killed study or
            # test run): nothing else would, since it reads nothing from us
            with open(d / "stderr.log", "wb") as log:
                self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
                                             preexec_fn=kill_on_parent_death(signal.SIGTERM))
            add_user(d, self.proc.pid)  # no sweep removes the directory while the gateway runs
            self._wait_started()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_started(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        import selectors

        deadline = time.monotonic() + self.start_timeout_s
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        line = ""
        try:
            while time.monotonic() < deadline and not line:
                if sel.select(timeout=0.05):
                    line = self.proc.stdout.readline()
                if not line and self.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited with {self.proc.returncode}: {self.stderr_tail()}")
        finally:
            sel.close()
        if not line:
            raise TimeoutError(f"gateway did not start within {self.start_timeout_s} s: {self.stderr_tail()}")
        self.info = json.loads(line)
        self.url = self.info["url"]
        if not self.wait_ready:
            return
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.02)
        raise TimeoutError(f"gateway not ready within {self.start_timeout_s} s: {self.stderr_tail()}")

    def stderr_tail(self, n_bytes: int = 2000) -> str:
        if self.dir is None:
            return ""
        p = self.dir / "stderr.log"
        return p.read_bytes()[-n_bytes:].decode(errors="replace") if p.exists() else ""

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self, grace_s: float = 10.0) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if p is not None and p.stdout is not None:
            p.stdout.close()
        self.proc = None

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
