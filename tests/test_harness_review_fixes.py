"""Regressions of a harness review: replay rows keep their trace ids after oversize skips; a tokenizer that encodes
the stand-in engine's words to nothing is refused (never an endless loop); a lone surrogate is a 400 from the
HuggingFace tokenizer path (engine-sim and gateway); ``quillcache hash`` refuses an over-long token in one line;
the plain-Python chain reference seeds its chain step like ``hash_blocks``; an empty ``jinja:`` spec is refused."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hf_fixture import train_bpe_tokenizer

from quillcache.cli import main
from quillcache.hashing import _xxh3
from quillcache.hashing import blocks as hashing
from quillcache.harness import ReplayConfig, replay
from quillcache.textproc import (ChatFormatError, ChatMLTemplate, PromptError, TokenizerError, load_chat_template,
                                 load_tokenizer, prompt_token_array, prompt_tokens)
from quillcache.traces.loader import TraceRequest

pytestmark = pytest.mark.timeout(120)

BS = 16


# ---- 1. replay: request ids and the clock after on_oversize="skip" -------------------------------------------
def _skip_cfg() -> ReplayConfig:
    return ReplayConfig(model="llama-3.2-1b", engines=1, gpu_capacity_blocks=50, dram_capacity_blocks=64,
                        ssd_capacity_blocks=0, account_bytes=True, on_oversize="skip")


def test_replay_rows_keep_their_trace_request_ids_after_an_oversize_skip():
    reqs = [TraceRequest(0, 4 * BS, 5, (1, 2, 3, 4), block_tokens=BS),
            TraceRequest(1000, 100 * BS, 5, tuple(range(100, 200)), block_tokens=BS),  # > 50 GPU blocks: skipped
            TraceRequest(2000, 2 * BS, 5, (7, 8), block_tokens=BS),
            TraceRequest(3000, 3 * BS, 5, (1, 2, 3), block_tokens=BS)]
    cfg = _skip_cfg()
    res = replay(reqs, cfg)
    assert res.skipped_oversize == 1
    assert sorted(r.request_id for r in res.rows) == [0, 2, 3]
    for row in res.rows:
        src = reqs[row.request_id]
        assert row.input_tokens == src.input_tokens
        assert row.arrival_s == pytest.approx(src.timestamp_ms / (1000.0 * cfg.time_scale))


def test_replay_clock_starts_at_the_traces_first_arrival_even_when_it_is_skipped():
    reqs = [TraceRequest(0, 100 * BS, 5, tuple(range(100, 200)), block_tokens=BS),  # skipped
            TraceRequest(5000, 2 * BS, 5, (7, 8), block_tokens=BS)]
    cfg = _skip_cfg()
    res = replay(reqs, cfg)
    assert res.skipped_oversize == 1 and len(res.rows) == 1
    assert res.rows[0].request_id == 1
    assert res.rows[0].arrival_s == pytest.approx(5.0 / cfg.time_scale)


# ---- 2. engine-sim: a tokenizer that encodes its output words to no ids --------------------------------------
@pytest.fixture(scope="module")
def wordless_tokenizer(tmp_path_factory):
    """A BPE tokenizer.json whose vocabulary lacks every output word and that has no unk token: encode() -> []."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={"<s>": 0, "Z": 1, "Q": 2}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("wordless") / "tokenizer.json"
    tok.save(str(path))
    loaded = load_tokenizer(str(path))
    assert loaded.encode(" the cache") == [] and loaded.encode("ZQ") == [1, 2]
    return path


