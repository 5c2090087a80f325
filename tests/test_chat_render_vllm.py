"""The chat prompt is rendered as vLLM renders it (review finding M2): text parts joined with "\\n", the message
fields vLLM keeps (tool_calls, tool_call_id, name, reasoning), and the request's tools, add_generation_prompt,
continue_final_message, documents, reasoning_effort and chat_template_kwargs passed to the template with vLLM's
precedence. Golden outputs for a Qwen2.5-like and a Llama-3.1-like template (written here, small)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from quillcache.textproc import (
    ByteTokenizer,
    ChatFormatError,
    ChatMLTemplate,
    PromptError,
    chat_prompt_tokens,
    load_chat_template,
    normalize_messages,
    prompt_token_array,
)
from quillcache.textproc.prompt import chat_render_args

QWEN_LIKE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA31_LIKE = r"""
{{- bos_token }}
{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
{%- endif %}
{{- system_message + "<|eot_id|>" }}
{%- if tools_in_user_message and tools is not none %}
    {%- set first_user_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON call.\n\n' }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + tool_call.name + '", "parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}<|eom_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"function": {"parameters": {"type": "object"}, "name": "get_time", "x-extra": 1}, "extra": True}]
# what vLLM's request model dumps for TOOLS and hands to the template: declared fields in declaration order, a
# missing description as null, the default type filled in, other keys dropped
TOOLS_AS_VLLM_PASSES = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": None, "parameters": {"type": "object"}}}]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}, {"type": "text", "text": "Quick."}]},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


def _template(tmp_path, source, **special):
    cfg = {"chat_template": source, **special}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_chat_template(tmp_path)


def _text(body, template):
    return chat_prompt_tokens(body, ByteTokenizer(), template).text


# ---- (1) text parts are joined with "\n" -------------------------------------------------------------------------
def test_multi_part_text_joined_with_newline_like_vllm():
    parts = [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]
    assert normalize_messages([{"role": "user", "content": parts}])[0]["content"] == "part one\npart two"
    assert ChatMLTemplate().render([{"role": "user", "content": parts}], add_generation_prompt=False) == \
        "<|im_start|>user\npart one\npart two<|im_end|>\n"
    # a tool message's list content is joined the same way; an empty list is ""
    assert normalize_messages([{"role": "tool", "content": parts}])[0]["content"] == "part one\npart two"
    assert normalize_messages([{"role": "user", "content": []}])[0]["content"] == ""


