"""Refused requests are logged, rate-limited (``quillcache.gateway.app.RefusalLog``): before, a 400/401/413/415
was counted in the metrics only, so a client guessing API keys left no line in the log at any level (review of
2026-11-29, /tmp/s34/servers L1)."""

from __future__ import annotations

import logging

from starlette.testclient import TestClient

from quillcache.gateway.app import Gateway, RefusalLog
from quillcache.gateway.config import EngineConfig, GatewayConfig, ModelConfig
from quillcache.gateway.tenants import TenantKey, TenantTable


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_window_then_the_rest_summed_up_by_status(caplog):
    clock = _Clock()
    rl = RefusalLog(window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="quillcache.gateway"):
        rl.refused(400, "the body is not valid JSON")
        for _ in range(5):
            clock.now += 1.0
            rl.refused(401, "missing or unknown API key")
        clock.now += 10.0
        rl.refused(413, "body too large")  # after the window: its summary, then this one on its own line
    lines = [r for r in caplog.records if r.name == "quillcache.gateway"]
    assert len(lines) == 3
    first, summary, third = lines
    assert first.levelno == logging.INFO and first.getMessage() == "refused a request: 400 the body is not valid JSON"
    # the window's five 401s, summed up; a 401 among them makes it a warning
    assert summary.levelno == logging.WARNING
    assert "requests refused in the last" in summary.getMessage() and ": 6 (1 x 400, 5 x 401)" in summary.getMessage()
    assert "the latest: refused a request: 401 missing or unknown API key" in summary.getMessage()
    assert third.levelno == logging.INFO and third.getMessage() == "refused a request: 413 body too large"


def test_a_pending_summary_is_written_when_the_gateway_stops(caplog):
    clock = _Clock()
    rl = RefusalLog(window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="quillcache.gateway"):
        rl.refused(400, "a")
        rl.refused(400, "b")
        rl.tick()  # the window is not over: nothing yet
        assert len(caplog.records) == 1
        rl.tick(final=True)
    assert len(caplog.records) == 2 and "the latest: refused a request: 400 b" in caplog.records[1].getMessage()


def test_the_gateway_logs_a_request_refused_for_its_key_and_one_for_its_body(caplog):
    cfg = GatewayConfig(engines=(EngineConfig(url="http://127.0.0.1:9", name="e0"),), index_kind="flat",
                        models=(ModelConfig(name="m"),))
    gw = Gateway(cfg, TenantTable({"sk-aaaaaaaa": TenantKey("t1")}))
    gw.refusals = RefusalLog(window_s=0.0)  # every refusal on its own line
    client = TestClient(gw.app)  # no lifespan: nothing reaches an engine
    with caplog.at_level(logging.INFO, logger="quillcache.gateway"):
        bad_key = client.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                              headers={"authorization": "Bearer sk-guessed"})
        bad_body = client.post("/v1/completions", content=b"{not json",
                               headers={"authorization": "Bearer sk-aaaaaaaa", "content-type": "application/json"})
    assert (bad_key.status_code, bad_body.status_code) == (401, 400)
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "quillcache.gateway"]
    assert any(lv == logging.WARNING and "refused a request: 401" in m for lv, m in msgs), msgs
    assert any(lv == logging.INFO and "refused a request: 400" in m for lv, m in msgs), msgs
    assert not any("sk-guessed" in m for _, m in msgs)  # a key never reaches the log
