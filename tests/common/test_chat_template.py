"""common/chat_template.py renders exactly what transformers' `apply_chat_template` renders, and
the router's tokens are transformers' tokens: SmolLM2's own template, and templates in the
formats of other families (ChatML with Hermes-style tools, Llama 3 headers with JSON tools,
Mistral [INST] with alternation checks, Gemma turns, Phi tags) that use what real templates use:
`{% break %}`, `tojson` (indent, non-ASCII, <>&'), `namespace`, `raise_exception`, `tools`,
`documents`, `{% generation %}`, named templates, special-token variables, `content: None`,
reasoning fields, `add_generation_prompt` and `continue_final_message`."""

from __future__ import annotations

import pytest

from common.chat_template import ChatTemplate, ChatTemplateError
from common.tokenizer import Tokenizer

CHATML_TOOLS = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'assistant' and message.tool_calls is defined %}<|im_start|>assistant
{% if message.content is defined %}{{ message.content }}{% endif %}
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{% generation %}{{ message.content }}{% endgeneration %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A backslash that ends a line below is Python's line continuation inside the string: the template
# text runs on unbroken (no newline), as in the model's own template.
LLAMA3_TOOLS = """{{- bos_token }}
{%- set date_string = date_string | default("26 Jul 2024") %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}{{- "You have these functions:\\n\\n" }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if message.role in ['ipython', 'tool'] %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
{%- if message.content is mapping or message.content is iterable and message.content is not \
string %}
{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}{{- "<|eot_id|>" }}
{%- elif 'tool_calls' in message %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}\
{{- "}<|eot_id|>" }}
{%- else %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | \
trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
{%- endif %}"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}\
{%- set system_message = messages[0]['content'] %}
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{%- set ns = namespace(index=0) %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (ns.index % 2 == 0) %}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}{%- set ns.index = ns.index + 1 %}
{%- if message['role'] == 'user' %}
{%- if loop.last and system_message is defined %}\
{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}
{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}
{%- else %}\
{{- raise_exception('Only user and assistant roles are supported, with the exception of an initial \
optional system message!') }}
{%- endif %}
{%- endfor %}"""

GEMMA = """{{ bos_token }}{% set ns = namespace(first=true, seen=0) %}
{% for message in messages %}{% if ns.seen >= 6 %}{% break %}{% endif %}\
{% set ns.seen = ns.seen + 1 %}
{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}
{% if role == 'system' %}{% set ns.first = false %}{% continue %}{% endif %}
{{ '<start_of_turn>' + role + '\n' + (message['content'] | trim) + '<end_of_turn>\n' }}
{% endfor %}{% if documents %}{% for d in documents %}\
<doc title={{ d.title | tojson }}>{{ d.text }}</doc>
{% endfor %}{% endif %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"""

PHI = """{% for message in messages %}\
{% if message['role'] == 'assistant' and message.reasoning_content is defined %}\
<|assistant|><think>{{ message.reasoning_content }}</think>{{ message['content'] }}\
<|end|>{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}{% endfor %}\
{% if add_generation_prompt %}<|assistant|>{% else %}{{ eos_token }}{% endif %}\
{{ '' if unk_token is undefined else '' }}"""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city, e.g. <Zürich> & 'Genève'",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"enum": ["C", "F"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
]
TOOL_CHAT = [
    {"role": "system", "content": "You are helpful. Café ☕ <b>&</b>"},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "<sunny>"}'},
    {"role": "assistant", "content": "21 °C and sunny."},
    {"role": "user", "content": "And in Genève?"},
]
PLAIN_CHAT = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "Name three colours & shapes <please>."}]


@pytest.fixture(scope="module")
def hf(smollm2_folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_folder))


@pytest.fixture(scope="module")
def ours(smollm2_folder):
    return Tokenizer(smollm2_folder)


CASES = [
    ("smollm2", None, PLAIN_CHAT, {}),
    ("smollm2-system", None, [{"role": "system", "content": "Be brief."}, *PLAIN_CHAT], {}),
    ("chatml-tools", CHATML_TOOLS, TOOL_CHAT, {"tools": TOOLS}),
    ("chatml-no-tools", CHATML_TOOLS, PLAIN_CHAT, {}),
    ("llama3-tools", LLAMA3_TOOLS, TOOL_CHAT, {"tools": TOOLS}),
    ("llama3-date", LLAMA3_TOOLS, PLAIN_CHAT, {"date_string": "04 Dec 2026"}),
    ("mistral", MISTRAL, [{"role": "system", "content": "Sys."}, *PLAIN_CHAT], {}),
    ("gemma-break-docs", GEMMA, [*PLAIN_CHAT, *PLAIN_CHAT, *PLAIN_CHAT],
     {"documents": [{"title": "A <1> & 'b'", "text": "Zürich"}]}),
    ("phi-reasoning", PHI, [{"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "4", "thinking": "two and two"},
                            {"role": "user", "content": "3+3?"}], {}),
]


@pytest.mark.parametrize("name,template,messages,kwargs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "nogen"])
def test_renders_and_tokenizes_like_transformers(hf, ours, name, template, messages, kwargs, gen):
    tpl = ours.template if template is None else ChatTemplate(template, ours.special_tokens)
    want = hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                  add_generation_prompt=gen, **kwargs)
    got = tpl.render(messages, add_generation_prompt=gen, **kwargs)
    assert got == want
    want_ids = hf.apply_chat_template(messages, chat_template=template, tokenize=True,
                                      add_generation_prompt=gen, return_dict=False, **kwargs)
    assert ours.encode(got, add_special_tokens=False) == list(want_ids)


def test_continue_final_message_like_transformers(hf, ours):
    chat = [*PLAIN_CHAT, {"role": "assistant", "content": "Red, green and "}]
    for template in (None, CHATML_TOOLS, PHI):
        tpl = ours.template if template is None else ChatTemplate(template, ours.special_tokens)
        want = hf.apply_chat_template(chat, chat_template=template, tokenize=False,
                                      continue_final_message=True)
        assert tpl.render(chat, continue_final_message=True) == want


def test_named_templates_pick_tool_use_when_tools_are_given(ours):
    tpl = ChatTemplate({"default": "plain:{{ messages[0].content }}",
                        "tool_use": "tools:{{ tools | length }}"}, ours.special_tokens)
    assert tpl.render(PLAIN_CHAT) == "plain:Hi there!"
    assert tpl.render(PLAIN_CHAT, tools=TOOLS) == "tools:2"


def test_template_refusals_are_chat_template_errors(ours):
    mistral = ChatTemplate(MISTRAL, ours.special_tokens)
    with pytest.raises(ChatTemplateError, match="alternate"):
        mistral.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ns.__class__ }}{% set ns = namespace(_x=1) %}").render(PLAIN_CHAT)
    with pytest.raises(ChatTemplateError):  # the sandbox: no attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(PLAIN_CHAT)
    with pytest.raises(ChatTemplateError, match="exclude"):
        mistral.render(PLAIN_CHAT, add_generation_prompt=True, continue_final_message=True)
