"""Chat templates (Jinja) of the tiny test models, written in the style of Qwen 2.5 and Qwen3.

Both are ChatML with Qwen's tool-calling conventions:

- The system turn comes first: the caller's system message, or ``DEFAULT_SYSTEM_PROMPT``. When
  ``tools`` are passed, it lists them inside ``<tools></tools>``, one JSON object per line, and
  says how to call them: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``.
- An assistant turn is its content, then (after a ``\\n`` when the content is not empty) each
  tool call as ``<tool_call>\\n{"name": <name>, "arguments": <arguments>}\\n</tool_call>``,
  calls separated by ``\\n``. Arguments given as a mapping are written with ``tojson``
  (transformers' filter: ``json.dumps`` with default separators, ``ensure_ascii=False``); a
  string is written as is, never JSON-quoted a second time.
- Consecutive ``tool`` messages share one ``<|im_start|>user`` turn, each result inside
  ``<tool_response>\\n...\\n</tool_response>``.
- Content is a string or a list of ``{"type": "text", "text": ...}`` parts (their texts joined).
- ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``.

Contract (tested): with ``QWEN25``, ``render(messages + [reply])`` starts with
``render(messages, add_generation_prompt=True) + <reply as the model writes it> + "<|im_end|>"``,
so that a gateway can append the next turn's prompt to the tokens it already holds.

``QWEN3`` differs only in reasoning: an assistant message's ``reasoning_content`` (or an inline
``<think>...</think>`` prefix of its content) is kept as ``<think>\\n{reasoning}\\n</think>\\n\\n``
only for assistant messages after the last user query and dropped from earlier ones, exactly the
history rewrite that makes multi-turn samples drift; ``enable_thinking=False`` puts an empty
think block in the generation prompt.
"""

from __future__ import annotations

from typing import Final, Literal

TemplateName = Literal["qwen25", "qwen3"]

DEFAULT_SYSTEM_PROMPT: Final = "You are a helpful assistant."

# Shared pieces. Every tag uses whitespace control ("-") so that the layout of this source never
# leaks into the rendered text; transformers also sets trim_blocks / lstrip_blocks.
_CONTENT_MACRO: Final = """\
{%- macro render_content(content) -%}
    {%- if content is undefined or content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported, got: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('Message content must be a string or a list of text parts') -}}
    {%- endif -%}
{%- endmacro -%}
"""

_SYSTEM_TURN: Final = (
    """\
{%- if messages and messages[0].role == 'system' %}
    {%- set system_text = render_content(messages[0].content) %}
    {%- set first_index = 1 %}
{%- else %}
    {%- set system_text = '"""
    + DEFAULT_SYSTEM_PROMPT
    + """' %}
    {%- set first_index = 0 %}
{%- endif %}
{{- '<|im_start|>system\\n' + system_text }}
{%- if tools %}
    {{- '\\n\\n# Tools\\n\\nYou may call one or more of the functions below to answer the user.'
        + '\\n\\nTheir signatures, one JSON object per line, are inside <tools></tools>:'
        + '\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, answer with its name and arguments as a JSON object'
        + ' inside <tool_call></tool_call> tags, one block per call:\\n<tool_call>\\n'
        + '{"name": <function-name>, "arguments": <arguments-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
"""
)

_TOOL_CALLS: Final = """\
{%- if message.tool_calls is defined and message.tool_calls %}
    {%- for call in message.tool_calls %}
        {%- if call.function is defined %}
            {%- set call = call.function %}
        {%- endif %}
        {%- if not loop.first or content %}
            {{- '\\n' }}
        {%- endif %}
        {{- '<tool_call>\\n{"name": ' + (call.name | tojson) + ', "arguments": ' }}
        {%- if call.arguments is undefined or call.arguments is none %}
            {{- '{}' }}
        {%- elif call.arguments is string %}
            {{- call.arguments }}
        {%- else %}
            {{- call.arguments | tojson }}
        {%- endif %}
        {{- '}\\n</tool_call>' }}
    {%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
"""

_TOOL_RESULT: Final = """\
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
    {{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
"""

_OTHER_TURN: Final = """\
{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' }}
"""

# The system turn left out (the caller's system message is skipped, no tool list is rendered):
# for a model trained on one environment, whose system prompt and tools are the same in every
# row (examples/gridsim_rl: about 750 of a prompt's 975 tokens). Tool calls and results are
# written exactly as QWEN25 writes them, so the same parser reads the replies.
_NO_SYSTEM_TURN: Final = """\
{%- set first_index = 1 if messages and messages[0].role == 'system' else 0 %}
"""

_QWEN25_TURNS: Final = (
    """\
{%- for message in messages %}
    {%- if loop.index0 < first_index %}
    {%- elif message.role == 'assistant' %}
        {%- set content = render_content(message.content) %}
        {{- '<|im_start|>assistant\\n' + content }}
"""
    + _TOOL_CALLS
    + """\
    {%- elif message.role == 'tool' %}
"""
    + _TOOL_RESULT
    + """\
    {%- else %}
"""
    + _OTHER_TURN
    + """\
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

QWEN25: Final = _CONTENT_MACRO + _SYSTEM_TURN + _QWEN25_TURNS
QWEN25_COMPACT: Final = _CONTENT_MACRO + _NO_SYSTEM_TURN + _QWEN25_TURNS

QWEN3: Final = (
    _CONTENT_MACRO
    + _SYSTEM_TURN
    + """\
{#- The last user query: tool results do not count, nor user turns that only wrap one. -#}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set text = render_content(message.content) %}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
            {%- set ns.last_query = loop.index0 %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if loop.index0 < first_index %}
    {%- elif message.role == 'assistant' %}
        {%- set content = render_content(message.content) %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1] %}
            {%- set reasoning = reasoning.lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {#- Reasoning of the current query is kept; that of earlier queries is dropped. -#}
            {%- set content = content.lstrip('\\n') %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') }}
            {{- '\\n</think>\\n\\n' }}
            {{- content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
"""
    + _TOOL_CALLS
    + """\
    {%- elif message.role == 'tool' %}
"""
    + _TOOL_RESULT
    + """\
    {%- else %}
"""
    + _OTHER_TURN
    + """\
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
)

CHAT_TEMPLATES: Final[dict[str, str]] = {"qwen25": QWEN25, "qwen3": QWEN3}
