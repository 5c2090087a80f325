"""Chat templates get messages' content as vLLM gives it to them: one string, or OpenAI's list of text parts when the
template loops over a message's content (vLLM's ``--chat-template-content-format auto``), and ``{% generation %}``
blocks compile as in ``transformers``. Before, every template got strings: one that loops over content parts
iterated the characters of the string, so the gateway and the stand-in engine hashed a prompt that no vLLM
would render, and a template with a generation block was refused as not compiling."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quillcache.textproc import ByteTokenizer, ChatFormatError, chat_prompt_tokens, load_chat_template
from quillcache.textproc.chat import JinjaChatTemplate, normalize_messages
from quillcache.textproc.content_format import detect_content_format, resolve_content_format

# a template that only knows content parts, as multimodal templates are written (no string branch)
PARTS_ONLY = ("{{ bos_token }}{%- for message in messages %}<|{{ message['role'] }}|>"
              "{%- for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
              "{{ content['text'] }}{%- if not loop.last %} {% endif %}{%- endfor %}<|end|>{%- endfor %}"
              "{%- if add_generation_prompt %}<|assistant|>{%- endif %}")
# a template that takes either, testing the type first (Gemma 3 / Qwen2-VL style)
EITHER = ("{%- for m in messages -%}[{{ m.role }}]"
          "{%- if m.content is string -%}S:{{ m.content }}"
          "{%- else -%}{%- for c in m.content -%}P:{{ c.text }};{%- endfor -%}{%- endif -%}{%- endfor -%}"
          "{%- if add_generation_prompt -%}[assistant]{%- endif -%}")
GENERATION = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}{% generation %}A:{{ m.content }}"
              "{% endgeneration %}{%- else -%}U:{{ m.content }}{%- endif -%}|{%- endfor -%}")

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]


@pytest.mark.parametrize("source, expected", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endfor %}", "openai"),
    (PARTS_ONLY, "openai"),
    (EITHER, "openai"),  # syntactic, as vLLM's rule: the type test does not make it "string"
    # through an alias set from a slice of messages, and filters on both loops
    ("{% set rest = messages[1:] %}{% set tail = rest | list %}{% for m in tail %}"
     "{% for c in m.content | list %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% for m in messages | selectattr('role') %}{% for c in m.content[1:] %}x{% endfor %}{% endfor %}", "openai"),
    # a loop over another variable's content, or over content of something that is not a message
    ("{% for m in messages %}{% for c in other.content %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in others %}{% for c in m.content %}{% endfor %}{% endfor %}", "string"),
    ("{% for c in messages[0].content %}{{ c }}{% endfor %}", "string"),
    # several names bound at once: vLLM's detector gives up and falls back to "string"
    ("{% for m in messages %}{% for k, v in m.content %}{{ k }}{% endfor %}{% endfor %}", "string"),
    ("{% for i, m in messages %}{% for c in m.content %}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}", "string"),  # does not parse
    (GENERATION, "string"),
])
def test_detect_content_format_follows_vllm_rule(source, expected):
    assert detect_content_format(source) == expected


def test_a_parts_only_template_renders_parts_for_string_content():
    """Before: 'Hello there' reached the template as a string and was iterated character by character, so the
    text of every string message vanished from the prompt."""
    tpl = JinjaChatTemplate(PARTS_ONLY, bos_token="<s>")
    assert tpl.content_format == "openai"
    text = tpl.render(MESSAGES)
    assert text == ("<s><|system|>Be brief.<|end|><|user|>Hello there<|end|><|assistant|><|end|>"
                    "<|user|>part one part two<|end|><|assistant|>")


def test_content_shapes_per_format():
    string = normalize_messages(MESSAGES)
    parts = normalize_messages(MESSAGES, "openai")
    assert [m["content"] for m in string] == ["Be brief.", "Hello there", "", "part one\npart two"]
    assert [m["content"] for m in parts] == [
        [{"type": "text", "text": "Be brief."}], [{"type": "text", "text": "Hello there"}], [],
        [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]]
    with pytest.raises(ValueError, match="content_format"):
        normalize_messages(MESSAGES, "auto")


def test_the_requested_format_overrides_detection_and_bad_values_are_refused(tmp_path):
    assert JinjaChatTemplate(EITHER).render(MESSAGES[:2]) == "[system]P:Be brief.;[user]P:Hello there;[assistant]"
    forced = JinjaChatTemplate(EITHER, content_format="string")
    assert forced.content_format == "string"
    assert forced.render(MESSAGES[:2]) == "[system]S:Be brief.[user]S:Hello there[assistant]"
    with pytest.raises(ChatFormatError, match=r"one of \['auto', 'string', 'openai'\], got 'parts'"):
        JinjaChatTemplate(EITHER, content_format="parts")
    with pytest.raises(ChatFormatError, match="ChatML template renders string content"):
        load_chat_template("chatml", content_format="openai")
    assert load_chat_template(None, content_format="string").name == "chatml"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": PARTS_ONLY}))
    assert load_chat_template(tmp_path).content_format == "openai"
    assert load_chat_template(tmp_path, content_format="string").content_format == "string"
    with pytest.raises(ValueError, match="one of"):
        resolve_content_format("", None)


def test_continue_final_message_cuts_after_the_last_text_part():
    tpl = JinjaChatTemplate(EITHER)
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "so far "}]}]
    assert tpl.render(msgs, add_generation_prompt=False, continue_final_message=True) == \
        "[user]P:hi;[assistant]P:first;P:so far "
    with pytest.raises(ChatFormatError, match="no text to continue"):
        tpl.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}],
                   add_generation_prompt=False, continue_final_message=True)


def test_generation_blocks_compile_and_render_their_body():
    """Before: 'chat template does not compile: Encountered unknown tag 'generation''."""
    text = JinjaChatTemplate(GENERATION).render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    assert text == "U:q|A:a|"


def test_prompt_tokens_of_a_parts_template_carry_the_string_messages(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": PARTS_ONLY}))
    tpl = load_chat_template(tmp_path)
    got = chat_prompt_tokens({"messages": MESSAGES[:2]}, ByteTokenizer(), tpl)
    assert got.text == "<|system|>Be brief.<|end|><|user|>Hello there<|end|><|assistant|>"


def test_engine_sim_cli_refuses_an_unknown_content_format():
    proc = subprocess.run([sys.executable, "-m", "quillcache", "engine-sim", "--chat-template-content-format", "list"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--chat-template-content-format" in proc.stderr and "invalid choice" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "quillcache", "engine-sim", "--chat-template-content-format",
                           "openai"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "ChatML template renders string content" in proc.stderr


# ---- against transformers, when it is installed (a dev dependency) ----------------------------------------------
def _vllm_conversation(messages, content_format):
    """The conversation as vLLM's parse_chat_messages hands it to apply_chat_template, written out by hand."""
    out = []
    for m in messages:
        c = m["content"]
        texts = [] if c is None else [c] if isinstance(c, str) else [p["text"] for p in c]
        content = [{"type": "text", "text": t} for t in texts] if content_format == "openai" else "\n".join(texts)
        out.append({"role": m["role"], "content": content})
    return out