# ---- golden renderings ----------------------------------------------------------------------------------------
def test_qwen25_like_tool_conversation_golden(tmp_path):
    text = _text({"messages": CONVERSATION, "tools": TOOLS}, _template(tmp_path, QWEN_LIKE, eos_token="<|im_end|>"))
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n"
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": '
        '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
        '{"type": "function", "function": {"name": "get_time", "description": null, "parameters": {"type": "object"}}}'
        "\n</tools><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?\nQuick.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_llama31_like_tool_conversation_golden_with_chat_template_kwargs(tmp_path):
    tpl = _template(tmp_path, LLAMA31_LIKE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    body = {"messages": CONVERSATION, "tools": TOOLS,
            "chat_template_kwargs": {"date_string": "01 Jan 2025", "tools_in_user_message": False}}
    tools_text = "".join(json.dumps(t, ensure_ascii=False, indent=4) + "\n\n" for t in TOOLS_AS_VLLM_PASSES)
    assert _text(body, tpl) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Today Date: 01 Jan 2025\n\nYou have access to the following functions.\n\n" + tools_text +
        "Be brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?\nQuick.<|eot_id|>"
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
        "<|eom_id|>"
        '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21C"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # the template's defaults apply without kwargs: tools go into the first user message
    default = _text({"messages": CONVERSATION, "tools": TOOLS}, tpl)
    assert "Today Date: 26 Jul 2024\n\n" in default
    assert ("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON call."
            "\n\n" + tools_text + "Weather in Paris?\nQuick.<|eot_id|>") in default


def test_plain_conversation_unchanged_without_tools(tmp_path):
    """No tools, no flags, string content: the same text as before the fix (no needless hash churn)."""
    body = {"messages": [{"role": "user", "content": "hello"}]}
    assert _text(body, _template(tmp_path, QWEN_LIKE)) == \
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert _text(body, ChatMLTemplate()) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


# ---- (2) message fields -----------------------------------------------------------------------------------------
def test_message_fields_passed_as_vllm_passes_them():
    msgs = [
        {"role": "system", "content": "s", "name": "boss", "task": "plan"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "u", "name": "ann", "tool_calls": [{"ignored": True}], "reasoning": 3},
        {"role": "assistant", "content": "", "reasoning_content": "thinking",
         "tool_calls": [{"type": "function", "x": 1, "id": "c1",
                         "function": {"name": "f", "x": 2, "arguments": "{\"b\": 1, \"a\": [2]}"}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                        {"id": "c3", "type": "function", "function": {"name": "h", "arguments": {"k": "v"}}},
                        {"id": "c4", "type": "function", "function": {"name": "i"}}]},
        {"role": "assistant", "content": "x", "tool_calls": [], "reasoning": "r", "reasoning_content": "old"},
        {"role": "tool", "content": "t", "tool_call_id": "c1", "name": "f"},
        {"role": "tool", "content": "t2"},
    ]
    before = copy.deepcopy(msgs)
    out = normalize_messages(msgs)
    assert msgs == before  # the request is never modified
    assert out == [
        {"role": "system", "content": "s", "name": "boss", "task": "plan"},
        {"role": "developer", "content": "d", "tools": None},
        {"role": "user", "content": "u", "name": "ann"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "function": {"arguments": {"b": 1, "a": [2]}, "name": "f"}, "type": "function"},
                        {"id": "c2", "function": {"arguments": {}, "name": "g"}, "type": "function"},
                        {"id": "c3", "function": {"arguments": {"k": "v"}, "name": "h"}, "type": "function"},
                        {"id": "c4", "function": {"arguments": {}, "name": "i"}, "type": "function"}],
         "reasoning": "thinking", "reasoning_content": "thinking"},
        {"role": "assistant", "content": "x", "reasoning": "r", "reasoning_content": "r"},
        {"role": "tool", "content": "t", "tool_call_id": "c1", "name": "f"},
        {"role": "tool", "content": "t2"},
    ]
    # key order is what vLLM's request model gives (it shows in a template that dumps a whole tool call)
    assert list(out[3]["tool_calls"][0]) == ["id", "function", "type"]
    assert list(out[3]["tool_calls"][0]["function"]) == ["arguments", "name"]


@pytest.mark.parametrize("message, match", [
    ({"role": "assistant", "content": None, "tool_calls": {"id": "c"}}, r"messages\[0\]\.tool_calls must be a list"),
    ({"role": "assistant", "content": None, "tool_calls": ["c"]}, r"messages\[0\]\.tool_calls\[0\] must be an object"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
     r"messages\[0\]\.tool_calls\[0\]\.function must be an object with a string 'name'"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": 7, "function": {"name": "f"}}]},
     r"messages\[0\]\.tool_calls\[0\]\.id must be a string"),
    ({"role": "assistant", "content": None, "reasoning_content": ["x"]}, r"messages\[0\]\.reasoning_content must be"),
    ({"role": "tool", "content": "x", "tool_call_id": 5}, r"messages\[0\]\.tool_call_id must be a string"),
    ({"role": "user", "content": "x", "name": 5}, r"messages\[0\]\.name must be a string"),
    ({"role": "developer", "content": "x", "tools": "all"}, r"messages\[0\]\.tools must be a list of objects"),
])
def test_message_fields_with_wrong_types_refused(message, match):
    with pytest.raises(ChatFormatError, match=match):
        normalize_messages([message])
    with pytest.raises(PromptError, match=match):
        chat_prompt_tokens({"messages": [message]}, ByteTokenizer(), ChatMLTemplate())


# ---- (3) request fields and flags -------------------------------------------------------------------------------
def test_add_generation_prompt_and_continue_final_message(tmp_path):
    qwen = _template(tmp_path, QWEN_LIKE)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, here "}]
    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert _text({"messages": msgs, "add_generation_prompt": False}, qwen) == \
        head + "<|im_start|>assistant\nSure, here <|im_end|>\n"
    assert _text({"messages": msgs, "add_generation_prompt": None}, qwen).endswith("<|im_start|>assistant\n")
    # the template keeps the trailing space, so the cut keeps it (transformers' rule)
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    assert _text(body, qwen) == head + "<|im_start|>assistant\nSure, here "
    assert _text(body, ChatMLTemplate()) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nSure, here "
    # a template that trims the content: the cut ends at the trimmed content
    (tmp_path / "llama").mkdir()
    llama = _template(tmp_path / "llama", LLAMA31_LIKE)
    assert _text(body, llama).endswith("<|start_header_id|>assistant<|end_header_id|>\n\nSure, here")
    # vLLM refuses both flags at once; add_generation_prompt defaults to true
    for both in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": True}):
        with pytest.raises(PromptError, match="'continue_final_message' and 'add_generation_prompt' cannot both"):
            _text({"messages": msgs, **both}, qwen)


