"""GatewayProcess's temporary directory (config, keys, stderr): removed on exit, and the one a SIGKILLed owner
left is removed by the next GatewayProcess once neither the owner nor its gateway runs
(``quillcache.gateway.server`` module doc, ``quillcache.cluster.tempdirs``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from polling import wait_until as _poll

from quillcache.cluster.etcd import free_port
from quillcache.cluster.tempdirs import owners_of
from quillcache.gateway.server import TEMP_PREFIX, GatewayProcess

# a parent that starts a gateway (in front of a dead engine address: nothing here needs one), says where
# and waits to be killed
_PARENT = """
import json, sys, time
from quillcache.gateway.server import GatewayProcess
gw = GatewayProcess([sys.argv[1]], keys={"sk-tempdir-test-01": "tenant-t"}, wait_ready=False).__enter__()
print(json.dumps({"dir": str(gw.dir), "gateway_pid": gw.proc.pid}), flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture()
def own_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_exit_removes_the_directory_and_it_names_both_processes(own_tmpdir):
    with GatewayProcess([f"http://127.0.0.1:{free_port()}"], keys={"sk-tempdir-test-01": "tenant-t"},
                        wait_ready=False) as gw:
        d = gw.dir
        assert d is not None and d.parent == own_tmpdir and d.name.startswith(TEMP_PREFIX)
        assert {p.pid for p in owners_of(d)} == {os.getpid(), gw.proc.pid}
        assert {p.name for p in d.iterdir()} >= {"config.json", "keys.json", "stderr.log"}
    assert not d.exists() and gw.dir is None


def test_a_failed_start_removes_the_directory(own_tmpdir):
    gw = GatewayProcess([f"http://127.0.0.1:{free_port()}"], config={"no_such_option": 1}, wait_ready=False)
    with pytest.raises(RuntimeError, match="gateway exited"):
        gw.__enter__()
    assert list(own_tmpdir.iterdir()) == [] and gw.proc is None


def test_the_directory_a_sigkilled_owner_left_is_swept_by_the_next_gateway(own_tmpdir):
    env = {**os.environ, "TMPDIR": str(own_tmpdir)}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, f"http://127.0.0.1:{free_port()}"],
                              stdout=subprocess.PIPE, text=True, env=env)
    gateway_pid = None
    try:
        line = json.loads(parent.stdout.readline())
        left, gateway_pid = Path(line["dir"]), line["gateway_pid"]
        assert left.parent == own_tmpdir and left.is_dir()
        with GatewayProcess([f"http://127.0.0.1:{free_port()}"], wait_ready=False) as running_next:
            assert left.is_dir()  # its owner still runs: not swept
            assert running_next.dir != left
        parent.send_signal(signal.SIGKILL)  # no exit of its own runs
        parent.wait(timeout=30)
        _poll(lambda: _gone(gateway_pid), 30, "the gateway to stop after its parent's SIGKILL")
        assert left.is_dir()  # nobody removed it
        with GatewayProcess([f"http://127.0.0.1:{free_port()}"], wait_ready=False) as gw:
            assert not left.exists() and gw.dir.is_dir()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
        if gateway_pid is not None and not _gone(gateway_pid):
            os.kill(gateway_pid, signal.SIGKILL)
