"""``quillcache._ratelog.BurstLog``, the one rate-limited log every server here uses for what a peer can cause at
will: at most ``burst + 1`` lines per window, every event either on a line of its own or counted in exactly one
summary, a summary at the highest level it counts. Checked against a plain model on random event sequences
(Hypothesis), then the owners: the four places that kept a limiter of their own before use this one."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache._ratelog import BurstLog

SUMMARY = re.compile(r"^(?P<prefix>.*?)things in the last (?P<dur>[\d.]+) s: (?P<total>\d+) \((?P<detail>.*)\); "
                     r"(?P<unlogged>\d+) event\(s\) not logged one by one, the latest: (?P<latest>.*)$")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _capturing(name: str):
    """(logger, handler): every record of logger ``name`` while the block runs, kept off the root logger."""
    logger = logging.getLogger(name)
    cap = _Capture()
    logger.addHandler(cap)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield logger, cap
    finally:
        logger.removeHandler(cap)


@pytest.fixture
def captured():
    with _capturing("quillcache.test_ratelog") as got:
        yield got


def _model(events, burst: int, window_s: float, final: bool):
    """The windows a plain reading of the rule makes: [(logged one by one, counted only)] per window."""
    windows, ends = [], float("-inf")
    for t, _kind, _n, _level in events:
        if t >= ends:
            windows.append(([], []))
            ends = t + window_s
        logged, counted = windows[-1]
        (logged if len(logged) < burst else counted).append((t, _kind, _n, _level))
    return windows


_EVENT = st.tuples(st.floats(0.0, 5.0), st.sampled_from(["a", "b", "c"]), st.integers(1, 4),
                   st.sampled_from([logging.INFO, logging.WARNING, logging.ERROR]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_EVENT, max_size=60), st.integers(0, 4), st.sampled_from([0.0, 1.0, 2.5, 10.0]))
def test_every_event_is_one_line_or_counted_in_exactly_one_summary(events, burst, window_s):
    with _capturing("quillcache.test_ratelog.model") as (logger, cap):
        clock = _Clock()
        bl = BurstLog(logger, "things", window_s=window_s, burst=burst, prefix="p: ", clock=clock)
        timed = []
        for dt, kind, n, level in events:
            clock.now += dt
            timed.append((clock.now, kind, n, level))
            bl.note(kind, "event %s of %d", kind, n, n=n, level=level)
        bl.tick(final=True)
    windows = _model(timed, burst, window_s, final=True)
    summaries = [r for r in cap.records if SUMMARY.match(r.getMessage())]
    singles = [r for r in cap.records if not SUMMARY.match(r.getMessage())]
    # one by one: exactly the first `burst` events of each window, in order, at their own level
    want_single = [e for logged, _ in windows for e in logged]
    assert [(r.getMessage(), r.levelno) for r in singles] == [(f"p: event {k} of {n}", lv)
                                                               for _t, k, n, lv in want_single]
    # one summary per window that had a counted event, summing the whole window by kind
    want_summaries = [(logged, counted) for logged, counted in windows if counted]
    assert len(summaries) == len(want_summaries)
    for rec, (logged, counted) in zip(summaries, want_summaries, strict=True):
        m = SUMMARY.match(rec.getMessage())
        assert m["prefix"] == "p: "
        everything = logged + counted
        assert int(m["total"]) == sum(n for _t, _k, n, _lv in everything)
        by_kind: dict[str, int] = {}
        for _t, k, n, _lv in everything:
            by_kind[k] = by_kind.get(k, 0) + n
        assert m["detail"] == ", ".join(f"{n} {k}" for k, n in sorted(by_kind.items()))
        assert int(m["unlogged"]) == len(counted)
        assert m["latest"] == f"event {counted[-1][1]} of {counted[-1][2]}"
        assert rec.levelno == max(lv for _t, _k, _n, lv in counted)
        assert float(m["dur"]) <= window_s + 1e-6
    assert bl.suppressed_total == sum(len(c) for _, c in windows)
    # so a window costs at most burst + 1 lines
    assert len(cap.records) <= (burst + 1) * max(1, len(windows))


def test_a_due_summary_is_written_by_tick_and_wait_s_says_when(captured):
    logger, cap = captured
    clock = _Clock()
    bl = BurstLog(logger, "things", window_s=10.0, burst=1, clock=clock)
    assert bl.wait_s() is None  # nothing to sum up
    bl.note("a", "first")
    assert bl.wait_s() is None  # logged one by one: still nothing to sum up
    clock.now += 2.0
    bl.note("a", "second")
    assert bl.wait_s() == pytest.approx(8.0)
    clock.now += 7.0
    bl.tick()
    assert len(cap.records) == 1  # not due yet
    clock.now += 1.0
    assert bl.wait_s() == 0.0
    bl.tick()
    assert len(cap.records) == 2 and "2 (2 a)" in cap.records[1].getMessage()
    bl.tick(final=True)  # nothing left to sum up: no line
    assert len(cap.records) == 2 and bl.wait_s() is None


def test_bad_arguments_are_refused():
    logger = logging.getLogger("quillcache.test_ratelog")
    for window_s, burst in ((-1.0, 1), (float("nan"), 1), (1.0, -1)):
        with pytest.raises(ValueError, match="window_s >= 0 and burst >= 0"):
            BurstLog(logger, "x", window_s=window_s, burst=burst)


def test_events_from_many_threads_are_each_counted_once(captured):
    logger, cap = captured
    bl = BurstLog(logger, "things", window_s=3600.0, burst=3)
    per_thread, threads = 2000, 4

    def hammer() -> None:
        for _ in range(per_thread):
            bl.note("k", "one")

    workers = [threading.Thread(target=hammer) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    bl.tick(final=True)
    lines = [r.getMessage() for r in cap.records]
    assert lines[:3] == ["one"] * 3 and len(lines) == 4
    m = SUMMARY.match(lines[3])
    assert m and int(m["total"]) == per_thread * threads and int(m["unlogged"]) == per_thread * threads - 3
    assert bl.suppressed_total == per_thread * threads - 3


def test_the_rpc_server_logs_turned_away_connections_once_then_sums_them_up_at_close(caplog):
    """The stream server used to log the first turned-away connection of a window and then nothing until the next
    one came after the window; the rest of a flood that stopped was never reported."""
    from test_rpc import CODEC, DEADLINE_S, METHODS, Service, until

    from quillcache.rpc import RpcClient
    from quillcache.rpc.stream import HEADER, StreamServer

    caplog.set_level(logging.WARNING, logger="quillcache.rpc")
    server = StreamServer(Service(), METHODS, codec=CODEC, max_connections=1, name="ratelog-test")
    server.start()
    try:
        with RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as held:
            assert held.echo(1) == 1
            for k in range(4):
                with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S) as extra:
                    got = extra.recv(HEADER.size)  # the goodbye's header, then the server closes it
                    assert len(got) == HEADER.size
                until(lambda k=k: server.num_turned_away == k + 1, "the server to count the turned-away one")
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if "turned away" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("ratelog-test: 1 connections open (max_connections): turned away a new one from")
    m = re.search(r"new connections turned away \(max_connections\) in the last [\d.]+ s: 4 \(4 turned away\); "
                  r"3 event\(s\) not logged one by one", lines[1])
    assert m and lines[1].startswith("ratelog-test: "), lines[1]


def test_a_percent_sign_in_the_prefix_or_a_plain_line_is_text_not_a_format(captured):
    """A node started with ``--node-id rack%1`` logged a traceback instead of its lines (re-review L2)."""
    logger, cap = captured
    bl = BurstLog(logger, "things", window_s=10.0, burst=3, prefix="node rack%1: ")
    bl.note("a", "persist of %d items refused", 5)
    bl.note("a", "100% full, no arguments")
    bl.note("a", "%s", "why: 50% done")
    assert [r.getMessage() for r in cap.records] == ["node rack%1: persist of 5 items refused",
                                                     "node rack%1: 100% full, no arguments",
                                                     "node rack%1: why: 50% done"]


def test_the_rpc_server_sums_up_a_flood_that_stopped_without_waiting_for_close(caplog):
    """The accept thread blocked in accept() and wrote the summary only at the next turned-away connection or at
    close (re-review L3): it now wakes when a summary is due."""
    from test_rpc import CODEC, DEADLINE_S, METHODS, Service, until

    from quillcache.rpc import RpcClient
    from quillcache.rpc import stream as stream_mod
    from quillcache.rpc.stream import HEADER, StreamServer

    caplog.set_level(logging.WARNING, logger="quillcache.rpc")
    window_s = 0.3
    real = stream_mod._TURN_AWAY_LOG_S
    stream_mod._TURN_AWAY_LOG_S = window_s
    try:
        server = StreamServer(Service(), METHODS, codec=CODEC, max_connections=1, name="flood-test")
    finally:
        stream_mod._TURN_AWAY_LOG_S = real
    server.start()
    try:
        with RpcClient(server.address, timeout_s=DEADLINE_S, codec=CODEC) as held:
            assert held.echo(1) == 1
            for k in range(3):
                with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S) as extra:
                    assert len(extra.recv(HEADER.size)) == HEADER.size
                until(lambda k=k: server.num_turned_away == k + 1, "the server to count the turned-away one")
            until(lambda: any("in the last" in r.getMessage() for r in caplog.records), "the summary, before close")
            assert held.echo(2) == 2  # still serving
    finally:
        server.close()
    summary = [r.getMessage() for r in caplog.records if "in the last" in r.getMessage()]
    assert len(summary) == 1 and ": 3 (3 turned away); 2 event(s)" in summary[0], summary
