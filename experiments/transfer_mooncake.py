"""Mooncake Transfer Engine over TCP as a same-run baseline for the transfer study.

Two processes on loopback move blocks through Mooncake's ``TransferEngine`` (the engine API, not
the store): ``initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")`` (no metadata server: the peers
exchange segment descriptors over the engine's own RPC port), ``register_memory`` on an mmap'd,
pre-touched buffer, then ``transfer_sync_read|write`` (batch == 1) or
``batch_transfer_sync_read|write`` (batch > 1) from the client to the server's registered memory.

Mooncake lives in its OWN virtualenv under ``workdir`` (the project's venv never depends on it);
:func:`prepare` builds it (recipe: ``experiments/mooncake/README.md``), :func:`run_mooncake` drives
two children (``experiments/transfer_mooncake_peer.py``) running under that venv's python.

Measurement (GB = 1e9 bytes): wall time (``time.perf_counter``) around every engine call (the latencies)
and around each repeat's whole loop of calls (``seconds``); per repeat ``gbps = bytes moved / seconds``, the
loop's wall time, as the transfer study times its other subjects; latency per request when ``batch == 1``, per
batch call otherwise (``latency_unit``); CPU = ``resource.getrusage`` user+system deltas of BOTH
processes (each measures its own) per GB moved. Data is checked after the timed repeats: crc32 of
every destination slot equals that of its source slot (the destination was zeroed first).

Memory is capped: each side holds ``slots = min(batch, max(1, max_buffer_bytes // block_bytes))``
distinct blocks; block ``i`` of a batch uses slot ``i % slots`` on both sides (so a 128 x 32 MiB
batch moves 4 GiB through 1 GiB of buffer per side; ``distinct_slots`` says when that happened).
Calls per repeat: ``calls_per_repeat`` when given (the transfer study passes its own count, so every subject
of a cell does the same work), else enough for about ``bytes_per_repeat`` (default 1 GiB), at least 1, at most
``max_calls_per_repeat``; one unmeasured warm-up call first (handshake, first connection).

``python -m experiments.transfer_mooncake [--workdir DIR]`` prepares and prints the table.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "transfer_mooncake_peer.py"
STUB_SOURCE = HERE / "mooncake" / "cuda_stub.c"

#: pinned for reproducibility; override with $QUILLCACHE_MOONCAKE_SPEC / $QUILLCACHE_CUDART_SPEC
MOONCAKE_SPEC = os.environ.get("QUILLCACHE_MOONCAKE_SPEC", "mooncake-transfer-engine==0.3.13.post1")
CUDART_SPEC = os.environ.get("QUILLCACHE_CUDART_SPEC", "nvidia-cuda-runtime-cu12==12.9.79")
STAMP_NAME = "prepared.json"
STAMP_FORMAT = 1
VENV_NAME = "mooncake-venv"
GB = 1e9
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

#: environment of the peers besides LD_LIBRARY_PATH: Mooncake's defaults (fresh TCP connection per
#: transfer, no pool) are what its users get; ``engine_env`` of run_mooncake adds to this
BASE_ENGINE_ENV: dict[str, str] = {}


@dataclass
class MooncakeAvailability:
    ok: bool
    reason: str
    version: str | None


def default_workdir() -> Path:
    """``$QUILLCACHE_MOONCAKE_WORKDIR`` or ``~/.cache/quillcache/mooncake``."""
    env = os.environ.get("QUILLCACHE_MOONCAKE_WORKDIR")
    return Path(env) if env else Path.home() / ".cache" / "quillcache" / "mooncake"


# ------------------------------------------------------------------------------------------
# prepare
# ------------------------------------------------------------------------------------------

def _tail(text: str | bytes | None, n: int = 600) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _sh(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """Run with no stdin; (returncode, stdout+stderr). A timeout or a missing program is rc 124/127."""
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=timeout, env=env)
        return p.returncode, p.stdout.decode("utf-8", "replace")
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{_tail(exc.stdout)}"
    except OSError as exc:
        return 127, f"cannot run {cmd[0]}: {exc}"


def _apt_install(packages: list[str], timeout: float = 600) -> str | None:
    """apt-get install (non-interactive; an ``apt-get update`` and one retry on failure). None or the reason."""
    if os.geteuid() != 0:
        return f"need Debian packages {packages} but not root (install them: apt-get install {' '.join(packages)})"
    if shutil.which("apt-get") is None:
        return f"need Debian packages {packages} but there is no apt-get on this machine"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    rc, out = _sh(cmd, timeout, env)
    if rc == 0:
        return None
    rc_u, out_u = _sh(["apt-get", "update", "-q"], timeout, env)
    if rc_u != 0:
        return f"apt-get update failed (rc {rc_u}; apt unreachable?): {_tail(out_u)}"
    rc, out = _sh(cmd, timeout, env)
    return None if rc == 0 else f"apt-get install {' '.join(packages)} failed (rc {rc}): {_tail(out)}"


#: system libraries Mooncake's engine.so links (besides the wheel's own), and their Debian packages
SYSTEM_LIBS = {"libibverbs.so.1": "libibverbs1", "libmlx5.so.1": "ibverbs-providers", "libnuma.so.1": "libnuma1",
               "libcurl.so.4": "libcurl4"}


def _missing_system_libs(stamp: dict) -> tuple[list[str], str | None]:
    """Shared objects ``ldd`` cannot find for the engine under the peers' environment."""
    engine_so = Path(stamp["site_packages"]) / "mooncake" / "engine.so"
    if shutil.which("ldd") is None:
        rc, out = _sh(["ldconfig", "-p"], 30)
        return [lib for lib in SYSTEM_LIBS if lib not in out], None
    rc, out = _sh(["ldd", str(engine_so)], 60, peer_env(stamp))
    if rc != 0 and "not found" not in out:
        return [], f"ldd {engine_so} failed (rc {rc}): {_tail(out)}"
    return sorted({m.group(1) for m in re.finditer(r"^\s*(\S+) => not found", out, re.M)}), None