def test_chat_template_kwargs_precedence_follows_vllm():
    other_tools = [{"type": "function", "function": {"name": "from_kwargs"}}]
    args = chat_render_args({
        "messages": [], "tools": TOOLS, "add_generation_prompt": False, "documents": [{"title": "t", "text": "x"}],
        "reasoning_effort": "low",
        "chat_template_kwargs": {"tools": other_tools, "add_generation_prompt": True, "continue_final_message": True,
                                 "documents": [{"title": "kw"}], "reasoning_effort": "high", "custom": [1],
                                 "bos_token": "<B>", "dropped": None, "auto_one": "auto", "tokenize": True,
                                 "return_dict": True, "padding": True}})
    assert args == {"add_generation_prompt": False, "continue_final_message": False,
                    "tools": other_tools,  # the kwargs' tools replace the request's
                    "documents": [{"title": "t", "text": "x"}],  # the request's documents win when given
                    "template_kwargs": {"reasoning_effort": "low", "custom": [1], "bos_token": "<B>",
                                        "enable_thinking": True}}
    # reasoning_effort sets enable_thinking unless the kwargs name it; null / "auto" kwargs count as absent
    assert chat_render_args({"reasoning_effort": "none"})["template_kwargs"] == \
        {"reasoning_effort": "none", "enable_thinking": False}
    assert chat_render_args({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": None}}
                            )["template_kwargs"] == {"reasoning_effort": "high"}
    assert chat_render_args({"tools": TOOLS, "chat_template_kwargs": {"tools": None}})["tools"] == TOOLS_AS_VLLM_PASSES
    assert chat_render_args({"chat_template_kwargs": {"documents": [{"a": "b"}]}})["documents"] == [{"a": "b"}]
    assert chat_render_args({}) == {"add_generation_prompt": True, "continue_final_message": False, "tools": None,
                                    "documents": None, "template_kwargs": {}}


def test_template_kwargs_reach_the_template_and_may_override_special_tokens(tmp_path):
    tpl = _template(tmp_path, "{{ bos_token }}|{{ custom }}|{{ documents | tojson }}|{{ enable_thinking }}|"
                              "{{ add_generation_prompt }}|{{ messages | length }}", bos_token="<s>")
    body = {"messages": [{"role": "user", "content": "x"}], "documents": [{"title": "t", "text": "x"}],
            "chat_template_kwargs": {"custom": "c", "bos_token": "<S>", "add_generation_prompt": False,
                                     "enable_thinking": False}}
    assert _text(body, tpl) == '<S>|c|[{"title": "t", "text": "x"}]|False|True|1'


@pytest.mark.parametrize("extra, match", [
    ({"add_generation_prompt": "perhaps"}, r"'add_generation_prompt' must be true or false, got 'perhaps'"),
    ({"continue_final_message": 2}, r"'continue_final_message' must be true or false, got 2"),
    ({"tools": {"type": "function"}}, r"'tools' must be a list of objects, got dict"),
    ({"tools": []}, r"'tools' is an empty list"),
    ({"tools": ["get_weather"]}, r"'tools\[0\]' must be an object, got str"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, r"'tools\[0\]\.type' must be \"function\""),
    ({"tools": [{"type": "function"}]}, r"'tools\[0\]\.function' must be an object, got NoneType"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, r"'tools\[0\]\.function\.name' must be a string"),
    ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]},
     r"'tools\[0\]\.function\.parameters' must be a dict, got str"),
    ({"tools": [{"function": {"name": "f", "description": 1}}]}, r"'tools\[0\]\.function\.description' must be a str"),
    ({"tools": [{"function": {"name": "f", "strict": "yes"}}]}, r"'tools\[0\]\.function\.strict' must be a bool"),
    ({"documents": "doc"}, r"'documents' must be a list of objects, got str"),
    ({"documents": [{"title": 1}]}, r"'documents\[0\]' must map strings to strings"),
    ({"reasoning_effort": 2}, r"'reasoning_effort' must be a string, got int"),
    ({"chat_template_kwargs": ["a"]}, r"'chat_template_kwargs' must be an object, got list"),
    ({"chat_template_kwargs": {"tools": "all"}}, r"'chat_template_kwargs\.tools' must be a list of objects"),
    ({"chat_template_kwargs": {"messages": []}}, r"'chat_template_kwargs\.messages' cannot be given"),
    ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, r"'chat_template_kwargs\.chat_template' cannot be"),
    ({"chat_template": "{{ 1 }}"}, r"'chat_template' per request is not supported"),
])
def test_request_fields_with_wrong_types_refused(extra, match):
    body = {"messages": [{"role": "user", "content": "x"}], **extra}
    with pytest.raises(PromptError, match=match):
        chat_prompt_tokens(body, ByteTokenizer(), ChatMLTemplate())
    with pytest.raises(PromptError, match=match):
        prompt_token_array("chat", body, ByteTokenizer(), ChatMLTemplate())


