"""quillcache.textproc: tokenizers (byte fallback, HuggingFace tokenizer.json), chat templates, prompt tokens."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hf_fixture import train_bpe_tokenizer

from quillcache.textproc import (
    ByteTokenizer,
    ChatFormatError,
    ChatMLTemplate,
    HfTokenizer,
    JinjaChatTemplate,
    PromptError,
    TokenizerError,
    chat_prompt_tokens,
    completion_prompt_tokens,
    load_chat_template,
    load_tokenizer,
    normalize_messages,
)

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokenizer",
          "naïve café — ünïcödé 日本語 テキスト 🙂", "<|im_start|>user\nhi<|im_end|>\n"] * 20


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory):
    """A real tokenizer.json trained here (byte-level BPE, ChatML specials, a BOS added by the post-processor)."""
    return train_bpe_tokenizer(tmp_path_factory.mktemp("tok"), CORPUS, vocab_size=400)


# ---- byte tokenizer -------------------------------------------------------------------------
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_counts_utf8_bytes():
    tok = load_tokenizer("bytes")
    assert tok.encode("é🙂") == [0xC3, 0xA9, 0xF0, 0x9F, 0x99, 0x82]
    assert tok.vocab_size == 256
    assert tok.decode([0xF0, 0x9F]) == "\ufffd"  # a cut inside a character never raises


def test_byte_tokenizer_errors_name_the_bad_value():
    tok = ByteTokenizer()
    with pytest.raises(TokenizerError, match=r"ids\[1\]=256 is outside the vocabulary \[0, 256\)"):
        tok.decode([1, 256])
    with pytest.raises(TypeError, match=r"ids\[0\] must be int, got str"):
        tok.decode(["a"])
    with pytest.raises(TypeError, match="text must be str, got bytes"):
        tok.encode(b"abc")
    with pytest.raises(TokenizerError, match="not encodable as UTF-8 at position 1"):
        tok.encode("a\ud800")


# ---- HuggingFace tokenizer ------------------------------------------------------------------
def test_hf_tokenizer_round_trip_and_special_tokens(hf_path):
    tok = load_tokenizer(str(hf_path))
    assert isinstance(tok, HfTokenizer)
    for text in set(CORPUS) | {"unseen wörds ✓"}:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    plain = tok.encode("hello world")
    with_bos = tok.encode("hello world", add_special_tokens=True)
    assert with_bos == [0] + plain
    # the ChatML markers are single special tokens, not split into bytes
    im = tok.encode("<|im_start|>user")
    assert im[0] == tok.token_to_id("<|im_start|>")
    assert load_tokenizer(hf_path.parent).encode("hello") == tok.encode("hello")  # a directory works too


def test_hf_tokenizer_bad_paths(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json at"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="is not a valid tokenizer.json"):
        load_tokenizer(str(bad))
    with pytest.raises(TokenizerError, match="empty tokenizer spec"):
        load_tokenizer("hf:")


# ---- chat templates -------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}]


def test_chatml_exact_output():
    text = ChatMLTemplate().render(MESSAGES)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ☃<|im_end|>\n"
                    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\ntwo \nparts<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert ChatMLTemplate().render(MESSAGES[:1], add_generation_prompt=False) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n"
    assert load_chat_template(None).render(MESSAGES) == text


@pytest.mark.parametrize("messages, match", [
    ("hi", r"'messages' must be a list, got str"),
    ([], r"'messages' is empty"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role must be one of"),
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string or a list of text parts, got int"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}],
     r"messages\[1\]\.content\[0\] must be"),
    ([["user", "x"]], r"messages\[0\] must be an object, got list"),
])
def test_messages_refused_with_field_named(messages, match):
    with pytest.raises(ChatFormatError, match=match):
        normalize_messages(messages)


def test_assistant_may_omit_content():
    assert normalize_messages([{"role": "assistant", "content": None}]) == [{"role": "assistant", "content": ""}]


def _write_config(tmp_path, template, **extra):
    cfg = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>", **extra}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_jinja_template_from_tokenizer_config_matches_chatml(tmp_path):
    src = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tpl = load_chat_template(_write_config(tmp_path, src))
    assert isinstance(tpl, JinjaChatTemplate)
    assert tpl.render(MESSAGES) == "<s>" + ChatMLTemplate().render(MESSAGES)


def test_jinja_template_errors(tmp_path):
    with pytest.raises(ChatFormatError, match="does not compile"):
        JinjaChatTemplate("{% for %}")
    refusing = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    with pytest.raises(ChatFormatError, match="refused the messages: first must be user"):
        JinjaChatTemplate(refusing).render(MESSAGES)
    with pytest.raises(ChatFormatError, match="no tokenizer_config.json"):
        load_chat_template(str(tmp_path / "nope"))
    named = _write_config(tmp_path, [{"name": "tool_use", "template": "x"}])
    with pytest.raises(ChatFormatError, match=r"no chat template named 'default'; it has \['tool_use'\]"):
        load_chat_template(named)
    # the sandbox refuses attribute tricks instead of running them
    with pytest.raises(Exception, match="unsafe|access"):
        JinjaChatTemplate("{{ messages.__class__.__mro__ }}").render(MESSAGES)


# ---- prompt tokens --------------------------------------------------------------------------
def test_prompt_tokens_both_endpoints(hf_path):
    tok = load_tokenizer(str(hf_path))
    tpl = ChatMLTemplate()
    c = completion_prompt_tokens({"prompt": "hello world"}, tok)
    assert c.token_ids == tuple(tok.encode("hello world", add_special_tokens=True)) and c.text == "hello world"
    assert completion_prompt_tokens({"prompt": ["hello world"]}, tok).token_ids == c.token_ids
    assert completion_prompt_tokens({"prompt": [5, 6, 7]}, tok).token_ids == (5, 6, 7)
    ch = chat_prompt_tokens({"messages": MESSAGES}, tok, tpl)
    assert ch.text == tpl.render(MESSAGES)
    assert ch.token_ids == tuple(tok.encode(ch.text))  # no BOS: the template holds the specials
    assert tok.decode(ch.token_ids) == ch.text


def test_add_special_tokens_is_honoured_as_vllm_does(hf_path):
    """vLLM encodes a completion prompt with special tokens unless the request says ``add_special_tokens: false``,
    and a rendered chat without them unless it says true; both sides of the gateway must, or they hash different
    first blocks (the field was ignored before)."""
    from quillcache.textproc import prompt_token_array

    tok = load_tokenizer(str(hf_path))
    tpl = ChatMLTemplate()
    plain = tuple(tok.encode("hello world"))
    assert completion_prompt_tokens({"prompt": "hello world", "add_special_tokens": False}, tok).token_ids == plain
    assert completion_prompt_tokens({"prompt": "hello world", "add_special_tokens": True}, tok).token_ids == \
        (0, *plain)
    text = tpl.render(MESSAGES)
    for flag, want in ((None, tok.encode(text)), (False, tok.encode(text)), (True, [0, *tok.encode(text)]),
                       ("yes", [0, *tok.encode(text)])):
        body = {"messages": MESSAGES, **({} if flag is None else {"add_special_tokens": flag})}
        assert chat_prompt_tokens(body, tok, tpl).token_ids == tuple(want)
        assert prompt_token_array("chat", body, tok, tpl).tolist() == list(want)
    with pytest.raises(PromptError, match="'add_special_tokens' must be true or false"):
        completion_prompt_tokens({"prompt": "hello", "add_special_tokens": "maybe"}, tok)


@pytest.mark.parametrize("body, match", [
    ({}, "'prompt' is missing"),
    ({"prompt": ""}, "'prompt' is empty"),
    ({"prompt": []}, "'prompt' is an empty list"),
    ({"prompt": ["a", "b"]}, "batched prompts are not supported"),
    ({"prompt": [1, 300]}, r"prompt\[1\]=300 is not a token id in \[0, 256\)"),
    ({"prompt": [1, True]}, r"prompt\[1\]=True is not a token id"),
    ({"prompt": 3.5}, "must be a string or a list of token ids, got float"),
])
def test_completion_prompt_refusals(body, match):
    with pytest.raises(PromptError, match=match):
        completion_prompt_tokens(body, ByteTokenizer())


def test_chat_prompt_refusals():
    with pytest.raises(PromptError, match="'messages' is missing"):
        chat_prompt_tokens({}, ByteTokenizer(), ChatMLTemplate())
    with pytest.raises(PromptError, match=r"messages\[0\]\.role"):
        chat_prompt_tokens({"messages": [{"role": "x", "content": ""}]}, ByteTokenizer(), ChatMLTemplate())
