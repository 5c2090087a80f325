"""quillcache engine-sim (the STAND-IN engine): block cache contract, and real servers driven by the openai SDK."""

from __future__ import annotations

import json
import os
import random
import time
import urllib.error
import urllib.request

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.enginesim import EngineSimProcess, SimBlockCache, engine_block_digests
from quillcache.enginesim.config import EngineSimConfig
from quillcache.enginesim.textgen import incremental_deltas, plan_output
from quillcache.textproc import ByteTokenizer, ChatMLTemplate


# ---- block cache (pure) -----------------------------------------------------------------------
def _d(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_digests_chain_and_extra_keys():
    toks = list(range(40))
    base = engine_block_digests(toks, 16)
    assert len(base) == 2  # only full blocks
    assert engine_block_digests(toks[:32], 16) == base
    assert engine_block_digests(toks[:16], 16) == base[:1]
    salted = engine_block_digests(toks, 16, cache_salt="s")
    lora = engine_block_digests(toks, 16, lora_name="a")
    # the salt enters block 0 and the chain carries it; LoRA enters every block
    assert salted[0] != base[0] and salted[1] != base[1]
    assert lora[0] != base[0] and lora[1] != base[1] and lora != salted
    # continuing a chain from a parent gives the same digests as hashing from the start
    assert engine_block_digests(toks + list(range(24)), 16, start_block=2, parent=base[1]) == \
        engine_block_digests(toks + list(range(24)), 16)[2:]
    assert engine_block_digests(toks, 16, lora_name="") != base  # an empty name differs from none
    with pytest.raises(ValueError, match="needs the parent digest"):
        engine_block_digests(toks, 16, start_block=1)
    changed = engine_block_digests([99] + toks[1:], 16)
    assert changed[0] != base[0] and changed[1] != base[1]  # a change in block 0 changes every later block


def test_block_cache_lru_order_pins_and_runs():
    c = SimBlockCache(4)
    a = [_d(1), _d(2), _d(3)]
    res = c.store(a, 0)
    assert [r.digests for r in res.runs] == [tuple(a)] and res.runs[0].parent is None and not res.evicted
    c.release(res.pinned)  # released last-first: LRU order is now 3, 2, 1 (the chain's tail leaves first)
    assert c.match_prefix(a) == 3 and c.num_pinned_blocks == 0
    b = [_d(1), _d(2), _d(10), _d(11)]
    pinned = c.pin_prefix(b)
    assert pinned == [_d(1), _d(2)]
    res = c.store(b, 2)
    # capacity 4: storing 10 fits (4th block), storing 11 evicts the LRU unpinned block, which is 3
    assert res.evicted == [_d(3)]
    assert res.runs[0].digests == (_d(10), _d(11)) and res.runs[0].parent == _d(2) and res.runs[0].first_block == 2
    assert c.match_prefix(a) == 2
    # everything pinned: a further store caches nothing and says how many blocks found no room
    res2 = c.store([_d(20), _d(21)], 0)
    assert res2.num_uncached == 2 and not res2.runs and not res2.evicted
    c.release(pinned + res.pinned)
    assert c.num_pinned_blocks == 0 and c.num_cached_blocks == 4
    assert c.clear() and c.num_cached_blocks == 0


def test_block_cache_reuses_orphan_blocks_and_splits_runs():
    c = SimBlockCache(8)
    c.release(c.store([_d(5)], 0).pinned)  # 5 cached alone (as if its parent was evicted)
    res = c.store([_d(4), _d(5), _d(6)], 0)
    assert [r.digests for r in res.runs] == [(_d(4),), (_d(6),)]
    assert res.runs[1].parent == _d(5) and res.runs[1].first_block == 2
    c.release(res.pinned)


@given(st.text(max_size=60))
def test_incremental_deltas_rebuild_the_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    deltas = incremental_deltas(tok, ids)
    assert len(deltas) == len(ids) and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text  # never a half character


def test_output_plan_is_deterministic_and_exact_length():
    tok = ByteTokenizer()
    a = plan_output(tok, [1, 2, 3], 5000, engine_seed=0, request_seed=None)
    assert len(a.token_ids) == 5000 and tok.encode(a.text) == a.token_ids
    assert plan_output(tok, [1, 2, 3], 5000, engine_seed=0, request_seed=None).text == a.text
    assert plan_output(tok, [1, 2, 3], 50, engine_seed=0, request_seed=7).text != a.text[:50]


@given(st.text(max_size=20), st.booleans(), st.booleans())
def test_token_chunk_template_equals_the_full_encoding(text, chat, include_usage):
    from quillcache.enginesim.app import _dumps, _EngineResponse
    from quillcache.enginesim.engine import FaultDraw, SimRequest

    r = _EngineResponse(None, SimRequest("cmpl-1", (1,), 3), FaultDraw(False, 0.0, None), chat=chat, stream=True,
                        include_usage=include_usage, model="m")
    head, tail_running, tail_last = r._token_chunk_parts()
    assert head + _dumps(text) + tail_running == r._chunk(text, None)
    assert head + _dumps(text) + tail_last == r._chunk(text, "length")


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        EngineSimConfig(block_size=0)
    with pytest.raises(ValueError, match="error_rate must be in"):
        EngineSimConfig(error_rate=2.0)
    with pytest.raises(ValueError, match="kv_events_encoding 'json' unknown"):
        EngineSimConfig(kv_events_encoding="json")
    with pytest.raises(ValueError, match="kv_events_replay needs kv_events"):
        EngineSimConfig(kv_events_replay="tcp://127.0.0.1:0")


# ---- real servers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sim():
    with EngineSimProcess(["--ttft-scale", "5", "--decode-ms-per-token", "1", "--gpu-blocks", "256",
                           "--lora", "adapter-a", "--max-model-len", "4096"]) as s:
        yield s


def _client(s: EngineSimProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _post(url: str, body: bytes, ctype: str = "application/json") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"content-type": ctype}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _raw_status(s: EngineSimProcess, request: bytes) -> int:
    """Status line of a raw HTTP exchange (for bodies a client library would refuse to send)."""
    import socket

    host, port = s.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        status_line = sock.makefile("rb").readline()
    return int(status_line.split()[1])


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read()


def test_completions_usage_and_prefix_cache(sim):
    c = _client(sim)
    prompt = "A shared system prompt about caches. " * 12  # 444 bytes = 27 full blocks + 12 tokens
    r1 = c.completions.create(model="quillcache-sim", prompt=prompt, max_tokens=7)
    n = len(prompt.encode())
    assert r1.usage.prompt_tokens == n and r1.usage.completion_tokens == 7 and r1.usage.total_tokens == n + 7
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r1.choices[0].finish_reason == "length" and len(r1.choices[0].text.encode()) == 7
    r2 = c.completions.create(model="quillcache-sim", prompt=prompt, max_tokens=7)
    assert r2.usage.prompt_tokens_details.cached_tokens == n // 16 * 16
    assert r2.choices[0].text == r1.choices[0].text  # deterministic output for the same prompt
    # the same text under a cache salt or a LoRA adapter shares nothing (extra keys of the first block)
    r3 = c.completions.create(model="quillcache-sim", prompt=prompt, max_tokens=1, extra_body={"cache_salt": "t1"})
    r4 = c.completions.create(model="adapter-a", prompt=prompt, max_tokens=1)
    assert r3.usage.prompt_tokens_details.cached_tokens == 0
    assert r4.usage.prompt_tokens_details.cached_tokens == 0 and r4.model == "adapter-a"
    # a prompt that ends exactly on a block boundary: the last block is recomputed (vLLM)
    exact = "x" * 64
    c.completions.create(model="quillcache-sim", prompt=exact, max_tokens=1)
    r5 = c.completions.create(model="quillcache-sim", prompt=exact, max_tokens=1)
    assert r5.usage.prompt_tokens_details.cached_tokens == 48


def test_chat_streaming_with_usage(sim):
    c = _client(sim)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about prefix caching."}]
    chunks = list(c.chat.completions.create(model="quillcache-sim", messages=msgs, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 9
    assert usage.prompt_tokens == len(ChatMLTemplate().render(msgs).encode())
    non_stream = c.chat.completions.create(model="quillcache-sim", messages=msgs, max_tokens=9)
    assert non_stream.choices[0].message.content == text  # same tokens streamed or not
    assert non_stream.usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 16 * 16


def test_ttft_grows_with_uncached_tokens(sim):
    c = _client(sim)
    prompt = "".join(random.Random(3).choice("abcdefgh ") for _ in range(3000))

    def ttft() -> float:
        t0 = time.perf_counter()
        stream = c.completions.create(model="quillcache-sim", prompt=prompt, max_tokens=2, stream=True)
        next(iter(stream))
        dt = time.perf_counter() - t0
        stream.close()
        return dt

    cold, warm = ttft(), ttft()
    # engine model (llama-3-8b, H100) x5: ~0.5 s for 3000 new tokens, a few ms for 8 new tokens after 2992 cached
    assert cold > 0.3 and warm < cold / 3, (cold, warm)


def test_router_added_fields_and_nulls_are_ignored(sim):
    """sglang-router and vllm-router forward bodies with fields of their own added; nulls mean defaults."""
    body = {"model": "quillcache-sim", "prompt": "routed", "max_tokens": 2, "echo": False, "no_stop_trim": False,
            "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False, "stream": None,
            "stream_options": None, "seed": None, "n": None, "cache_salt": None, "temperature": 0.7, "top_p": 1}
    status, out = _post(sim.url + "/v1/completions", json.dumps(body).encode())
    assert status == 200 and out["usage"]["completion_tokens"] == 2


def test_errors_are_openai_shaped(sim):
    c = _client(sim)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model="quillcache-sim", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 4096"):
        c.completions.create(model="quillcache-sim", prompt="hi", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
        c.chat.completions.create(model="quillcache-sim", messages=[{"role": "robot", "content": "x"}])
    status, body = _post(sim.url + "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(sim.url + "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    for constant in (b"NaN", b"Infinity", b"-Infinity"):  # Python's parser takes them; JSON has no such values
        status, body = _post(sim.url + "/v1/completions",
                             b'{"model": "quillcache-sim", "prompt": "hi", "temperature": ' + constant + b"}")
        assert status == 400 and f"{constant.decode()} is not a JSON value" in body["error"]["message"], body
    assert _raw_status(sim, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            b"content-length: " + str(33 << 20).encode() + b"\r\n\r\n" + b"a" * 65536) == 413
    assert _get(sim.url + "/health")[0] == 200  # still serving


def test_models_tokenize_metrics_and_sglang_probes(sim):
    models = _client(sim).models.list().data
    assert [m.id for m in models] == ["quillcache-sim", "adapter-a"]
    assert all("stand-in" in m.owned_by for m in models)
    status, body = _post(sim.url + "/tokenize", json.dumps({"prompt": "héllo"}).encode())
    assert status == 200 and body["tokens"] == ByteTokenizer().encode("héllo") and body["count"] == 6
    msgs = [{"role": "user", "content": "hi"}]
    status, body = _post(sim.url + "/tokenize", json.dumps({"messages": msgs}).encode())
    assert body["tokens"] == list(ChatMLTemplate().render(msgs).encode())
    status, body = _post(sim.url + "/detokenize", json.dumps({"tokens": [104, 105]}).encode())
    assert body == {"prompt": "hi"}
    status, body = _post(sim.url + "/detokenize", json.dumps({"tokens": [999]}).encode())
    assert status == 400 and "outside the vocabulary" in body["error"]["message"]
    for path in ("/health_generate", "/get_model_info", "/model_info", "/get_server_info", "/server_info",
                 "/get_load", "/version"):
        assert _get(sim.url + path)[0] == 200, path
    info = json.loads(_get(sim.url + "/get_server_info")[1])
    assert info["page_size"] == 16 and "STAND-IN" in info["stand_in"]
    m = sim.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert m[f'{name}{{model_name="quillcache-sim"}}'] == 0.0
    assert m['vllm:prefix_cache_hits_total{model_name="quillcache-sim"}'] > 0
    assert m['vllm:prefix_cache_queries_total{model_name="quillcache-sim"}'] >= \
        m['vllm:prefix_cache_hits_total{model_name="quillcache-sim"}']
    assert m['vllm:time_to_first_token_seconds_count{model_name="quillcache-sim"}'] > 0
    assert "quillcache_sim_cancelled_total" in m


def test_cli_refuses_bad_flags():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "quillcache", "engine-sim", "--block-size", "0"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "--block-size" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "quillcache", "engine-sim", "--engine-model", "gpt-9"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown model 'gpt-9'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "quillcache", "engine-sim", "--kv-events", "udp://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be tcp://HOST:PORT" in out.stderr and "Traceback" not in out.stderr
    import zmq

    busy = zmq.Context.instance().socket(zmq.PUB)
    try:
        port = busy.bind_to_random_port("tcp://127.0.0.1")
        out = subprocess.run([sys.executable, "-m", "quillcache", "engine-sim", "--kv-events",
                              f"tcp://127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "Address already in use" in out.stderr and "Traceback" not in out.stderr
    finally:
        busy.close(0)
    out = subprocess.run([sys.executable, "-m", "quillcache", "engine-sim", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert "STAND-IN engine" in out.stdout


def test_a_failed_start_names_the_engines_error_and_leaves_no_log_file_behind():
    sim = EngineSimProcess(["--block-size", "0"], start_timeout_s=60.0)
    with pytest.raises(RuntimeError, match="--block-size"):
        sim.start()
    assert sim.proc is not None and sim.proc.returncode == 2
    assert "--block-size" in sim.stderr_tail()  # the tail outlives the file


def test_the_engines_log_never_has_a_name_so_a_killed_run_leaves_nothing_behind():
    with EngineSimProcess(["--block-size", "16"]) as sim:
        fd = sim._stderr.fileno()
        assert os.fstat(fd).st_nlink == 0  # no directory entry, from the start: nothing to remove
        target = os.readlink(f"/proc/{sim.pid}/fd/2")
        assert os.stat(f"/proc/{sim.pid}/fd/2").st_nlink == 0, target  # the engine writes to that same file
        assert isinstance(sim.stderr_tail(), str)


# ---- timing of headers, disconnects and faults ----------------------------------------------------------
@pytest.fixture(scope="module")
def slow_sim():
    with EngineSimProcess(["--fixed-ttft-ms", "500", "--decode-ms-per-token", "50", "--max-num-seqs", "1"]) as s:
        yield s


def test_headers_before_first_token_and_disconnect_cancels(slow_sim):
    c = _client(slow_sim)
    t0 = time.perf_counter()
    with c.completions.with_streaming_response.create(model="quillcache-sim", prompt="hello", max_tokens=100,
                                                       stream=True) as resp:
        t_headers = time.perf_counter() - t0
        assert resp.headers["content-type"].startswith("text/event-stream") and resp.headers["x-request-id"]
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        t_first = time.perf_counter() - t0
        assert json.loads(first[6:])["choices"][0]["text"]
    # 100 tokens at 50 ms would take 5 s: closing after the first one disconnects the client
    assert t_headers < 0.25 and t_first >= 0.5, (t_headers, t_first)
    deadline = time.monotonic() + 5
    while True:
        m = slow_sim.metrics()
        if m["quillcache_sim_cancelled_total"] == 1 and m['vllm:num_requests_running{model_name="quillcache-sim"}'] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.02)
    assert m['vllm:kv_cache_usage_perc{model_name="quillcache-sim"}'] == 0


def test_disconnect_during_prefill_of_a_non_streaming_request(slow_sim):
    import socket

    before = slow_sim.metrics()["quillcache_sim_cancelled_total"]
    host, port = slow_sim.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "quillcache-sim", "prompt": "hi", "max_tokens": 3}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 5
        while slow_sim.metrics()['vllm:num_requests_running{model_name="quillcache-sim"}'] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 5
    while slow_sim.metrics()["quillcache_sim_cancelled_total"] != before + 1:
        assert time.monotonic() < deadline, "a disconnect during prefill was not seen as a cancellation"
        time.sleep(0.01)


def test_batch_limit_queues_requests(slow_sim):
    """--max-num-seqs 1: a second concurrent request waits (vllm:num_requests_waiting) and its TTFT includes the
    first request's whole run (500 ms prefill + 1 x 50 ms decode)."""
    from concurrent.futures import ThreadPoolExecutor

    c = _client(slow_sim)

    def ttft(i: int) -> float:
        t0 = time.perf_counter()
        with c.completions.with_streaming_response.create(model="quillcache-sim", prompt=f"q{i}", max_tokens=2,
                                                           stream=True) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            dt = time.perf_counter() - t0
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
        return dt

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(ttft, 0)
        deadline = time.monotonic() + 5
        while slow_sim.metrics()['vllm:num_requests_running{model_name="quillcache-sim"}'] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = pool.submit(ttft, 1)
        while slow_sim.metrics()['vllm:num_requests_waiting{model_name="quillcache-sim"}'] != 1:
            assert time.monotonic() < deadline, "the second request never waited"
            time.sleep(0.01)
        t_first, t_second = first.result(), second.result()
    assert t_first >= 0.5 and t_second >= 0.5 + 0.5 - 0.1, (t_first, t_second)
    m = slow_sim.metrics()
    assert m['vllm:num_requests_waiting{model_name="quillcache-sim"}'] == 0


FAULT_SEED = 20261125


@pytest.fixture(scope="module")
def faulty_sim():
    with EngineSimProcess(["--fixed-ttft-ms", "1", "--decode-ms-per-token", "1", "--error-rate", "0.3",
                           "--hang-before-headers-s", "0.3", "--hang-rate", "0.3",
                           "--die-mid-stream-after-tokens", "2", "--die-rate", "0.3",
                           "--fault-seed", str(FAULT_SEED)]) as s:
        yield s


def test_fault_knobs_follow_the_seed(faulty_sim):
    rng = random.Random(FAULT_SEED)  # the engine draws three uniforms per request: error, hang, die
    c = _client(faulty_sim)
    seen = {"error": 0, "hang": 0, "die": 0, "ok": 0}
    for i in range(24):
        u_err, u_hang, u_die = rng.random(), rng.random(), rng.random()
        t0 = time.perf_counter()
        try:
            with c.completions.with_streaming_response.create(model="quillcache-sim", prompt=f"req {i}",
                                                               max_tokens=5, stream=True) as resp:
                t_headers = time.perf_counter() - t0
                body = resp.read().decode()
        except openai.InternalServerError as e:
            assert u_err < 0.3, f"request {i} (seed {FAULT_SEED}) failed without an error draw: {e}"
            seen["error"] += 1
            continue
        except Exception as e:  # the connection was dropped mid-stream
            assert u_err >= 0.3 and u_die < 0.3, f"request {i} (seed {FAULT_SEED}): {type(e).__name__} {e}"
            seen["die"] += 1
            continue
        assert u_err >= 0.3 and u_die >= 0.3, f"request {i} (seed {FAULT_SEED}) should have failed"
        assert body.rstrip().endswith("data: [DONE]")
        if u_hang < 0.3:
            assert t_headers >= 0.3, (i, t_headers)
            seen["hang"] += 1
        else:
            seen["ok"] += 1
    assert all(seen.values()), f"seed {FAULT_SEED} should exercise every knob: {seen}"
    m = faulty_sim.metrics()
    assert m['quillcache_sim_injected_faults_total{kind="error"}'] == seen["error"]
    assert m['quillcache_sim_injected_faults_total{kind="die_mid_stream"}'] == seen["die"]
    assert m["quillcache_sim_cancelled_total"] == 0  # an injected death is not a client's cancellation


# ---- a HuggingFace tokenizer and a Jinja chat template ------------------------------------------------------
def test_hf_tokenizer_and_jinja_template_count_like_the_gateway(tmp_path):
    """engine-sim with a real tokenizer.json (trained here) and a tokenizer_config.json chat template: its usage
    counts equal what quillcache.textproc computes for the same request (what the gateway uses)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from quillcache.textproc import load_chat_template, load_tokenizer, prompt_tokens

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the cache block token prefix engine router", "hello there, how are you", "a b c d e f g"] * 30
    tok.train_from_iterator(corpus, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer, tpl = load_tokenizer(str(tmp_path / "tokenizer.json")), load_chat_template(str(tmp_path))
    msgs = [{"role": "user", "content": "hello there, how is the cache?"}]
    expected = prompt_tokens("chat", {"messages": msgs}, tokenizer, tpl)
    with EngineSimProcess(tokenizer=tmp_path / "tokenizer.json", chat_template=tmp_path, fixed_ttft_ms=1,
                          decode_ms_per_token=0) as s:
        r = _client(s).chat.completions.create(model="quillcache-sim", messages=msgs, max_tokens=6)
        assert r.usage.prompt_tokens == expected.num_tokens and r.usage.completion_tokens == 6
        streamed = "".join(ch.choices[0].delta.content or "" for ch in _client(s).chat.completions.create(
            model="quillcache-sim", messages=msgs, max_tokens=6, stream=True) if ch.choices)
        assert streamed == r.choices[0].message.content and streamed.strip()
        status, body = _post(s.url + "/tokenize", json.dumps({"messages": msgs}).encode())
        assert body["tokens"] == list(expected.token_ids)
        status, body = _post(s.url + "/tokenize", json.dumps({"prompt": "hello there"}).encode())
        assert body["tokens"] == tokenizer.encode("hello there", add_special_tokens=True)


# ---- the block cache against a plain-list specification (stateful) ---------------------------------------
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402


class _ListSpec:
    """The block cache's contract with plain lists: ``lru`` oldest first (unpinned), ``pins`` ref counts."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.lru, self.pins = capacity, [], {}

    def cached(self, d: bytes) -> bool:
        return d in self.pins or d in self.lru

    def match(self, ds: list[bytes]) -> int:
        n = 0
        while n < len(ds) and self.cached(ds[n]):
            n += 1
        return n

    def pin(self, d: bytes) -> None:
        if d in self.lru:
            self.lru.remove(d)
        self.pins[d] = self.pins.get(d, 0) + 1

    def store(self, ds: list[bytes], start: int) -> tuple[list[bytes], list[bytes], int]:
        evicted, pinned = [], []
        for i in range(start, len(ds)):
            if self.cached(ds[i]):
                self.pin(ds[i])
                pinned.append(ds[i])
                continue
            if len(self.lru) + len(self.pins) >= self.capacity:
                if not self.lru:
                    return evicted, pinned, len(ds) - i
                evicted.append(self.lru.pop(0))
            self.pins[ds[i]] = 1
            pinned.append(ds[i])
        return evicted, pinned, 0

    def release(self, ds: list[bytes]) -> None:
        for d in reversed(ds):
            self.pins[d] -= 1
            if not self.pins[d]:
                del self.pins[d]
                self.lru.append(d)


class BlockCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache, self.spec = SimBlockCache(6), _ListSpec(6)
        self.running: list[list[bytes]] = []

    @rule(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=10), salt=st.sampled_from([None, "s"]))
    def start_request(self, tokens, salt):
        ds = engine_block_digests(tokens, 2, cache_salt=salt)
        pinned = self.cache.pin_prefix(ds)
        assert len(pinned) == self.spec.match(ds)
        for d in pinned:
            self.spec.pin(d)
        res = self.cache.store(ds, len(pinned))
        evicted, spec_pinned, uncached = self.spec.store(ds, len(pinned))
        assert res.evicted == evicted and res.pinned == spec_pinned and res.num_uncached == uncached
        stored = [d for run in res.runs for d in run.digests]
        assert len(set(stored)) == len(stored) and set(stored) <= set(spec_pinned)
        for run in res.runs:  # each run continues the chain from the block before it
            assert run.parent == (ds[run.first_block - 1] if run.first_block else None)
            assert list(run.digests) == ds[run.first_block:run.first_block + len(run.digests)]
        self.running.append(pinned + res.pinned)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish_request(self, i):
        ds = self.running.pop(i % len(self.running))
        self.cache.release(ds)
        self.spec.release(ds)

    @invariant()
    def same_state(self):
        assert self.cache.num_cached_blocks == len(self.spec.lru) + len(self.spec.pins) <= 6
        assert self.cache.num_pinned_blocks == len(self.spec.pins)
        assert list(self.cache._lru) == self.spec.lru  # eviction order is part of the contract


TestBlockCacheMachine = BlockCacheMachine.TestCase
TestBlockCacheMachine.settings = settings(max_examples=min(settings.default.max_examples, 40), stateful_step_count=25,
                                          deadline=None)
