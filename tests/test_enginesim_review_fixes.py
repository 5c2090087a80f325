"""Engine-sim review fixes (engine review M3, L1): a salt UTF-8 cannot carry is a 400 naming ``cache_salt``; an
unexpected failure is an OpenAI-shaped JSON 500 before the headers and one SSE error event during a stream, logged
once with its traceback on the server only; ``max_completion_tokens`` wins over ``max_tokens``, both validated;
``n`` must be the integer 1."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

from quillcache.enginesim.app import build_app
from quillcache.enginesim.config import EngineSimConfig

SECRET = "internal detail 7f3a"  # in the injected exception's message: must never reach a client


@pytest.fixture()
def sim():
    cfg = EngineSimConfig(fixed_ttft_ms=0, decode_ms_per_token=0, gpu_blocks=64)
    with TestClient(build_app(cfg), raise_server_exceptions=False) as c:
        yield c


def _events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e]


def _assert_openai_error(obj: dict, status: int, param: str | None) -> dict:
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, obj
    assert err["param"] == param, obj
    return err


# ---- M3: cache_salt not encodable as UTF-8 ----------------------------------------------------------
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_salt_is_a_400_naming_cache_salt(sim, caplog, route, stream):
    body = ('{"prompt": "hello", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
            f'"stream": {json.dumps(stream)}, "cache_salt": "ab\\ud800"}}').encode()
    with caplog.at_level(logging.ERROR):
        r = sim.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    err = _assert_openai_error(r.json(), 400, "cache_salt")
    assert "'cache_salt'" in err["message"] and "UTF-8" in err["message"] and "position 2" in err["message"], err
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]  # a client error, not a failure
    assert sim.app.state.engine.num_cancelled == 0  # never admitted
    ok = sim.post(route, json={"prompt": "hello", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                               "cache_salt": "ab\u00e9"})
    assert ok.status_code == 200, ok.text  # any salt UTF-8 carries is still served


# ---- M3: the general point: unexpected exceptions -------------------------------------------------------
def _failing_stream(after_tokens: int):
    async def stream(req):
        for k in range(after_tokens):
            yield f"t{k} "
        raise RuntimeError(SECRET)
    return stream


def _failure_logs(caplog) -> list[logging.LogRecord]:
    return [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


def _assert_logged_once(caplog) -> None:
    recs = _failure_logs(caplog)
    assert len(recs) == 1, [r.getMessage() for r in recs]
    assert recs[0].exc_info is not None and SECRET in str(recs[0].exc_info[1])  # the traceback stays server side


@pytest.mark.parametrize("chat", [False, True])
def test_an_unexpected_failure_before_the_headers_is_an_openai_shaped_json_500(sim, caplog, monkeypatch, chat):
    monkeypatch.setattr(sim.app.state.engine, "stream", _failing_stream(0))
    route, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat else
                   ("/v1/completions", {"prompt": "hello"}))
    with caplog.at_level(logging.ERROR):
        r = sim.post(route, json={**body, "max_tokens": 3})
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    _assert_openai_error(r.json(), 500, None)
    assert SECRET not in r.text and "Traceback" not in r.text
    _assert_logged_once(caplog)
    monkeypatch.undo()
    assert sim.post(route, json={**body, "max_tokens": 3}).status_code == 200  # still serving


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("after_tokens", [0, 2])
def test_an_unexpected_failure_during_a_stream_ends_it_with_one_sse_error_event(sim, caplog, monkeypatch, chat,
                                                                                after_tokens):
    monkeypatch.setattr(sim.app.state.engine, "stream", _failing_stream(after_tokens))
    route, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat else
                   ("/v1/completions", {"prompt": "hello"}))
    with caplog.at_level(logging.ERROR):
        r = sim.post(route, json={**body, "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = _events(r.text)
    assert "[DONE]" not in events, events  # the stream is incomplete (as the gateway ends one mid-stream)
    chunks = [json.loads(e) for e in events]
    assert all("error" not in c for c in chunks[:-1]), chunks
    assert len(chunks) == after_tokens + (2 if chat else 1), chunks  # the role chunk, the tokens, the error
    _assert_openai_error(chunks[-1], 500, None)
    assert SECRET not in r.text and "Traceback" not in r.text
    _assert_logged_once(caplog)


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_releases_everything_and_is_not_counted_as_a_cancellation(sim, caplog, monkeypatch,
                                                                                   stream):
    import quillcache.enginesim.engine as engine_mod

    def boom(*args, **kwargs):
        raise RuntimeError(SECRET)

    monkeypatch.setattr(engine_mod, "engine_block_digests", boom)  # fails after a batch slot was taken
    with caplog.at_level(logging.ERROR):
        r = sim.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": stream})
    assert r.status_code == (200 if stream else 500) and SECRET not in r.text, r.text
    _assert_logged_once(caplog)
    e = sim.app.state.engine
    assert e.num_cancelled == 0  # was: counted in quillcache_sim_cancelled_total, as if the client had left
    assert (e.num_running, e.num_waiting, e.kv_tokens, e.cache.num_pinned_blocks) == (0, 0, 0, 0)
    assert "quillcache_sim_cancelled_total 0.0" in sim.get("/metrics").text


def test_an_unexpected_failure_in_another_route_is_an_openai_shaped_json_500(sim, caplog, monkeypatch):
    def boom() -> int:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(sim.app.state.engine, "reset_prefix_cache", boom)
    with caplog.at_level(logging.ERROR):
        r = sim.post("/reset_prefix_cache")
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    _assert_openai_error(r.json(), 500, None)
    assert SECRET not in r.text and "Traceback" not in r.text
    _assert_logged_once(caplog)


# ---- L1: max_completion_tokens over max_tokens; n must be the integer 1 ---------------------------------
def _chat(sim, **extra):
    return sim.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **extra})


def test_max_completion_tokens_wins_over_max_tokens(sim):
    r = _chat(sim, max_tokens=2, max_completion_tokens=5)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    r = _chat(sim, max_tokens=4, max_completion_tokens=None)  # null is absent
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    r = _chat(sim, max_completion_tokens=3)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_tokens": 2, "max_completion_tokens": "bad"}, "max_completion_tokens"),
    ({"max_tokens": 2, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 2, "max_completion_tokens": True}, "max_completion_tokens"),
    ({"max_tokens": 2, "max_completion_tokens": 2.0}, "max_completion_tokens"),
    ({"max_tokens": "bad", "max_completion_tokens": 2}, "max_tokens"),
    ({"max_tokens": False, "max_completion_tokens": 2}, "max_tokens"),
    ({"max_tokens": -1, "max_completion_tokens": 2}, "max_tokens"),
])
def test_both_token_limits_are_validated_when_given(sim, extra, param):
    r = _chat(sim, **extra)
    assert r.status_code == 400, (extra, r.status_code, r.text)
    err = _assert_openai_error(r.json(), 400, param)
    assert f"'{param}'" in err["message"], err


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("n", [True, 1.0, 2, 0, "1"])
def test_n_must_be_the_integer_1(sim, route, n):
    body = {"prompt": "hello", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = sim.post(route, json={**body, "n": n})
    assert r.status_code == 400, (n, r.status_code, r.text)
    err = _assert_openai_error(r.json(), 400, "n")
    assert "'n'" in err["message"], err
    for ok in (1, None):
        assert sim.post(route, json={**body, "n": ok}).status_code == 200


def test_tokenize_renders_chat_as_the_chat_endpoint_does(sim):
    """``/tokenize`` rendered messages with the flag alone, so a request with tools counted other tokens than the
    chat completion of the same body (re-review of 2026-11-29, /tmp/s35/rr_data L2)."""
    body = {"model": "quillcache-sim", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}], "max_tokens": 1}
    tok = sim.post("/tokenize", json=body)
    chat = sim.post("/v1/chat/completions", json=body)
    assert tok.status_code == chat.status_code == 200, (tok.text, chat.text)
    assert tok.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    refused = sim.post("/tokenize", json={**body, "continue_final_message": True})
    assert refused.status_code == 400 and "continue_final_message" in refused.json()["error"]["message"]
