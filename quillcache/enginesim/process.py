"""``EngineSimProcess``: run one STAND-IN engine (``quillcache engine-sim``) in a subprocess, for tests and studies.

Contract: ``with EngineSimProcess(["--fixed-ttft-ms", "500"]) as sim:`` (or ``EngineSimProcess(fixed_ttft_ms=500)``:
keyword options become flags, ``options_to_args``) starts ``python -m quillcache engine-sim
--host 127.0.0.1 --port 0 ARGS``, reads its JSON line (the bound address, KV-event endpoints) and polls
``GET /health`` until it answers 200, both within ``start_timeout_s`` (else ``RuntimeError`` with the tail of its
stderr). On exit it is ALWAYS stopped: SIGTERM, then SIGKILL after ``stop_timeout_s``; ``stop`` (also run when
``start`` fails) keeps the tail of its stderr for ``stderr_tail``. The stderr log is an anonymous temporary file
(``tempfile.TemporaryFile``: on Linux it never has a name), so no run leaves a file behind, not even one killed
before ``stop``. ``sim.url`` is
``http://127.0.0.1:PORT``; ``sim.info`` the whole JSON line; ``sim.metrics()`` parses ``/metrics`` into
``{name{labels}: value}``. Should this process die without stopping it (SIGKILL), the kernel sends the engine
SIGTERM (``quillcache.cli.parent.kill_on_parent_death``; Linux, when started from the main thread).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Sequence

from quillcache.cli.parent import kill_on_parent_death

__all__ = ["EngineSimProcess", "options_to_args", "parse_metrics"]


def options_to_args(options: dict[str, object]) -> list[str]:
    """``{"fixed_ttft_ms": 500, "lora": ["a", "b"]}`` -> ``["--fixed-ttft-ms", "500", "--lora", "a", "--lora", "b"]``
    (None is left out; a value of True is not accepted: every engine-sim option takes a value)."""
    out: list[str] = []
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool):
            raise TypeError(f"engine-sim option {key}={value!r}: every option takes a value")
        flag = "--" + key.replace("_", "-")
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            out += [flag, str(v)]
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{"name{labels}": value}`` (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


class EngineSimProcess:
    def __init__(self, args: Sequence[str] = (), *, start_timeout_s: float = 20.0, stop_timeout_s: float = 5.0,
                 env: dict[str, str] | None = None, **options: object) -> None:
        self.args = [str(a) for a in args] + options_to_args(options)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict = {}
        self._stderr = None  # the engine's stderr: an anonymous temporary file, open until ``stop``
        self._stderr_final = ""  # the log's tail, kept when ``stop`` closes the file

    @property
    def url(self) -> str:
        return self.info["address"]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stderr_tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the engine's stderr; after ``stop`` the last 4000 bytes it wrote."""
        if self._stderr is None:
            return self._stderr_final[-n_bytes:]
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - 4 * n_bytes)  # whole UTF-8 characters of the last n_bytes, and pread moves no offset
        return os.pread(fd, size - start, start).decode(errors="replace")[-n_bytes:]

    def start(self) -> EngineSimProcess:
        self._stderr = tempfile.TemporaryFile(prefix="engine-sim-", suffix=".log")
        env = dict(os.environ, **(self.env or {}))
        cmd = [sys.executable, "-m", "quillcache", "engine-sim", "--host", "127.0.0.1", "--port", "0", *self.args]
        # stopped by the kernel should this process die without stopping it (a killed study or test run)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env,
                                     preexec_fn=kill_on_parent_death(signal.SIGTERM))
        deadline = time.monotonic() + self.start_timeout_s
        try:
            line = self._read_line(deadline)
            self.info = json.loads(line)
            while True:
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                        if r.status == 200:
                            return self
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"engine-sim at {self.url} not healthy within {self.start_timeout_s} s; "
                                       f"stderr: {self.stderr_tail()}")
                time.sleep(0.02)
        except BaseException:
            self.stop()
            raise

    def _read_line(self, deadline: float) -> str:
        import selectors

        assert self.proc is not None and self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while time.monotonic() < deadline:
                if sel.select(timeout=0.05):
                    line = self.proc.stdout.readline()
                    if line:
                        return line
                if self.proc.poll() is not None:
                    break
        finally:
            sel.close()
        raise RuntimeError(f"engine-sim printed no address line (exit {self.proc.poll()}); "
                           f"stderr: {self.stderr_tail()}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._stderr is not None:  # the log goes with the process; its tail stays readable
            self._stderr_final = self.stderr_tail()
            self._stderr.close()
            self._stderr = None
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5.0) as r:
            return parse_metrics(r.read().decode())

    def __enter__(self) -> EngineSimProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
