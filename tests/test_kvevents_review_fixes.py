"""Regression tests for reviewed defects of ``quillcache.kvevents``: each fails without its fix.

- the subscriber's engine-hash -> chain-hash map is an LRU: a parent in use is refreshed, so a hot shared prefix
  is never aged out by the blocks stored under it;
- ``KvEventPublisher.publish`` refuses a batch a subscriber would refuse (naming the field; nothing queued), and a
  send that fails does not stop the publisher thread.
"""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from quillcache.hashing import local_hashes
from quillcache.kvevents import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEventPublisher,
                                 KvEventSubscriber, chain_step)


class Sink:
    def __init__(self) -> None:
        self.stored: list = []
        self.removed: list = []

    def on_stored(self, engine_id, stored) -> None:
        self.stored.append(stored)

    def on_removed(self, engine_id, removed) -> None:
        self.removed.append(removed)

    def on_cleared(self, engine_id) -> None:
        pass

    def on_resync(self, engine_id) -> None:
        pass


def _local(tokens: tuple[int, ...], bs: int) -> list[int]:
    return [int(h) for h in local_hashes(list(tokens), bs)]


# --- 3. the chain map is an LRU -----------------------------------------------------------------------------------


def test_a_shared_parent_in_use_is_never_aged_out_of_the_chain_map():
    root, max_mapped = 100, 4
    batches = [EventBatch(0.0, (BlockStored((root,), None, (1, 2), 2),))]  # the shared prefix, stored once
    for i in range(3 * max_mapped):  # many requests, each a new block under the shared prefix
        batches.append(EventBatch(0.0, (BlockStored((200 + i,), root, (3 + i, 4), 2),)))
    batches.append(EventBatch(0.0, (BlockRemoved((200,)),)))  # the first child: aged out (not in use)
    sink = Sink()
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        sub = KvEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, engine_id="e0", sink=sink,
                                max_mapped_blocks=max_mapped).start()
        try:
            assert sub.caught_up.wait(5.0)
            for b in batches:
                pub.publish(b)
            assert pub.flush(5.0)
            assert sub.wait_for_seq(len(batches) - 1, 10.0)
        finally:
            sub.close()
    root_chain = _local((1, 2), 2)[0]
    assert [s.chain_hashes for s in sink.stored[1:]] == [
        (chain_step(root_chain, _local((3 + i, 4), 2)[0]),) for i in range(3 * max_mapped)]
    assert sub.chain_hash(root) == root_chain
    assert sink.removed[0].chain_hashes == (None,)  # the bound holds: the unused entries went first
    assert len(sub._chain) == max_mapped


# --- 4. the publisher refuses a bad batch and survives a failed send --------------------------------------------


def test_publish_refuses_a_batch_a_subscriber_would_refuse_and_queues_nothing():
    good = EventBatch(time.time(), (AllBlocksCleared(),))
    with KvEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as pub:
        pub.publish(good)
        assert pub.flush(5.0) and pub.next_seq == 1
        cleared = AllBlocksCleared()
        bad = [
            (ValueError, r"events\[0\]\.token_ids\[0\]=18446744073709551616",  # past u64: msgpack refused it
             (BlockStored((1,), None, (1 << 64,), 1),)),                      # in the thread, which died
            (ValueError, r"events\[1\]\.token_ids\[0\]=4294967296", (cleared, BlockStored((1,), None, (1 << 32,), 1))),
            (ValueError, r"events\[0\]\.block_hashes\[0\]", (BlockStored(("h",), None, (1,), 1),)),  # type: ignore
            (ValueError, r"events\[0\]: 3 token_ids for 1 block", (BlockStored((1,), None, (1, 2, 3), 2),)),
            (TypeError, r"events\[1\]: not a KV event: str", (cleared, "BlockStored")),
        ]
        for exc, match, events in bad:
            with pytest.raises(exc, match=match):
                pub.publish(EventBatch(time.time(), events))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="not an EventBatch"):
            pub.publish((AllBlocksCleared(),))  # type: ignore[arg-type]
        for _ in range(3):
            pub.publish(good)
        assert pub.flush(5.0)
        assert pub.next_seq == 4 and pub.stats.published == 4 and pub._thread.is_alive()


class _FailOnce:
    """The PUB socket, whose next send fails once."""

    def __init__(self, sock) -> None:
        self._sock = sock
        self.failed = False

    def send_multipart(self, frames) -> None:
        if not self.failed:
            self.failed = True
            raise zmq.ZMQError(zmq.EFSM, "injected")
        self._sock.send_multipart(frames)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_failed_send_does_not_stop_the_publisher_thread(caplog):
    caplog.set_level(logging.CRITICAL)
    good = EventBatch(time.time(), (AllBlocksCleared(),))
    with KvEventPublisher("tcp://127.0.0.1:0") as pub:
        pub._pub = _FailOnce(pub._pub)  # type: ignore[assignment]
        pub.publish(good)
        pub.publish(good)
        assert pub.flush(5.0)  # without the guard the thread died on the first batch: the flush never comes
        assert pub.stats.send_errors == 1 and pub.stats.published == 1 and pub.next_seq == 2
        assert pub._thread.is_alive()
