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


def test_one_line_per_window_with_the_count_of_the_rest(caplog):
    clock = _Clock()
    rl = RefusalLog(window_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="quillcache.gateway"):
        rl.refused(400, "the body is not valid JSON")
        for _ in range(5):
            clock.now += 1.0
            rl.refused(401, "missing or unknown API key")
        clock.now += 10.0
        rl.refused(413, "body too large")
    lines = [r for r in caplog.records if r.name == "quillcache.gateway"]
    assert len(lines) == 2
    first, second = lines
    assert first.levelno == logging.INFO and "refused 1 request(s)" in first.getMessage()
    assert "the latest: 400 the body is not valid JSON" in first.getMessage()
    # the window's five 401s and the 413 that closed it, summed up; a 401 among them makes it a warning
    assert second.levelno == logging.WARNING
    assert "refused 6 request(s)" in second.getMessage() and "5 x 401, 1 x 413" in second.getMessage()


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
    assert any(lv == logging.WARNING and "the latest: 401" in m for lv, m in msgs), msgs
    assert any(lv == logging.INFO and "the latest: 400" in m for lv, m in msgs), msgs
    assert not any("sk-guessed" in m for _, m in msgs)  # a key never reaches the log