def test_template_errors_from_request_values_are_prompt_errors(tmp_path):
    tpl = _template(tmp_path, "{{ (custom or 0) + 1 }}{{ messages[0].content }}")  # renders without the kwarg
    with pytest.raises(PromptError, match="chat template failed to render"):
        _text({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"custom": "a"}}, tpl)


def test_token_array_matches_tokens_with_tools_and_body_not_modified(tmp_path):
    tpl = _template(tmp_path, QWEN_LIKE)
    body = {"messages": CONVERSATION, "tools": TOOLS, "chat_template_kwargs": {"x": 1}}
    before = copy.deepcopy(body)
    ids = chat_prompt_tokens(body, ByteTokenizer(), tpl).token_ids
    arr = prompt_token_array("chat", body, ByteTokenizer(), tpl)
    assert arr.dtype == np.uint32 and arr.tolist() == list(ids)
    assert body == before


# ---- against transformers, when it is installed -----------------------------------------------------------------
def _hf_tokenizer(special):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), **special)


@pytest.mark.parametrize("flags", [{}, {"add_generation_prompt": False, "continue_final_message": True}])
@pytest.mark.parametrize("source, special", [(QWEN_LIKE, {"eos_token": "<|im_end|>"}),
                                             (LLAMA31_LIKE, {"bos_token": "<|begin_of_text|>"})])
def test_same_text_as_transformers_apply_chat_template(tmp_path, source, special, flags):
    hf = _hf_tokenizer(special)
    # the conversation exactly as vLLM's parse_chat_messages hands it to apply_chat_template
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?\nQuick."},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "function": {"arguments": {"city": "Paris"}, "name": "get_weather"},
                         "type": "function"}]},
        {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is sunny "},
    ]
    kwargs = {"date_string": "01 Jan 2025"}
    expected = hf.apply_chat_template(conversation, tools=TOOLS_AS_VLLM_PASSES, chat_template=source,
                                      add_generation_prompt=flags.get("add_generation_prompt", True),
                                      continue_final_message=flags.get("continue_final_message", False),
                                      tokenize=False, **kwargs)
    messages = [*CONVERSATION, {"role": "assistant", "content": "It is sunny "}]
    body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": kwargs, **flags}
    assert _text(body, _template(tmp_path, source, **special)) == expected


def test_the_template_environment_is_the_one_transformers_renders_in():
    """Loop controls, ``strftime_now`` (Llama 3.2/3.3 date their system prompt) and ``tojson``'s keyword
    arguments: templates that use them rendered as a 400 before."""
    import datetime

    from quillcache.textproc.chat import JinjaChatTemplate

    src = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
           "|{{ strftime_now('%Y') }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=True, separators=(',', ':')) }}")
    tpl = JinjaChatTemplate(src)
    out = tpl.render([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}])
    assert out == f"one|{datetime.datetime.now().year}|" + '{"a":2,"b":1}'


@pytest.mark.parametrize("value, want", [(1, True), (0, False), ("true", True), ("False", False), ("yes", True),
                                         ("off", False), (True, True)])
def test_boolean_flags_take_what_vllm_reads_as_booleans(value, want):
    """vLLM's request model reads 1/0 and "true"/"false" as booleans; a 400 for them was a regression (re-review
    of 2026-11-29, /tmp/s35/rr_data L4)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": value}
    assert chat_render_args(body)["add_generation_prompt"] is want


@pytest.mark.parametrize("value", [2, -1, "maybe", 1.5, [], {}])
def test_other_flag_values_are_refused_naming_the_field(value):
    from quillcache.textproc import PromptError

    with pytest.raises(PromptError, match="'add_generation_prompt' must be true or false"):
        chat_render_args({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": value})
