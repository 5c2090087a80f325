"""The fronts the gateway study puts between its client and the stand-in engines, each in its own process(es).

A :class:`Front` names what runs (``kind`` in :data:`FRONT_KINDS`), its policy and how many replicas; entering
:func:`start_front` starts them on 127.0.0.1 free ports, waits (polling with a deadline) until a probe completion
through every replica succeeds, and always stops them on exit. Kinds:

- ``gateway``: ``quillcache gateway`` (:class:`quillcache.gateway.server.GatewayProcess`), router ``policy``
  (``dynamo`` = the planner's Dynamo cost router + identity guard; ``prefix_affinity``; ``round_robin``), prefix
  state from the engines' KV events. Replicas are separate processes that each subscribe to every engine's events
  (so they share one view of the engines' caches), exchange their routing-time speculation over the gateway's
  peer link (``peer_bind``/``peers``), and derive the same per-tenant ``cache_salt``.
- ``sglang-router``: ``python -m sglang_router.launch_router`` (PyPI ``sglang-router``, Rust) with ``--policy``.
- ``vllm-router``: ``python -m vllm_router.launch_router`` (PyPI ``vllm-router``, Rust) with ``--policy``.
- ``direct``: no process; the client talks to the first engine.

The Rust routers need the ``gateway-baselines`` extra; :func:`missing` says why a kind cannot run here.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from quillcache.cli.parent import kill_on_parent_death
from quillcache.registry import Registry
from quillcache.cluster.etcd import free_port as _free_port

__all__ = ["Front", "FRONT_KINDS", "RunningFront", "missing", "start_front"]


@dataclass(frozen=True, kw_only=True)
class Front:
    """What stands between the client and the engines (module doc)."""

    kind: str  # a FRONT_KINDS name
    policy: str = ""  # the router's policy ("" for direct)
    replicas: int = 1
    label: str = ""  # the subject in results; derived when empty
    upstream: str = ""  # the gateway's upstream_client (quillcache.gateway.clients.UPSTREAM_CLIENTS); "" = default

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.kind == "direct":
            return "direct (one engine)"
        base = {"gateway": "quillcache gateway", "sglang-router": "sglang-router",
                "vllm-router": "vllm-router"}[self.kind]
        default = "cache_aware" if self.kind == "gateway" else ""  # the gateway's default router: no suffix
        pol = "" if self.policy in (default, "") else f" {self.policy}"
        return f"{base}{pol}" + (f" x{self.replicas}" if self.replicas > 1 else "")

    @property
    def sends_own_salt(self) -> bool:
        """Whether the client must send the tenant's ``cache_salt`` itself (every front but the gateway)."""
        return self.kind != "gateway"


@dataclass(frozen=True)
class RunningFront:
    front: Front
    urls: tuple[str, ...]
    versions: str = ""
    pids: tuple[int, ...] = ()  # the front's processes (none for direct)

    def cpu_s(self) -> float:
        """User + system CPU seconds the front's processes have used so far (Linux ``/proc``)."""
        return sum(cpu_seconds(p) for p in self.pids)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")




FRONT_KINDS: Registry[str] = Registry("front kind")
FRONT_KINDS.register("gateway", "quillcache.gateway")
FRONT_KINDS.register("sglang-router", "sglang_router")
FRONT_KINDS.register("vllm-router", "vllm_router")
FRONT_KINDS.register("direct", "")


def missing(kind: str) -> str | None:
    """Why ``kind`` cannot run here (its package is not installed), or None."""
    module = FRONT_KINDS.get(kind)
    if module and importlib.util.find_spec(module) is None:
        return (f"{kind} is not installed (pip install -e '.[gateway-baselines]' installs the Rust routers "
                f"sglang-router and vllm-router)")
    return None


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{dist} {version(dist)}"
    except PackageNotFoundError:
        return dist


