"""A pool node asks the master before it maps and touches its DRAM: faulting in the buffer takes seconds per GiB
(fresh pages), so a node given a wrong master address, or started while the master is down, used to spend all of
that before finding out (noticed in the review of 2026-11-29)."""

from __future__ import annotations

import mmap
import socket
import time

import pytest

from quillcache.pool import node as node_mod
from quillcache.pool.node import PoolNode
from quillcache.rpc import RpcConnectionError, RpcTimeoutError


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.fixture
def mapped(monkeypatch) -> list:
    """The arguments of every ``mmap.mmap`` the node module makes (the DRAM buffer)."""
    calls: list = []
    real = mmap.mmap

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(node_mod.mmap, "mmap", spy)
    return calls


def test_a_node_whose_master_does_not_answer_fails_before_mapping_its_dram(mapped):
    t0 = time.monotonic()
    with pytest.raises((RpcConnectionError, RpcTimeoutError)):
        PoolNode(f"tcp://127.0.0.1:{_closed_port()}", dram_bytes=64 << 20, backend="local", master_timeout_s=0.2,
                 mount_timeout_s=0.5)
    assert mapped == []
    assert time.monotonic() - t0 < 30  # the retry deadline, not a hang


def test_a_node_whose_master_answers_maps_its_dram_and_mounts(mapped):
    from quillcache.master.client import MasterClient
    from quillcache.master.service import MasterService

    master = MasterClient.embedded(MasterService())
    node = PoolNode(master, dram_bytes=64 << 20, backend="local")
    try:
        assert len(mapped) == 1 and node.segment_id is not None
        assert [s.segment_id for s in master.segments()] == [node.segment_id]
    finally:
        node.close()