@pytest.mark.parametrize("source", [PARTS_ONLY, EITHER, GENERATION])
@pytest.mark.parametrize("flags", [{}, {"add_generation_prompt": False, "continue_final_message": True}])
def test_same_text_as_transformers(source, flags):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), bos_token="<s>")
    messages = [*MESSAGES, {"role": "assistant", "content": [{"type": "text", "text": "x"},
                                                             {"type": "text", "text": "so far "}]}]
    tpl = JinjaChatTemplate(source, bos_token="<s>")
    expected = hf.apply_chat_template(_vllm_conversation(messages, tpl.content_format), chat_template=source,
                                      tokenize=False, add_generation_prompt=flags.get("add_generation_prompt", True),
                                      continue_final_message=flags.get("continue_final_message", False))
    assert tpl.render(messages, **flags) == expected


# ---- end to end: the gateway and the stand-in engine render a parts-only template alike --------------------------
@pytest.mark.timeout(120)
def test_gateway_and_engine_render_a_parts_template_alike(tmp_path):
    """Both detect the content format from the same tokenizer_config.json: the gateway's predicted cached tokens
    equal the engine's, and the prompt carries the text of the string messages (before, both dropped it: the
    engine counted only the template's markers)."""
    import openai

    from quillcache.enginesim.process import EngineSimProcess
    from quillcache.gateway.server import GatewayProcess

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": PARTS_ONLY, "bos_token": "<s>"}))
    system = "A long system prompt that every conversation shares, about caching KV blocks. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]
    expected = JinjaChatTemplate(PARTS_ONLY, bos_token="<s>").render(messages)
    assert system in expected
    with EngineSimProcess(["--fixed-ttft-ms", "5", "--decode-ms-per-token", "1", "--model", "m",
                           "--chat-template", str(tmp_path)]) as engine:
        with GatewayProcess([engine.url], keys={"sk-tenant-a-0001": "tenant-a"},
                            config={"chat_template": str(tmp_path / "tokenizer_config.json"), "seed": 1}) as gw:
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-tenant-a-0001", max_retries=0, timeout=30)
            first = client.chat.completions.with_raw_response.create(model="m", messages=messages, max_tokens=2)
            assert first.parse().usage.prompt_tokens == len(expected.encode())  # byte tokens of the parts render
            again = client.chat.completions.with_raw_response.create(
                model="m", messages=[*messages[:1], {"role": "user", "content": "second question"}], max_tokens=2)
            engine_cached = again.parse().usage.prompt_tokens_details.cached_tokens
            assert engine_cached >= 16 * (len(system) // 16 - 1)
            assert int(again.headers["x-quillcache-cached-tokens"]) == engine_cached


def test_gateway_refuses_a_bad_content_format_in_its_config(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key": "sk-tenant-a-0001", "tenant": "tenant-a"}]}))
    for value, message in (("parts", "chat_template_content_format must be one of ['auto', 'string', 'openai']"),
                           ("openai", "chat_template: the built-in ChatML template renders string content")):
        conf = tmp_path / "gateway.json"
        conf.write_text(json.dumps({"engines": [{"url": "http://127.0.0.1:1"}],
                                    "chat_template_content_format": value}))
        proc = subprocess.run([sys.executable, "-m", "quillcache", "gateway", "--config", str(conf), "--keys",
                               str(keys), "--port", "0"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_gateway_built_in_code_renders_with_its_configs_content_format(tmp_path):
    """The programmatic path (no template passed in) loads the template with the config's content format."""
    from quillcache.gateway.app import Gateway
    from quillcache.gateway.config import config_from_dict, parse_engine_urls
    from quillcache.gateway.tenants import TenantKey, TenantTable

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": EITHER}))
    tenants = TenantTable({"sk-units-0001": TenantKey(tenant="tenant-u")})
    for fmt, want in (("auto", "openai"), ("string", "string")):
        cfg = config_from_dict({"chat_template": str(tmp_path), "chat_template_content_format": fmt},
                               engines=parse_engine_urls("http://127.0.0.1:9"))
        assert Gateway(cfg, tenants).template.content_format == want


# ---- re-review of 2026-11-29 (/tmp/s36/rr L1-L3) ----------------------------------------------------------------
def test_empty_text_parts_are_dropped_from_a_string_content_as_vllm_drops_them():
    parts = [{"type": "text", "text": "Summarise:"}, {"type": "text", "text": ""}, {"type": "text", "text": "the text"}]
    msgs = [{"role": "user", "content": parts}]
    assert normalize_messages(msgs)[0]["content"] == "Summarise:\nthe text"  # before: "Summarise:\n\nthe text"
    assert normalize_messages(msgs, "openai")[0]["content"] == parts  # a part is a dict there: vLLM keeps it


@pytest.mark.parametrize("source", [PARTS_ONLY, EITHER, GENERATION])
@pytest.mark.parametrize("final", ["", "  ", "ends with space "])
def test_continue_final_message_cuts_where_transformers_cuts(source, final):
    """transformers 5 renders the final content with a tag appended and cuts at the tag; an empty final message
    kept the whole rendered text (the template's end-of-turn tokens included) with the old rindex cut."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), bos_token="<s>")
    messages = [{"role": "user", "content": "Write"}, {"role": "assistant", "content": final}]
    tpl = JinjaChatTemplate(source, bos_token="<s>")
    expected = hf.apply_chat_template(_vllm_conversation(messages, tpl.content_format), chat_template=source,
                                      tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert tpl.render(messages, add_generation_prompt=False, continue_final_message=True) == expected


def test_continue_final_message_needs_a_template_that_renders_content():
    tpl = JinjaChatTemplate("{% for m in messages %}{{ m.role }}|{% endfor %}")
    with pytest.raises(ChatFormatError, match="does not render messages' content"):
        tpl.render([{"role": "user", "content": "x"}], add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("value, want", [(1.0, True), (0.0, False), ("TRUE", True), ("0", False)])
def test_lax_booleans_read_as_pydantic_reads_them(value, want):
    from quillcache.textproc.prompt import chat_render_args

    assert chat_render_args({"messages": [], "add_generation_prompt": value})["add_generation_prompt"] is want


@pytest.mark.parametrize("value", [" true", "true ", 0.5, 2.0, float("nan")])
def test_values_pydantic_refuses_are_refused(value):
    from quillcache.textproc.prompt import PromptError, chat_render_args

    with pytest.raises(PromptError, match="'add_generation_prompt' must be true or false"):
        chat_render_args({"messages": [], "add_generation_prompt": value})