def _in_thread(fn, timeout_s: float = 10.0):
    """fn()'s result or exception, within timeout_s (an endless loop fails the test instead of hanging it)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout_s)
    assert not th.is_alive(), f"still running after {timeout_s} s"
    return out


def test_plan_output_raises_when_the_tokenizer_encodes_words_to_nothing(wordless_tokenizer):
    from quillcache.enginesim.textgen import plan_output

    tok = load_tokenizer(str(wordless_tokenizer))
    out = _in_thread(lambda: plan_output(tok, [1, 2], 4, engine_seed=0, request_seed=None))
    assert isinstance(out.get("error"), TokenizerError), out
    assert "no more token ids" in str(out["error"])


def test_engine_sim_refuses_such_a_tokenizer_when_it_loads_it(wordless_tokenizer):
    from quillcache.enginesim.config import EngineSimConfig
    from quillcache.enginesim.engine import SimEngine

    cfg = EngineSimConfig(tokenizer=str(wordless_tokenizer), fixed_ttft_ms=0, decode_ms_per_token=0, gpu_blocks=64)
    with pytest.raises(TokenizerError, match="output word 'the' to no token id"):
        SimEngine(cfg).close()
    # the CLI refuses it in one line, exit 2, before it serves
    try:
        out = subprocess.run([sys.executable, "-m", "quillcache", "engine-sim", "--port", "0",
                              "--tokenizer", str(wordless_tokenizer)], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:  # run() killed it: it served
        pytest.fail("engine-sim served a tokenizer that cannot encode its output words")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("quillcache engine-sim: tokenizer ") and "output word 'the'" in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr and "KV events" not in out.stderr


# ---- 3. a lone surrogate through the HuggingFace tokenizer ---------------------------------------------------
@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    """A small trained byte-level BPE tokenizer.json (every byte has an id, so every output word encodes)."""
    return train_bpe_tokenizer(tmp_path_factory.mktemp("hf"),
                               ["the quick brown fox jumps over the lazy dog", "hello world"] * 10)


def test_hf_tokenizer_refuses_a_lone_surrogate_as_a_tokenizer_error(hf_path):
    tok = load_tokenizer(str(hf_path))
    for encode in (tok.encode, tok.encode_array):
        with pytest.raises(TokenizerError, match="not encodable as UTF-8 at position 3"):
            encode("hi \ud800 there")
    with pytest.raises(TypeError, match="text must be str"):  # a non-str stays a TypeError
        tok.encode(b"hi")
    chat = {"messages": [{"role": "user", "content": "hi \ud800"}]}
    for fn in (prompt_tokens, prompt_token_array):
        with pytest.raises(PromptError, match="'messages' cannot be tokenized"):
            fn("chat", chat, tok, ChatMLTemplate())
        with pytest.raises(PromptError, match="'prompt' cannot be tokenized"):
            fn("completion", {"prompt": "hi \ud800"}, tok, ChatMLTemplate())


def test_engine_sim_answers_400_to_a_lone_surrogate_with_an_hf_tokenizer(hf_path):
    from starlette.testclient import TestClient

    from quillcache.enginesim.app import build_app
    from quillcache.enginesim.config import EngineSimConfig

    cfg = EngineSimConfig(tokenizer=str(hf_path), fixed_ttft_ms=0, decode_ms_per_token=0, gpu_blocks=64)
    with TestClient(build_app(cfg), raise_server_exceptions=False) as c:
        for route, raw, field in (
                ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
                 "messages"),
                ("/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt")):
            r = c.post(route, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (route, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == field and f"'{field}'" in err["message"] and "UTF-8" in err["message"], err


def test_gateway_answers_400_to_a_lone_surrogate_with_an_hf_tokenizer(hf_path):
    import aiohttp

    from quillcache.cluster.etcd import free_port
    from quillcache.gateway.server import GatewayProcess

    key = "sk-review-fixes-01"

    async def post(url: str, raw: bytes):
        headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession() as s:
            async with s.post(url, data=raw, headers=headers) as r:
                return r.status, await r.read()

    # the prompt is tokenized before any engine is chosen: a dead engine address suffices
    with GatewayProcess([f"http://127.0.0.1:{free_port()}"], keys={key: "tenant-r"}, wait_ready=False,
                        config={"tokenizer": str(hf_path), "models": {"quillcache-sim": {"base": "quillcache-sim"}}}
                        ) as gw:
        raw = b'{"model": "quillcache-sim", "messages": [{"role": "user", "content": "hi \\ud800"}]}'
        status, body = asyncio.run(post(gw.url + "/v1/chat/completions", raw))
    assert status == 400, body
    err = json.loads(body)["error"]
    assert "'messages' cannot be tokenized" in err["message"] and "Traceback" not in body.decode(), err


# ---- 4. quillcache hash: a token too long for int() ----------------------------------------------------------
def test_hash_cli_refuses_an_overlong_token_in_one_line(capsys):
    assert main(["hash", "1", "1" * 5000]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokens[1] (5,000 digits) is out of range" in err and "2**32" in err
    assert main(["hash", "1" * 11]) == 2  # past 2**32 - 1 by length alone
    assert "tokens[0]" in capsys.readouterr().err
    assert main(["hash", "--block-size", "2", "0000000000001", "2"]) == 0  # leading zeros do not count
    assert int(capsys.readouterr().out.split("\t")[1], 16) == int(hashing.hash_blocks([1, 2], 2)[0])


# ---- 5. the plain-Python reference chain agrees with hash_blocks under a LoRA / namespace seed ---------------
names = st.one_of(st.none(), st.text(max_size=6))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(toks=st.lists(st.integers(0, 2**32 - 1), max_size=120), bs=st.integers(1, 24), lora=names, ns=names)
def test_reference_hash_blocks_equals_hash_blocks_with_lora_and_namespace(toks, bs, lora, ns):
    seed = hashing.hash_seed(lora, ns)
    want = hashing.hash_blocks(np.asarray(toks, dtype=np.uint64), bs, lora=lora, namespace=ns).tolist()
    assert _xxh3.reference_hash_blocks(toks, bs, seed) == want


def test_reference_hash_blocks_default_chain_seed_with_a_lora():
    toks = list(range(64))
    seed = hashing.hash_seed("my-lora")
    assert seed != hashing.DYNAMO_BASE_SEED
    assert _xxh3.reference_hash_blocks(toks, 16, seed) == hashing.hash_blocks(toks, 16, lora="my-lora").tolist()


# ---- 6. an empty jinja: spec --------------------------------------------------------------------------------
def test_an_empty_jinja_spec_is_refused_not_read_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    monkeypatch.chdir(tmp_path)
    for spec in ("jinja:", ""):
        with pytest.raises(ChatFormatError, match="empty chat template spec"):
            load_chat_template(spec)
    with pytest.raises(TokenizerError, match="empty tokenizer spec"):  # as load_tokenizer does
        load_tokenizer("hf:")
