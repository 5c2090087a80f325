"""A real etcd for the cluster tests (import the fixtures you use into your test module).

- ``etcd``: one ``EtcdProcess`` for the whole session (127.0.0.1, free ports, a temporary directory),
  stopped at the end; a test that takes it is skipped, saying how to install etcd, when there is none.
- ``etcd_client``: an ``EtcdClient`` to it; ``prefix``: a key prefix of the test's own, so tests sharing
  the server never see each other's keys.
- ``Child``: a Python child process running one of the scripts below, driven line by line over
  stdin/stdout (to SIGKILL or SIGSTOP a registry node or a leader for real).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from quillcache.cluster.client import EtcdClient
from quillcache.cluster.etcd import ETCD_INSTALL_HINT, EtcdProcess, find_etcd

ROOT = Path(__file__).resolve().parents[1]

_SHARED: dict[str, EtcdProcess] = {}  # one server even when several modules import the fixture


def require_etcd() -> str:
    path = find_etcd()
    if path is None:
        pytest.skip(ETCD_INSTALL_HINT)
    return path


@pytest.fixture(scope="session")
def etcd():
    require_etcd()
    proc = _SHARED.get("etcd")
    if proc is None or not proc.running():
        proc = _SHARED["etcd"] = EtcdProcess().start()
    try:
        yield proc
    finally:
        proc.stop()
        _SHARED.pop("etcd", None)


@pytest.fixture
def etcd_client(etcd):
    client = EtcdClient(etcd.endpoint)
    yield client
    client.close()


@pytest.fixture
def prefix() -> str:
    return f"/qc-test-{uuid.uuid4().hex[:12]}"


# A registry node: registers one segment, answers "ok", then waits (until killed or stdin closes).
NODE_SCRIPT = """
import sys
from quillcache.cluster.descriptors import RegionInfo, SegmentDescriptor
from quillcache.cluster.registry import EtcdRegistry
endpoint, prefix, node_id, ttl = sys.argv[1:5]
reg = EtcdRegistry(endpoint, prefix=prefix, ttl_s=int(ttl))
reg.register(SegmentDescriptor(node_id=node_id, endpoint="127.0.0.1:7001", transport="tcp",
                               regions=(RegionInfo(0, 4096),), capacity_bytes=4096))
print("ok", flush=True)
sys.stdin.readline()
reg.close()
"""

# A master candidate: campaigns, prints "leader <epoch>", keeps the fence of that epoch, then obeys
# "put <key>" (a fenced write: prints "ok" or "fenced") and "is_leader" lines.
CANDIDATE_SCRIPT = """
import sys
from quillcache.cluster.election import FencedError, LeaderElection
endpoint, prefix, name, cid, address, ttl = sys.argv[1:7]
election = LeaderElection(endpoint, name, cid, address, ttl_s=int(ttl), prefix=prefix)
epoch = election.campaign(timeout_s=60)
fence = election.fence()
print("leader", epoch, flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "put":
        try:
            fence.put(arg, b"x")
            print("ok", flush=True)
        except FencedError as e:
            print("fenced", e, flush=True)
    elif cmd == "is_leader":
        print(election.is_leader, flush=True)
"""


class Child:
    """``python -c script args`` with line-based stdin/stdout; always killed by ``close()``."""

    def __init__(self, script: str, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def readline(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            raise AssertionError(f"child printed nothing in {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise AssertionError(f"child exited ({self.proc.returncode}): {self.proc.stderr.read()[-2000:]}")
        return line.strip()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()
