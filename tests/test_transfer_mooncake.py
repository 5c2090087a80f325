"""experiments/transfer_mooncake.py: the Mooncake Transfer Engine baseline of the transfer study.

Fast and offline: nothing here installs anything. Argument checks, the reasons given when the
Mooncake venv was never prepared or has gone, and ``prepare`` never raising. When
$QUILLCACHE_MOONCAKE_WORKDIR names a prepared workdir (``python -m experiments.transfer_mooncake
--prepare-only --workdir DIR``), a smoke test moves one 64 KiB block each way between two processes
and checks (crc32 of the destination == the source) that the bytes landed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from experiments import transfer_mooncake as tm

GOOD = dict(block_bytes=65536, batch=1, op="read", repeats=1)


@pytest.mark.parametrize("field, value", [
    ("op", "copy"), ("op", ""), ("op", None),
    ("block_bytes", 0), ("block_bytes", -1), ("block_bytes", 1.5), ("block_bytes", True),
    ("batch", 0), ("batch", -3), ("batch", "2"),
    ("repeats", 0), ("repeats", -1),
    ("timeout_s", 0), ("timeout_s", -1.0), ("timeout_s", float("nan")),
])
def test_bad_arguments_raise_valueerror_naming_the_argument(tmp_path, field, value):
    kwargs = dict(GOOD, workdir=tmp_path, **{field: value})
    with pytest.raises(ValueError, match=field):
        tm.run_mooncake(**kwargs)


def test_not_prepared_gives_a_clear_reason(tmp_path):
    r = tm.run_mooncake(**GOOD, workdir=tmp_path / "nowhere")
    assert set(r) == {"reason"}
    assert "not prepared" in r["reason"] and "prepare(" in r["reason"]


def test_missing_venv_gives_a_clear_reason(tmp_path):
    stamp = {"format": tm.STAMP_FORMAT, "spec": [tm.MOONCAKE_SPEC, tm.CUDART_SPEC],
             "venv_python": str(tmp_path / "mooncake-venv" / "bin" / "python"),
             "site_packages": str(tmp_path), "cudart_dir": str(tmp_path), "libcuda_stub": str(tmp_path)}
    (tmp_path / tm.STAMP_NAME).write_text(json.dumps(stamp))
    r = tm.run_mooncake(**GOOD, workdir=tmp_path)
    assert set(r) == {"reason"}
    assert "venv_python" in r["reason"] and "missing" in r["reason"] and "prepare()" in r["reason"]


def test_corrupt_stamp_counts_as_not_prepared(tmp_path):
    (tmp_path / tm.STAMP_NAME).write_text("{not json")
    assert "not prepared" in tm.run_mooncake(**GOOD, workdir=tmp_path)["reason"]


def test_prepare_never_raises(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    av = tm.prepare(blocker / "workdir")  # cannot mkdir under a file
    assert av.ok is False and av.version is None and "prepare failed" in av.reason


def test_percentile():
    assert tm._percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert tm._percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)
    assert tm._percentile([5.0], 0.99) == 5.0


def _prepared_workdir() -> Path:
    env = os.environ.get("QUILLCACHE_MOONCAKE_WORKDIR")
    if not env:
        pytest.skip("QUILLCACHE_MOONCAKE_WORKDIR not set (point it at a workdir prepared by "
                    "`python -m experiments.transfer_mooncake --prepare-only --workdir DIR`)")
    workdir = Path(env)
    problem = tm._stamp_problem(workdir, tm.read_stamp(workdir))
    if problem:
        pytest.skip(f"QUILLCACHE_MOONCAKE_WORKDIR={workdir}: {problem}")
    return workdir


@pytest.mark.parametrize("op", ["read", "write"])
def test_smoke_one_64k_block_each_way(op):
    workdir = _prepared_workdir()
    r = tm.run_mooncake(block_bytes=64 * 1024, batch=1, op=op, repeats=1, workdir=workdir, timeout_s=60,
                        bytes_per_repeat=64 * 1024)
    assert r["reason"] is None, r["reason"]
    assert r["verified"].startswith("crc32")  # run_mooncake compared the destination's crc32 with the source's
    assert r["calls_per_repeat"] == 1 and r["bytes_per_repeat"] == 64 * 1024
    assert r["latency_unit"] == "request" and len(r["latency_s"]) == 1
    assert len(r["gbps"]) == 1 and r["gbps"][0] > 0
    assert len(r["cpu_s_per_gb"]) == 1 and r["cpu_s_per_gb"][0] >= 0
    assert r["api"] == f"transfer_sync_{op}"


def test_deadline_gives_a_reason_and_kills_the_peers():
    workdir = _prepared_workdir()
    r = tm.run_mooncake(block_bytes=64 * 1024, batch=1, op="read", repeats=1, workdir=workdir, timeout_s=0.05)
    assert set(r) == {"reason"} and "before the deadline" in r["reason"]
    pids = [int(m) for m in re.findall(r"pid (\d+)", r["reason"])]
    assert pids
    for pid in pids:  # killed and reaped in run_mooncake's finally
        assert not Path(f"/proc/{pid}").exists()