def _base_python() -> str | None:
    """An interpreter for the venv: python3.11 first (Debian 12's own), else any 3.10-3.13."""
    for cand in ("python3.11", "python3.12", "python3.10", "python3.13", "python3", sys.executable):
        path = shutil.which(cand) if os.sep not in cand else cand
        if not path:
            continue
        rc, out = _sh([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2], sys.executable)"], 30)
        parts = out.split()
        if rc == 0 and len(parts) == 2 and parts[0] in ("3.10", "3.11", "3.12", "3.13"):
            return parts[1]
    return None


def _venv_python(workdir: Path) -> Path:
    return workdir / VENV_NAME / "bin" / "python"


def _site_packages(venv_python: Path) -> Path | None:
    rc, out = _sh([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 60)
    return Path(out.strip().splitlines()[-1]) if rc == 0 and out.strip() else None


def _undefined_cu_symbols(so_dir: Path) -> tuple[set[str], str | None]:
    """Every ``cu*`` driver symbol the package's shared objects import (``nm -D --undefined-only``)."""
    nm = shutil.which("nm")
    if nm is None:
        return set(), "nm (binutils) not found: stub built from the static symbol list only"
    syms: set[str] = set()
    for so in sorted(so_dir.rglob("*.so*")):
        rc, out = _sh([nm, "-D", "--undefined-only", str(so)], 60)
        if rc != 0:
            continue
        for line in out.splitlines():
            name = line.split()[-1].split("@")[0] if line.split() else ""
            if re.fullmatch(r"cu[A-Z]\w*", name):
                syms.add(name)
    return syms, None


def _build_stub(workdir: Path, site: Path) -> tuple[Path | None, str]:
    """Compile ``libcuda.so.1`` from cuda_stub.c plus any cu* symbol the wheel imports that it lacks."""
    if not STUB_SOURCE.is_file():
        return None, f"stub source {STUB_SOURCE} is missing"
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        why = _apt_install(["gcc", "libc6-dev", "binutils"])
        gcc = shutil.which("gcc")
        if gcc is None:
            return None, f"no C compiler to build the libcuda.so.1 stub: {why}"
    src = STUB_SOURCE.read_text()
    defined = set(re.findall(r"\b(cu[A-Z]\w*)\s*\(", src)) | set(re.findall(r"\bSTUB\((cu[A-Z]\w*)\)", src))
    needed, note = _undefined_cu_symbols(site / "mooncake")
    extra = sorted(needed - defined)
    if extra:
        src += "".join(f"STUB({name})\n" for name in extra)
    libdir = workdir / "lib"
    libdir.mkdir(parents=True, exist_ok=True)
    (libdir / "cuda_stub.c").write_text(src)
    out_so = libdir / "libcuda.so.1"
    rc, out = _sh([gcc, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(out_so),
                   str(libdir / "cuda_stub.c")], 120)
    if rc != 0:
        return None, f"building the libcuda.so.1 stub failed (rc {rc}): {_tail(out)}"
    msg = f"stub defines {len(defined | set(extra))} cu* symbols ({len(extra)} added from nm)"
    return out_so, msg + (f"; {note}" if note else "")


def read_stamp(workdir: Path) -> dict | None:
    try:
        stamp = json.loads((Path(workdir) / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) and stamp.get("format") == STAMP_FORMAT else None


def _stamp_problem(workdir: Path, stamp: dict | None) -> str | None:
    """Why a prepared workdir cannot be used (None when it can)."""
    if stamp is None:
        return (f"Mooncake is not prepared in {workdir} (no valid {STAMP_NAME}); "
                f"run experiments.transfer_mooncake.prepare(workdir) first")
    for key in ("venv_python", "site_packages", "libcuda_stub", "cudart_dir"):
        p = Path(stamp.get(key, ""))
        if not p.exists():
            return f"the prepared Mooncake setup in {workdir} is incomplete: {key} {p} is missing; run prepare() again"
    return None


def peer_env(stamp: dict, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a peer: the Mooncake venv, the stub libcuda and libcudart on LD_LIBRARY_PATH."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_PRELOAD", "PYTHONSTARTUP")}
    libs = [str(Path(stamp["libcuda_stub"]).parent), stamp["cudart_dir"]]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    env["VIRTUAL_ENV"] = str(Path(stamp["venv_python"]).parent.parent)
    env["PATH"] = str(Path(stamp["venv_python"]).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(BASE_ENGINE_ENV)
    env.update(extra or {})
    return env


def prepare(workdir: Path) -> MooncakeAvailability:
    """Install or locate everything Mooncake needs under ``workdir``; never raises.

    Steps (idempotent: a stamp file ``prepared.json`` short-cuts a prepared workdir):
    1. a virtualenv ``workdir/mooncake-venv`` from python3.11 with ``mooncake-transfer-engine`` and
       ``nvidia-cuda-runtime-cu12`` (``libcudart.so.12``) from PyPI;
    2. ``workdir/lib/libcuda.so.1``: a stub built with gcc from ``experiments/mooncake/cuda_stub.c``
       (plus any cu* symbol ``nm -D --undefined-only`` finds that the file lacks);
    3. the Debian libraries ``ldd`` says engine.so lacks (``libibverbs1``, ``ibverbs-providers`` for
       libmlx5.so.1, ...: ``apt-get install`` as root, ``apt-get update`` and a retry on failure);
    4. ``transfer_mooncake_peer.py --check`` under that venv and environment (imports the engine).
    """
    t0 = time.monotonic()
    try:
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        with open(workdir / ".prepare.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _prepare_locked(workdir, t0)
    except Exception as exc:  # noqa: BLE001 - prepare never raises: it says why not
        return MooncakeAvailability(False, f"prepare failed: {type(exc).__name__}: {exc}", None)


def _check_import(stamp: dict) -> tuple[str | None, str | None]:
    """(version, None) when the peer script imports the engine under the prepared environment."""
    rc, out = _sh([stamp["venv_python"], str(PEER_SCRIPT), "--check"], 120, peer_env(stamp))
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("ok"):
                return msg.get("version"), None
    return None, f"importing mooncake.engine in {stamp['venv_python']} failed (rc {rc}): {_tail(out, 1200)}"


def _prepare_locked(workdir: Path, t0: float) -> MooncakeAvailability:
    stamp = read_stamp(workdir)
    if (stamp is not None and _stamp_problem(workdir, stamp) is None
            and stamp.get("spec") == [MOONCAKE_SPEC, CUDART_SPEC] and not _missing_system_libs(stamp)[0]):
        return MooncakeAvailability(True, f"already prepared in {workdir} "
                                          f"(took {stamp.get('prepare_s', float('nan')):.1f} s then)", stamp.get("version"))
    steps: list[str] = []
    # 1. the venv with the wheels
    vpy = _venv_python(workdir)
    if not vpy.exists():
        base = _base_python()
        if base is None:
            return MooncakeAvailability(False, "no Python 3.10-3.13 interpreter to build the Mooncake venv from "
                                               "(mooncake-transfer-engine wheels need one)", None)
        rc, out = _sh([base, "-m", "venv", "--clear", str(workdir / VENV_NAME)], 300)
        if rc != 0 or not vpy.exists():
            return MooncakeAvailability(False, f"{base} -m venv {workdir / VENV_NAME} failed (rc {rc}): {_tail(out)}", None)
        steps.append(f"venv from {base}")
    pip_env = dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip_env.pop("PYTHONPATH", None)
    pip_env.pop("VIRTUAL_ENV", None)
    t_pip = time.monotonic()
    rc, out = _sh([str(vpy), "-m", "pip", "install", "--no-input", "--timeout", "60", MOONCAKE_SPEC, CUDART_SPEC],
                  1200, pip_env)
    if rc != 0:
        return MooncakeAvailability(False, f"pip install {MOONCAKE_SPEC} {CUDART_SPEC} failed (rc {rc}; "
                                           f"PyPI unreachable?): {_tail(out, 1200)}", None)
    steps.append(f"pip install {MOONCAKE_SPEC} {CUDART_SPEC} ({time.monotonic() - t_pip:.1f} s)")
    site = _site_packages(vpy)
    if site is None or not (site / "mooncake").is_dir():
        return MooncakeAvailability(False, f"pip reported success but {site}/mooncake is missing", None)
    cudart = sorted(site.glob("nvidia/cuda_runtime/lib/libcudart.so.12*"))
    if not cudart:
        return MooncakeAvailability(False, f"libcudart.so.12 not found under {site}/nvidia/cuda_runtime/lib", None)
    # 2. the libcuda.so.1 stub
    so, msg = _build_stub(workdir, site)
    if so is None:
        return MooncakeAvailability(False, msg, None)
    steps.append(msg)
    stamp = {"format": STAMP_FORMAT, "spec": [MOONCAKE_SPEC, CUDART_SPEC], "venv_python": str(vpy),
             "site_packages": str(site), "cudart_dir": str(cudart[0].parent), "libcuda_stub": str(so)}
    # 3. Debian libraries the engine links (libibverbs1, ibverbs-providers for libmlx5, ...)
    missing, why = _missing_system_libs(stamp)
    if why:
        return MooncakeAvailability(False, why, None)
    if missing:
        unknown = [lib for lib in missing if lib not in SYSTEM_LIBS]
        if unknown:
            return MooncakeAvailability(False, f"mooncake engine.so needs {unknown}, which no known Debian package "
                                               f"provides here (ldd: not found)", None)
        pkgs = sorted({SYSTEM_LIBS[lib] for lib in missing})
        t_apt = time.monotonic()
        why = _apt_install(pkgs)
        if why:
            return MooncakeAvailability(False, f"engine.so needs {missing}: {why}", None)
        still, _ = _missing_system_libs(stamp)
        if still:
            return MooncakeAvailability(False, f"after apt-get install {' '.join(pkgs)}, ldd still cannot find {still}", None)
        steps.append(f"apt-get install {' '.join(pkgs)} ({time.monotonic() - t_apt:.1f} s)")
    else:
        steps.append("system libraries present")
    # 4. the import check
    version, why = _check_import(stamp)
    if why:
        return MooncakeAvailability(False, why, None)
    stamp.update(version=version, prepare_s=round(time.monotonic() - t0, 2), steps=steps,
                 prepared_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    tmp = workdir / (STAMP_NAME + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=2))
    os.replace(tmp, workdir / STAMP_NAME)
    return MooncakeAvailability(True, f"prepared in {workdir} in {stamp['prepare_s']:.1f} s: " + "; ".join(steps), version)


# ------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------

def read_reply(proc: subprocess.Popen, buf: bytes, deadline: float, what: str,
               fail: Callable[[str], Exception]) -> tuple[dict, bytes]:
    """The next JSON line a child wrote (``{"ok": ...}``) and the bytes left after it; every wait bounded by
    ``deadline``. A child that died, closed its pipe, answered ``ok: false`` or was late raises ``fail(reason)``."""
    fd = proc.stdout.fileno()
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise fail(f"no reply to {what!r} before the deadline")
        r, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not r:
            if proc.poll() is not None:
                raise fail(f"died while waiting for the reply to {what!r}")
            continue
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            raise fail(f"closed its pipe while waiting for the reply to {what!r}")
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    msg = json.loads(line)
    if not msg.get("ok"):
        raise fail(f"{what!r} failed: {msg.get('error')}")
    return msg, buf


class PeerError(RuntimeError):
    pass


class _Peer:
    """A child running transfer_mooncake_peer.py: JSON lines over pipes, every wait bounded."""

    def __init__(self, name: str, stamp: dict, log_path: Path, env_extra: dict[str, str] | None,
                 cpus: str | None = None) -> None:
        self.name, self.log_path = name, log_path
        self.log = open(log_path, "wb")
        pin = ["taskset", "-c", cpus] if cpus else []  # every thread it starts inherits the CPU set
        self.proc = subprocess.Popen([*pin, stamp["venv_python"], str(PEER_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=peer_env(stamp, env_extra),
                                     cwd=str(log_path.parent), start_new_session=True)
        self._buf = b""

    def _fail(self, what: str) -> PeerError:
        rc = self.proc.poll()
        self.log.flush()
        try:
            log = self.log_path.read_text(errors="replace")
        except OSError:
            log = ""
        state = f"exited with rc {rc}" if rc is not None else "still running"
        return PeerError(f"{self.name} peer (pid {self.proc.pid}): {what} ({state}); log {self.log_path}: {_tail(log, 800)}")

    def request(self, msg: dict, deadline: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._fail(f"cannot send {msg.get('cmd')!r}: {exc}") from None
        return self.read(deadline, msg.get("cmd", "?"))

    def read(self, deadline: float, what: str) -> dict:
        msg, self._buf = read_reply(self.proc, self._buf, deadline, what, self._fail)
        return msg

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)  # its own session: the child and nothing else
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.log.close()


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_mooncake(*, block_bytes: int, batch: int, op: str, repeats: int, workdir: Path, timeout_s: float = 120,
                 bytes_per_repeat: int = GiB, max_calls_per_repeat: int = 2000, max_buffer_bytes: int = GiB,
                 engine_env: dict[str, str] | None = None, seed: int = 1, client_cpus: str | None = None,
                 server_cpus: str | None = None, calls_per_repeat: int | None = None) -> dict:
    """Move ``batch`` blocks of ``block_bytes`` between two processes through Mooncake's engine over TCP.

    ``op="read"``: the client pulls from the server's registered buffer; ``"write"``: it pushes.
    ``client_cpus``/``server_cpus`` (``taskset -c`` lists) pin each process and its threads.
    ``calls_per_repeat``: exactly that many calls per repeat (default: from ``bytes_per_repeat``).
    Returns ``{"gbps": [per repeat], "seconds": [wall time of each repeat's loop of calls],
    "latency_s": [per call], "latency_unit": "request"|"batch",
    "latency_p50_s", "latency_p99_s", "cpu_s_per_gb": [client+server per repeat], ...,
    "reason": None}`` or ``{"reason": "..."}``. Raises ValueError (naming the argument) on bad input.
    """
    if op not in ("read", "write"):
        raise ValueError(f"op must be 'read' or 'write', got {op!r}")
    _positive_int("block_bytes", block_bytes)
    _positive_int("batch", batch)
    _positive_int("repeats", repeats)
    _positive_int("bytes_per_repeat", bytes_per_repeat)
    _positive_int("max_calls_per_repeat", max_calls_per_repeat)
    _positive_int("max_buffer_bytes", max_buffer_bytes)
    if calls_per_repeat is not None:
        _positive_int("calls_per_repeat", calls_per_repeat)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    workdir = Path(workdir)
    stamp = read_stamp(workdir)
    problem = _stamp_problem(workdir, stamp)
    if problem:
        return {"reason": problem}

    slots = min(batch, max(1, max_buffer_bytes // block_bytes))
    call_bytes = block_bytes * batch
    calls = calls_per_repeat or max(1, min(max_calls_per_repeat, bytes_per_repeat // call_bytes))
    deadline = time.monotonic() + timeout_s
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    tag = f"{op}-{block_bytes}-{batch}-{os.getpid()}-{time.time_ns()}"
    peers: list[_Peer] = []
    try:
        server = _Peer("server", stamp, logdir / f"{tag}-server.log", engine_env, server_cpus)
        peers.append(server)
        client = _Peer("client", stamp, logdir / f"{tag}-client.log", engine_env, client_cpus)
        peers.append(client)
        for p in peers:
            p.read(deadline, "startup")
        # source holds the pattern, destination zeros (both pre-touched)
        src_fill, dst_fill = "pattern", "zero"
        srv = server.request({"cmd": "setup", "block": block_bytes, "slots": slots,
                              "fill": src_fill if op == "read" else dst_fill, "seed": seed}, deadline)
        client.request({"cmd": "setup", "block": block_bytes, "slots": slots,
                              "fill": dst_fill if op == "read" else src_fill, "seed": seed}, deadline)
        run_msg = {"cmd": "run", "target": srv["segment"], "remote_addr": srv["addr"], "op": op}
        client.request(dict(run_msg, batch=min(batch, slots), iters=1), deadline)  # warm-up, not measured
        gbps, seconds, lat_all, cpu_per_gb, cli_cpu, srv_cpu = [], [], [], [], [], []
        for _ in range(repeats):
            s0 = server.request({"cmd": "rusage"}, deadline)["cpu_s"]
            r = client.request(dict(run_msg, batch=batch, iters=calls), deadline)
            s1 = server.request({"cmd": "rusage"}, deadline)["cpu_s"]
            moved = call_bytes * calls
            if len(r["lat"]) != calls:
                raise PeerError(f"client peer made {len(r['lat'])} calls, not the {calls} asked for")
            t = r["wall_s"]  # the whole loop, as the study times its other subjects
            seconds.append(t)
            gbps.append(moved / t / GB)
            lat_all.extend(r["lat"])
            cli_cpu.append(r["cpu_s"])
            srv_cpu.append(s1 - s0)
            cpu_per_gb.append((r["cpu_s"] + s1 - s0) / (moved / GB))
        src, dst = (server, client) if op == "read" else (client, server)
        want = src.request({"cmd": "crc"}, deadline)["crcs"]
        got = dst.request({"cmd": "crc"}, deadline)["crcs"]
        if want != got:
            bad = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
            return {"reason": f"data check failed: {len(bad)} of {len(want)} destination slots differ from their "
                              f"source after the {op}s (first: slot {bad[0] if bad else '?'})"}
        return {
            "gbps": gbps,
            "seconds": seconds,
            "latency_s": lat_all,
            "latency_unit": "request" if batch == 1 else "batch",
            "latency_p50_s": _percentile(lat_all, 0.50),
            "latency_p99_s": _percentile(lat_all, 0.99),
            "cpu_s_per_gb": cpu_per_gb,
            "client_cpu_s": cli_cpu,
            "server_cpu_s": srv_cpu,
            "bytes_per_repeat": call_bytes * calls,
            "calls_per_repeat": calls,
            "distinct_slots": slots,
            "verified": "crc32 of every destination slot == source",
            "api": (f"transfer_sync_{op}" if batch == 1 else f"batch_transfer_sync_{op}"),
            "version": stamp.get("version"),
            "engine_env": dict(BASE_ENGINE_ENV, **(engine_env or {})),
            "reason": None,
        }
    except PeerError as exc:
        return {"reason": str(exc)}
    except OSError as exc:
        return {"reason": f"cannot run the Mooncake peers: {type(exc).__name__}: {exc}"}
    finally:
        for p in reversed(peers):
            p.kill()


# ------------------------------------------------------------------------------------------
# CLI: the table
# ------------------------------------------------------------------------------------------

def _size_label(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def sweep(workdir: Path, sizes: list[int], batches: list[int], ops: list[str], repeats: int,
          engine_env: dict[str, str] | None = None, timeout_s: float = 300, progress=print) -> list[dict]:
    rows = []
    for size in sizes:
        for b in batches:
            for op in ops:
                t0 = time.monotonic()
                r = run_mooncake(block_bytes=size, batch=b, op=op, repeats=repeats, workdir=workdir,
                                 timeout_s=timeout_s, engine_env=engine_env)
                row = {"block_bytes": size, "batch": b, "op": op, "repeats": repeats, "wall_s": time.monotonic() - t0}
                row.update({k: v for k, v in r.items() if k != "latency_s"})
                rows.append(row)
                progress(_format_row(row))
    return rows


def _format_row(row: dict) -> str:
    head = f"{_size_label(row['block_bytes']):>8} x{row['batch']:>4} {row['op']:>5}"
    if row.get("reason"):
        return f"{head}  FAILED: {row['reason']}"
    g = row["gbps"]
    return (f"{head}  {statistics.median(g):6.3f} GB/s (min {min(g):.3f} max {max(g):.3f})  "
            f"p50 {row['latency_p50_s'] * 1e3:9.3f} ms  p99 {row['latency_p99_s'] * 1e3:9.3f} ms /{row['latency_unit']:<7}  "
            f"cpu {statistics.median(row['cpu_s_per_gb']):5.2f} s/GB  calls/rep {row['calls_per_repeat']:>4}  "
            f"slots {row['distinct_slots']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.transfer_mooncake", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=default_workdir())
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--sizes", default="65536,2097152,33554432", help="block sizes in bytes, comma-separated")
    ap.add_argument("--batches", default="1,16,128")
    ap.add_argument("--ops", default="read,write")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool", action="store_true", help="MC_TCP_ENABLE_CONNECTION_POOL=1 (default: Mooncake's default)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows (without per-call latencies) here")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    av = prepare(args.workdir)
    print(f"prepare: ok={av.ok} version={av.version} ({time.monotonic() - t0:.1f} s): {av.reason}", flush=True)
    if not av.ok:
        return 1
    if args.prepare_only:
        return 0
    env = {"MC_TCP_ENABLE_CONNECTION_POOL": "1"} if args.pool else None
    rows = sweep(args.workdir, [int(x) for x in args.sizes.split(",")], [int(x) for x in args.batches.split(",")],
                 [x.strip() for x in args.ops.split(",")], args.repeats, engine_env=env,
                 progress=lambda s: print(s, flush=True))
    if args.json:
        args.json.write_text(json.dumps({"availability": asdict(av), "rows": rows}, indent=1))
    return 0 if all(r.get("reason") is None for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
