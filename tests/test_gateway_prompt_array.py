"""The gateway's prompt ids as one uint32 array (``prompt_token_array``, its per-request path) agree with
``prompt_tokens`` (what the stand-in engine uses) for both endpoints and both tokenizers, and refuse exactly the
same bodies with the same messages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hf_fixture import train_bpe_tokenizer

from quillcache.textproc import (ByteTokenizer, ChatMLTemplate, PromptError, load_tokenizer, prompt_token_array,
                                 prompt_tokens)

TPL = ChatMLTemplate()


def _same(kind, body, tok):
    ref = prompt_tokens(kind, body, tok, TPL).token_ids
    arr = prompt_token_array(kind, body, tok, TPL)
    assert arr.dtype == np.uint32 and arr.ndim == 1 and arr.flags.c_contiguous
    assert arr.tolist() == list(ref)
    return arr


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1), st.text())
def test_byte_tokenizer_arrays_equal_the_engines_ids(prompt, content):
    tok = ByteTokenizer()
    _same("completion", {"prompt": prompt}, tok)
    _same("completion", {"prompt": [prompt]}, tok)
    _same("chat", {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": content}]}, tok)


def test_token_id_prompts_and_a_fresh_array_each_call():
    tok = ByteTokenizer()
    a = _same("completion", {"prompt": [5, 6, 255]}, tok)
    b = prompt_token_array("completion", {"prompt": [5, 6, 255]}, tok, TPL)
    assert a is not b and not np.shares_memory(a, b)
    a[0] = 9  # the caller owns it: writable, and the next call is unaffected
    assert prompt_token_array("completion", {"prompt": [5, 6, 255]}, tok, TPL)[0] == 5


def test_hf_tokenizer_arrays_equal_the_engines_ids(tmp_path):
    train_bpe_tokenizer(tmp_path, ["hello world, the quick brown fox", "naïve café 日本語 🙂"] * 10)
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    a = _same("completion", {"prompt": "hello world 🙂"}, tok)
    assert a[0] == 0  # the BOS the engine adds to a completion prompt
    _same("chat", {"messages": [{"role": "user", "content": "naïve café"}]}, tok)


@pytest.mark.parametrize("kind, body", [
    ("completion", {}), ("completion", {"prompt": ""}), ("completion", {"prompt": []}),
    ("completion", {"prompt": ["a", "b"]}), ("completion", {"prompt": [1, 300]}), ("completion", {"prompt": [1, True]}),
    ("completion", {"prompt": 3.5}), ("completion", {"prompt": "\ud800"}), ("chat", {}),
    ("chat", {"messages": [{"role": "x", "content": ""}]}), ("chat", {"messages": "hi"}),
])
def test_the_same_bodies_are_refused_with_the_same_message(kind, body):
    tok = ByteTokenizer()
    with pytest.raises(PromptError) as ref:
        prompt_tokens(kind, body, tok, TPL)
    with pytest.raises(PromptError) as got:
        prompt_token_array(kind, body, tok, TPL)
    assert str(got.value) == str(ref.value)
    with pytest.raises(ValueError, match="unknown prompt kind"):
        prompt_token_array("embeddings", body, tok, TPL)