class _RouterProcess:
    """One Rust router process (``python -m <module>.launch_router``), always stopped."""

    def __init__(self, module: str, args: Sequence[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix=f"{module}-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", f"{module}.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "RUST_LOG": "warn", "NO_COLOR": "1"},
                                     preexec_fn=kill_on_parent_death(signal.SIGTERM))

    def tail(self, n: int = 1500) -> str:
        return Path(self._log.name).read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)


def _probe(url: str, body: dict, headers: dict, deadline: float, what: str, tail=lambda: "", alive=None) -> None:
    """POST a tiny completion until it answers 200 (the front has its workers), within the deadline."""
    data = json.dumps(body).encode()
    last = ""
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + "/v1/completions", data=data,
                                     headers={"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                r.read()
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}: {e.read()[:200]!r}"
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            last = f"{type(e).__name__}: {e}"[:200]
        if alive is not None and not alive():
            raise RuntimeError(f"{what} exited before serving at {url}; log tail: {tail()}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} at {url} not serving before the deadline ({last}); log tail: {tail()}")


@contextlib.contextmanager
def start_front(front: Front, engines: Sequence[dict], *, keys: dict[str, str], model: str,
                start_timeout_s: float = 60.0, gateway_config: dict | None = None) -> Iterator[RunningFront]:
    """Start ``front`` in front of ``engines`` (``{"url", "name", "kv_events"}`` each); yield its URLs.

    ``keys`` maps API key -> tenant (the gateway's key table; the probe uses the first key)."""
    reason = missing(front.kind)
    if reason:
        raise RuntimeError(reason)
    probe_key, probe_tenant = next(iter(keys.items()))
    probe = {"model": model, "prompt": "probe", "max_tokens": 1, "stream": False}
    deadline = time.monotonic() + start_timeout_s
    if front.kind == "direct":
        yield RunningFront(front, (engines[0]["url"],), "")
        return
    with contextlib.ExitStack() as stack:
        urls = []
        pids = []
        if front.kind == "gateway":
            from quillcache.gateway.server import GatewayProcess

            cfg = {"router": front.policy or "cache_aware", "block_size_tokens": 16,
                   **({"upstream_client": front.upstream} if front.upstream else {}), **(gateway_config or {})}
            # replicas link to each other (quillcache.gateway.peers): each publishes its routing-time speculation
            # and subscribes to the others'; every replica also subscribes to every engine's KV events
            links = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(front.replicas)] if front.replicas > 1 else []
            for i in range(front.replicas):
                rcfg = dict(cfg)
                if links:
                    rcfg.update(peer_bind=links[i], peers=[u for j, u in enumerate(links) if j != i])
                gw = stack.enter_context(GatewayProcess(
                    engines=[{k: e[k] for k in ("url", "name", "kv_events", "kv_events_replay") if e.get(k)}
                             for e in engines], keys=keys,
                    config=rcfg, start_timeout_s=start_timeout_s))
                _probe(gw.url, probe, {"Authorization": f"Bearer {probe_key}"}, deadline, front.name,
                       gw.stderr_tail)
                urls.append(gw.url)
                pids.append(gw.proc.pid)
            version = "quillcache gateway (this repository)"
        else:
            module = FRONT_KINDS.get(front.kind)
            args = ["--worker-urls", *[e["url"] for e in engines], "--policy", front.policy or "cache_aware",
                    "--log-level", "warn" if front.kind == "sglang-router" else "warning"]
            from quillcache.gateway.tenants import salt_for

            for _ in range(front.replicas):
                for attempt in range(3):  # the free port is chosen before the router binds it: another process
                    rp = _RouterProcess(module, args)  # may take it first, then the router exits; try a new one
                    stack.callback(rp.stop)
                    try:
                        _probe(rp.url, {**probe, "cache_salt": salt_for(probe_tenant)}, {}, deadline, front.name,
                               rp.tail, alive=lambda: rp.proc.poll() is None)
                        break
                    except RuntimeError:
                        if attempt == 2 or rp.proc.poll() is None:
                            raise
                urls.append(rp.url)
                pids.append(rp.proc.pid)
            version = _version(front.kind)
        yield RunningFront(front, tuple(urls), version, tuple(pids))
