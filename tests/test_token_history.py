"""Token history (corral.gateway.history): a session's next prompt is the tokens it holds plus
only what is new, so a template that rewrites history (Qwen3 drops think blocks) no longer splits
an episode into several samples.

Three layers: the pure parts (which held conversation a request continues, and the suffix that
continues it, checked with both tiny tokenizers and deliberately unsound templates); the gateway
end to end with the scripted test engine (tests/scripted_engine.py) and the Qwen3-style tokenizer,
thinking off, driven by the real ``openai`` and ``anthropic`` SDKs, where every engine input is
checked token for token; and gridsim episodes played by the episode player against a real env
server and gateway, under both history modes (the samples-per-rollout figure). The scripted
engine plays the model there too: the tiny models write no tool call in gridsim.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from corral.engines.sglang import SGLangClient
from corral.engines.tiny_model import TOOLS
from corral.gateway.app import build_gateway_app
from corral.gateway.history import (
    Continuation,
    ConversationIndex,
    Fallback,
    HeldConversation,
    HeldMatch,
    HeldPoint,
    TokenHistory,
    TurnConversation,
    kwargs_key,
    message_key,
)
from corral.gateway.pipeline import TurnPipeline
from corral.gateway.rendering import ChatRenderer
from corral.gateway.settings import GatewaySettings
from corral.gateway.turns import Message, Tool, ToolCall
from tests.conftest import ROOT
from tests.gateway_stack import ADMIN, AUTH, RecordingEngine, Stack, check_exact_sample
from tests.scripted_engine import ScriptedEngine
from tests.servers import serve

THINKING_OFF = {"enable_thinking": False}
# What corral's Qwen3-style template writes after the generation prompt with thinking off.
EMPTY_THINK = "<think>\n\n</think>\n\n"
CONTEXT = 32_768
TOOL = Tool("get_weather", "Get the current weather in a city.")


# -- which held conversation a request continues -----------------------------------------------


def _user(text: str) -> Message:
    return Message("user", text)


def _reply(*calls: tuple[str, str], content: str = "", call_id: str = "c") -> Message:
    return Message(
        "assistant",
        content,
        tool_calls=tuple(ToolCall(f"{call_id}{i}", n, a) for i, (n, a) in enumerate(calls)),
    )


def _result(call_id: str, text: str) -> Message:
    return Message("tool", text, tool_call_id=call_id)


def _record(
    index: ConversationIndex,
    trajectory: int,
    messages: Sequence[Message],
    *,
    appended: bool = False,
    prompt_length: int = 10,
    output_length: int = 5,
) -> None:
    """A turn recorded on ``trajectory``: ``messages`` are its request, then its reply."""
    turn = TurnConversation(
        keys=tuple(message_key(m) for m in messages),
        tools=(TOOL,),
        kwargs=kwargs_key({}),
        label=None,
        prompt_length=prompt_length,
        output_length=output_length,
        finish="stop",
    )
    index.record(trajectory, appended, turn)


def _find(
    index: ConversationIndex,
    messages: Sequence[Message],
    *,
    tools: tuple[Tool, ...] = (TOOL,),
    kwargs: dict[str, Any] | None = None,
    label: str | None = None,
) -> HeldMatch | None:
    return index.find([message_key(m) for m in messages], tools, kwargs_key(kwargs or {}), label)


QUESTION = _user("What is the weather in Paris?")
CALL = ("get_weather", '{"city": "Paris", "unit": "c"}')
REPLY = _reply(CALL)
RESULT = _result("c0", '{"weather": "sunny"}')


def test_a_request_that_resends_the_held_conversation_continues_it() -> None:
    index = ConversationIndex()
    _record(index, 3, [QUESTION, REPLY])
    # The client resends the reply with its own call ids, the arguments re-serialised in another
    # key order and spacing, and reasoning it kept: what the model's tokens carry is the same.
    resent = Message(
        "assistant",
        "",
        tool_calls=(ToolCall("call_other", "get_weather", '{"unit":"c","city":"Paris"}'),),
        reasoning="a thought",
    )
    match = _find(index, [QUESTION, resent, RESULT])
    assert match is not None and not match.repeat
    assert (match.held.trajectory, match.length) == (3, 2)


@pytest.mark.parametrize(
    ("what", "messages", "tools", "kwargs", "label"),
    [
        ("question", [_user("What is the weather in Rome?"), REPLY, RESULT], (TOOL,), {}, None),
        ("reply text", [QUESTION, _reply(CALL, content="Let me look."), RESULT], (TOOL,), {}, None),
        ("arguments", [QUESTION, _reply(("get_weather", "{}")), RESULT], (TOOL,), {}, None),
        ("tool name", [QUESTION, _reply(("add", CALL[1])), RESULT], (TOOL,), {}, None),
        ("tools", [QUESTION, REPLY, RESULT], (TOOL, Tool("add")), {}, None),
        ("kwargs", [QUESTION, REPLY, RESULT], (TOOL,), THINKING_OFF, None),
        ("label", [QUESTION, REPLY, RESULT], (TOOL,), {}, "side"),
        ("reply dropped", [QUESTION, _user("And now?")], (TOOL,), {}, None),
    ],
)
def test_a_request_that_changes_what_was_held_continues_nothing(
    what: str,
    messages: list[Message],
    tools: tuple[Tool, ...],
    kwargs: dict[str, Any],
    label: str | None,
) -> None:
    index = ConversationIndex()
    _record(index, 0, [QUESTION, REPLY])
    assert _find(index, [QUESTION, REPLY, RESULT]) is not None  # the unchanged request does
    assert _find(index, messages, tools=tools, kwargs=kwargs, label=label) is None, what


FOLLOW_UP = _user("And in Oslo?")
OSLO = _reply(("get_weather", '{"city": "Oslo"}'), call_id="d")
# Two turns of one trajectory: the question, its call and result, then a follow-up and its call.
LONG = [QUESTION, REPLY, RESULT, FOLLOW_UP, OSLO]


def test_the_longest_held_conversation_wins() -> None:
    index = ConversationIndex()
    _record(index, 0, LONG, prompt_length=40)
    _record(index, 1, [QUESTION, REPLY])  # more recent, shorter
    longest = _find(index, [*LONG, _result("d0", "cold")])
    assert longest is not None and (longest.held.trajectory, longest.length) == (0, 5)
    shorter = _find(index, [QUESTION, REPLY, _result("c0", "rain")])
    assert shorter is not None and (shorter.held.trajectory, shorter.length) == (1, 2)


def test_a_request_of_any_turn_again_is_a_repeat_and_any_reply_can_be_continued() -> None:
    index = ConversationIndex()
    _record(index, 0, LONG[:2], prompt_length=10, output_length=5)
    _record(index, 0, LONG, appended=True, prompt_length=40, output_length=6)
    # The previous request again, without the reply it got: a regeneration of that turn.
    repeat = _find(index, LONG[:-1])
    assert repeat is not None and repeat.repeat
    assert (repeat.held.trajectory, repeat.length, repeat.point.tokens) == (0, 4, 40)
    # The first turn's request again gets the first turn's prompt.
    first = _find(index, LONG[:1])
    assert first is not None and first.repeat and first.point.tokens == 10
    # A new message after the first turn's reply continues from that reply's end (a rollback).
    rollback = _find(index, [*LONG[:2], _result("c0", "rain")])
    assert rollback is not None and not rollback.repeat
    assert (rollback.length, rollback.point.tokens) == (2, 15)
    end = _find(index, [*LONG, _result("d0", "cold")])
    assert end is not None and (end.length, end.point.tokens) == (5, 46)


@pytest.mark.parametrize("recent", ["longer", "shorter"])
def test_a_repeat_wins_over_a_shorter_conversation_whatever_the_order(recent: str) -> None:
    index = ConversationIndex()
    longer, shorter = (0, LONG), (1, [QUESTION, REPLY])
    for trajectory, messages in (shorter, longer) if recent == "longer" else (longer, shorter):
        _record(index, trajectory, messages, prompt_length=40)
    match = _find(index, LONG[:-1])
    # The repeat resends 4 of trajectory 0's messages; continuing trajectory 1 would use 2.
    assert match is not None and match.repeat and match.held.trajectory == 0, match


def test_the_index_keeps_only_the_latest_conversations() -> None:
    index = ConversationIndex(keep=2)
    questions = [_user(f"question {i}") for i in range(3)]
    for i, q in enumerate(questions):
        _record(index, i, [q, REPLY])
    _record(index, 1, [questions[1], REPLY, RESULT, _user("more"), REPLY], appended=True)
    assert len(index) == 2
    assert _find(index, [questions[0], REPLY, RESULT]) is None  # the oldest was forgotten
    assert _find(index, [questions[2], REPLY, RESULT]) is not None
    kept = _find(index, [questions[1], REPLY, RESULT, _user("more"), REPLY, RESULT])
    assert kept is not None and kept.length == 5  # replaced, not duplicated
    index.clear()
    assert len(index) == 0 and _find(index, [questions[2], REPLY, RESULT]) is None


# -- the suffix that continues held tokens ------------------------------------------------------


@pytest.fixture(scope="module")
def qwen25(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def qwen3(tiny_think_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_think_model_dir))


def _call_text(*calls: tuple[str, dict[str, Any]]) -> str:
    """Tool calls as the Qwen templates render them (and as the model writes them)."""
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
    )


def _model_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as the model would have sampled it, then ``<|im_end|>``."""
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    assert tokenizer.decode(ids) == text
    return [*ids, int(tokenizer.convert_tokens_to_ids("<|im_end|>"))]


@dataclass(frozen=True)
class Held:
    """A first turn as the gateway would have served it: the request and reply (template form),
    and the trajectory's tokens (the rendered prompt, then the model's tokens)."""

    messages: list[dict[str, Any]]
    tokens: list[int]


def _first_turn(
    renderer: ChatRenderer,
    question: str,
    model_text: str,
    reply: dict[str, Any],
    kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None = TOOLS,
) -> Held:
    """``question`` asked, answered with the model's ``model_text`` (``reply`` as the client
    sends it back)."""
    asked = [{"role": "user", "content": question}]
    prompt = renderer.encode(renderer.render_text(asked, tools, kwargs))
    return Held([*asked, reply], prompt + _model_ids(renderer.tokenizer, model_text))


def _continue(
    history: TokenHistory,
    held: Held,
    new: list[dict[str, Any]],
    kwargs: dict[str, Any],
    tools: list[dict[str, Any]] | None = TOOLS,
) -> Continuation | Fallback:
    conversation = HeldConversation(0, (), (), kwargs_key(kwargs), None, ())
    point = HeldPoint(len(held.messages), len(held.tokens), reply=True, finish="stop")
    return history.continuation(
        HeldMatch(conversation, point),
        held.tokens,
        [*held.messages, *new],
        tools,
        kwargs,
    )


PARIS = ("get_weather", {"city": "Paris"})
PARIS_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
PARIS_REPLY = {"role": "assistant", "content": "", "tool_calls": [PARIS_CALL]}
PARIS_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"weather": "sunny"}'}
THOUGHT = "<think>\nA greeting.\n</think>\n\n"
HELLO = {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."}
AGAIN = {"role": "user", "content": "Again."}


def test_an_append_only_template_continues_with_the_new_messages(qwen25: Any) -> None:
    renderer = ChatRenderer(qwen25)
    held = _first_turn(
        renderer, "What is the weather in Paris?", _call_text(PARIS), PARIS_REPLY, {}
    )
    c = _continue(TokenHistory(renderer), held, [PARIS_RESULT], {})
    assert isinstance(c, Continuation), c
    assert c.boundary == "isolated" and c.held == len(held.tokens)
    # The model sampled <|im_end|> itself: the glue is only the template's newline after it.
    assert c.suffix_text.startswith("\n<|im_start|>user\n<tool_response>\n"), c.suffix_text
    assert c.suffix_ids == renderer.encode(c.suffix_text)
    # On an append-only template the held tokens plus the suffix are the full rendering.
    full = renderer.render_text([*held.messages, PARIS_RESULT], TOOLS, {})
    assert held.tokens + c.suffix_ids == renderer.encode(full)


@pytest.mark.parametrize(
    ("thinking", "question", "model_text", "reply", "new"),
    [
        # Thinking off: the held prompt ends with an empty think block that history drops.
        (False, "What is the weather in Paris?", _call_text(PARIS), PARIS_REPLY, [PARIS_RESULT]),
        # Thinking on: the reply's think block is dropped once a new question follows it.
        (True, "Say hello.", THOUGHT + "Hello!", HELLO, [AGAIN]),
    ],
    ids=["thinking-off", "thinking-on"],
)
def test_qwen3_continues_with_the_new_messages_rendered_on_their_own(
    qwen3: Any,
    thinking: bool,
    question: str,
    model_text: str,
    reply: dict[str, Any],
    new: list[dict[str, Any]],
) -> None:
    kwargs = {"enable_thinking": thinking}
    renderer = ChatRenderer(qwen3)
    held = _first_turn(renderer, question, model_text, reply, kwargs)
    c = _continue(TokenHistory(renderer), held, new, kwargs)
    assert isinstance(c, Continuation), c
    assert c.boundary == "isolated" and c.held == len(held.tokens)
    assert c.suffix_text.startswith("\n<|im_start|>user\n"), c.suffix_text
    assert c.suffix_ids == renderer.encode(c.suffix_text)
    assert c.suffix_text.endswith(EMPTY_THINK) is not thinking  # the generation prompt
    full = renderer.render_text([*held.messages, *new], TOOLS, kwargs)
    assert full.endswith(c.suffix_text[1:])  # the new messages exactly as the template writes them
    # The template rewrote the held turn (its think block is gone): rendered in full, this
    # turn would not extend the held tokens.
    held_text = qwen3.decode(held.tokens)
    assert held_text.count("<think>") == 1 and full.count("<think>") == int(not thinking)
    assert renderer.encode(full)[: len(held.tokens)] != held.tokens


def test_qwen3_keeps_the_reasoning_of_the_current_question(qwen3: Any) -> None:
    """Thinking on, mid tool loop: the template keeps the reasoning of the question still being
    answered, so the held tokens plus the suffix are the full rendering."""
    renderer = ChatRenderer(qwen3)
    reply = {**PARIS_REPLY, "reasoning_content": "A greeting."}  # the thought of THOUGHT
    model_text = THOUGHT + _call_text(PARIS)
    held = _first_turn(renderer, "What is the weather in Paris?", model_text, reply, {})
    c = _continue(TokenHistory(renderer), held, [PARIS_RESULT], {})
    assert isinstance(c, Continuation) and c.boundary == "isolated", c
    full = renderer.render_text([*held.messages, PARIS_RESULT], TOOLS, {})
    assert held.tokens + c.suffix_ids == renderer.encode(full)


# A tool result names the call it answers, read from the assistant message before it: after a
# probe (no such call) it renders differently, after the held conversation as it will in full.
CALL_NAMED = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- set asked = messages[loop.index0 - 1].tool_calls if loop.index0 > 0 else none %}"
    "{{- '<|im_start|>tool ' ~ (asked[0].function.name if asked else 'unknown') ~ '\\n' }}"
    "{%- else %}{{- '<|im_start|>' ~ m.role ~ '\\n' }}{%- endif %}"
    "{{- m.content ~ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_new_messages_that_depend_on_the_history_continue_at_the_prefix(
    tiny_model_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.chat_template = CALL_NAMED
    renderer = ChatRenderer(tokenizer)
    reply = {**PARIS_REPLY, "content": "Looking."}
    held = _first_turn(renderer, "Weather in Paris?", "Looking.", reply, {}, tools=None)
    c = _continue(TokenHistory(renderer), held, [PARIS_RESULT], {}, tools=None)
    assert isinstance(c, Continuation) and c.boundary == "prefix", c
    assert c.suffix_text.startswith("\n<|im_start|>tool get_weather\n"), c.suffix_text
    full = renderer.render_text([*held.messages, PARIS_RESULT], None, {})
    assert held.tokens + c.suffix_ids == renderer.encode(full)


# Every message is tagged with how many messages the conversation has: the held conversation
# renders differently once new messages follow, and so do the new messages after any probe.
NUMBERED = (
    "{%- for m in messages %}<|im_start|>{{ m.role }} {{ messages | length }}\n"
    "{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# Refuses any conversation that does not open with a system message (the probe reply has none).
SYSTEM_FIRST = (
    "{%- if messages[0].role != 'system' %}{{ raise_exception('system first') }}{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.mark.parametrize(
    ("template", "reason"),
    [(NUMBERED, "no sound boundary"), (SYSTEM_FIRST, "does not render a probe reply")],
)
def test_an_unsound_template_falls_back_and_says_why(
    tiny_model_dir: Path, template: str, reason: str
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tokenizer.chat_template = template
    renderer = ChatRenderer(tokenizer)
    asked = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
    prompt = renderer.encode(renderer.render_text(asked, None))
    reply = {"role": "assistant", "content": "Hello!"}
    held = Held([*asked, reply], prompt + _model_ids(tokenizer, "Hello!"))
    outcome = _continue(TokenHistory(renderer), held, [AGAIN], {}, tools=None)
    assert isinstance(outcome, Fallback), outcome
    assert reason in outcome.reason


def test_a_repeat_is_the_held_prompt_again(qwen3: Any) -> None:
    conversation = HeldConversation(2, (), (), kwargs_key({}), None, ())
    c = TokenHistory(ChatRenderer(qwen3)).continuation(
        HeldMatch(conversation, HeldPoint(1, 17, reply=False)), list(range(30)), [], None, {}
    )
    assert c == Continuation(2, 17, "", [], "repeat")


def test_the_glue_keeps_the_end_token_the_model_did_not_sample(qwen3: Any) -> None:
    history = TokenHistory(ChatRenderer(qwen3))
    close = history.close({})
    assert close == "<|im_end|>\n"
    end = int(qwen3.convert_tokens_to_ids("<|im_end|>"))
    assert history.glue(close, end, "stop") == "\n"
    assert history.glue(close, 5, "stop") == close  # stopped on a stop string
    assert history.glue(close, end, "length") == close  # cut short: the template's close follows


# -- the gateway end to end, scripted engine, Qwen3-style tokenizer, thinking off --------------


@dataclass
class ScriptedHistoryStack(Stack):
    """A gateway in front of the scripted test engine, whose engine client records every call
    (so that ``check_exact_sample`` applies); ``script`` is the scripted engine itself."""

    script: ScriptedEngine

    def play(self, text: str) -> None:
        """The model's next reply: ``text``, then ``<|im_end|>``."""
        self.script.push(_model_ids(self.tokenizer, text))


@contextmanager
def scripted_stack(model_dir: Path, **overrides: Any) -> Iterator[ScriptedHistoryStack]:
    """``overrides``: GatewaySettings fields (default: the Qwen3 reasoning parser, thinking off)."""
    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))
    engine = ScriptedEngine(
        eos_token_ids=[int(tokenizer.convert_tokens_to_ids("<|im_end|>"))],
        decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=False)),
    )
    fields: dict[str, Any] = {
        "reasoning_parser": "qwen3",
        "chat_template_kwargs": THINKING_OFF,
        **overrides,
    }
    settings = GatewaySettings(
        model_name="tiny",
        max_context_tokens=CONTEXT,
        admin_token=ADMIN,
        engine_timeout_s=60,
        **fields,
    )
    with serve(engine.app) as engine_url:
        client = RecordingEngine(SGLangClient(engine_url, timeout=60, retries=0))
        pipeline = TurnPipeline(settings, client, tokenizer)
        with serve(build_gateway_app(settings, client, pipeline)) as url:
            yield ScriptedHistoryStack(
                url=url, engine=client, engine_url=engine_url, tokenizer=tokenizer, script=engine
            )


@pytest.fixture()
def think(tiny_think_model_dir: Path) -> Iterator[ScriptedHistoryStack]:
    with scripted_stack(tiny_think_model_dir) as s:
        yield s


def _weather(city: str) -> str:
    return json.dumps({"city": city, "weather": "sunny", "temp_c": 21})


# The tool loop: what the model says each turn; a turn of calls gets their results back, a turn
# of text the next user message.
LOOP: list[tuple[str, str | None]] = [
    (_call_text(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})), None),
    ("It is sunny in Paris and in Tokyo.", "And in Oslo and Lima?"),
    (_call_text(("get_weather", {"city": "Oslo"})), None),
    (_call_text(("get_weather", {"city": "Lima"})), None),
    ("Sunny everywhere.", None),
]
FIRST_QUESTION = "What is the weather in Paris and Tokyo?"


def _after(message: dict[str, Any], follow_up: str | None) -> list[dict[str, Any]]:
    """What the client sends after the assistant's ``message``: results of its calls, or the
    next user message."""
    calls = message.get("tool_calls") or []
    if calls:
        return [
            {
                "role": "tool",
                "tool_call_id": c["id"],
                "content": _weather(json.loads(c["function"]["arguments"])["city"]),
            }
            for c in calls
        ]
    return [{"role": "user", "content": follow_up}] if follow_up else []


def _streamed_message(chunks: Any) -> dict[str, Any]:
    """The assistant message a client builds from a streamed answer."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(
                    tc.index,
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                call["id"] += tc.id or ""
                if tc.function is not None:
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def _openai(s: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)


# The SDK's request types are TypedDicts; the tests' messages are plain JSON.
SDK_TOOLS: Any = TOOLS


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One turn, not streamed: the assistant message as the client sends it back."""
    wire: Any = messages
    r = client.chat.completions.create(model="tiny", messages=wire, tools=SDK_TOOLS)
    return dict(r.choices[0].message.model_dump(exclude_none=True))


def _chat_streamed(client: openai.OpenAI, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One turn, streamed: the assistant message as the client builds it from the chunks."""
    wire: Any = messages
    chunks = client.chat.completions.create(
        model="tiny", messages=wire, tools=SDK_TOOLS, stream=True
    )
    return _streamed_message(chunks)


def _tool_loop(
    stack: ScriptedHistoryStack, s: dict[str, Any], *, stream: bool = False
) -> list[list[dict[str, Any]]]:
    """Play ``LOOP`` through the OpenAI SDK; the new messages of each turn's request."""
    client = _openai(s)
    new: list[dict[str, Any]] = [{"role": "user", "content": FIRST_QUESTION}]
    messages: list[dict[str, Any]] = []
    sent = []
    for text, follow_up in LOOP:
        stack.play(text)
        messages += new
        sent.append(new)
        message = (_chat_streamed if stream else _chat)(client, messages)
        messages.append(message)
        new = _after(message, follow_up)
    return sent


def _chatml(new: list[dict[str, Any]]) -> str:
    """The new messages and the generation prompt as corral's Qwen3-style template writes them
    with thinking off (chat_templates.py: consecutive tool results share one user turn), after
    the newline that follows the model's own ``<|im_end|>``."""
    text = "\n"
    for i, m in enumerate(new):
        if m["role"] == "tool":
            if i == 0 or new[i - 1]["role"] != "tool":
                text += "<|im_start|>user"
            text += f"\n<tool_response>\n{m['content']}\n</tool_response>"
            if i == len(new) - 1 or new[i + 1]["role"] != "tool":
                text += "<|im_end|>\n"
        else:
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return text + "<|im_start|>assistant\n" + EMPTY_THINK


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def test_a_tool_loop_is_one_exact_sample_under_token_history_and_forks_under_template(
    think: ScriptedHistoryStack,
) -> None:
    t = think.session(history="template")  # the session's option, over the gateway's default
    _tool_loop(think, t)
    template_samples = think.samples(t["id"])
    s = think.session()
    sent = _tool_loop(think, s)
    tokens_samples = think.samples(s["id"])
    figure = (
        f"{len(LOOP)}-turn tool loop, Qwen3 template, thinking off: {len(tokens_samples)} "
        f"sample(s) under tokens history, {len(template_samples)} under template history"
    )
    print("\n" + figure)
    assert len(tokens_samples) == 1, figure
    assert len(template_samples) == len(LOOP), figure  # every turn forks

    calls = think.engine.calls[len(LOOP) :]
    for k in range(1, len(LOOP)):
        # Each prompt is the previous prompt, the model's tokens, then only the new messages.
        suffix = _encode(think.tokenizer, _chatml(sent[k]))
        expected = calls[k - 1].input_ids + calls[k - 1].output_ids + suffix
        got = think.tokenizer.decode(calls[k].input_ids[len(calls[k - 1].input_ids) :])
        assert calls[k].input_ids == expected, f"turn {k}: {got!r}"
    sample = check_exact_sample(think, s["id"], turns=len(LOOP))
    # The first turn has nothing held: it is rendered in full, as the template writes it.
    assert sample["metadata"]["history_modes"] == ["template"] + ["tokens"] * (len(LOOP) - 1)
    view = think.view(s["id"])
    assert [t["history"] for t in view["turns"]] == sample["metadata"]["history_modes"]
    assert view["drift"]["history_fallbacks"] == []
    assert all("history_fallback" not in t["metadata"] for t in view["turns"])

    assert all(x["metadata"]["history_modes"] == ["template"] for x in template_samples)
    drift = think.view(t["id"])["drift"]
    assert drift["forks"] == len(LOOP) - 1 and drift["history_fallbacks"] == []
    for event in drift["events"]:
        # The template rewrote the model's turn: the empty think block it was prompted with.
        assert event["reason"] == "diverged" and event["message_role"] == "assistant", event
        assert event["held_text"].startswith("<think>"), event
        assert "token history" not in event["explanation"]


def test_the_history_option_is_checked_and_shown(think: ScriptedHistoryStack) -> None:
    r = httpx.post(f"{think.url}/sessions", headers=AUTH, json={"history": "messages"})
    assert r.status_code == 400 and "history" in r.text
    assert think.view(think.session(history="template")["id"])["options"]["history"] == "template"
    assert think.view(think.session()["id"])["options"]["history"] is None  # the gateway's


def _user_message(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _two_turns(stack: ScriptedHistoryStack, client: openai.OpenAI) -> list[dict[str, Any]]:
    """The loop's first two turns (calls, their results, an answer); the conversation so far,
    ending with the second reply."""
    messages = [_user_message(FIRST_QUESTION)]
    for k, (text, _) in enumerate(LOOP[:2]):
        stack.play(text)
        messages.append(_chat(client, messages))
        if k == 0:
            messages += _after(messages[-1], None)
    return messages


def test_an_edited_or_truncated_history_starts_a_new_trajectory_and_says_how(
    think: ScriptedHistoryStack,
) -> None:
    s = think.session()
    client = _openai(s)
    held = _two_turns(think, client)
    assert len(think.samples(s["id"])) == 1
    edited = json.loads(json.dumps(held))
    assert edited[2]["role"] == "tool"
    edited[2]["content"] = _weather("Paris").replace("sunny", "rainy")  # an earlier result
    dropped = [held[0], _user_message("Say hello.")]  # the reply left out
    for messages, text in (([*edited, _user_message("Sure?")], "Noted."), (dropped, "Hello!")):
        think.play(text)
        _chat(client, messages)
    view = think.view(s["id"])
    assert len(think.samples(s["id"])) == 3, view["drift"]
    # The edited result follows the first reply, which the request still resends: the new
    # trajectory continues the first turn's tokens (a rollback) and diverges at the edit.
    edit, drop = view["turns"][2:]
    assert edit["action"] == "start" and edit["history"] == "tokens", edit
    assert "history_fallback" not in edit["metadata"]
    first, rolled_back = think.engine.calls[0], think.engine.calls[2]
    held = first.input_ids + first.output_ids
    assert rolled_back.input_ids[: len(held)] == held
    # Without the reply nothing held is resent: rendered in full, and said why.
    assert drop["action"] == "start" and drop["history"] == "template", drop
    assert "resends no held conversation" in drop["metadata"]["history_fallback"]
    assert "token history was not used" in drop["drift"]["explanation"]
    fallbacks = view["drift"]["history_fallbacks"]
    assert fallbacks == [{"turn": 3, "reason": drop["metadata"]["history_fallback"]}]
    # A conversation rendered in full is continued under token history afterwards.
    think.play("Yes.")
    _chat(client, [*dropped, {"role": "assistant", "content": "Hello!"}, _user_message("Again.")])
    last = think.view(s["id"])["turns"][-1]
    assert last["history"] == "tokens" and last["action"] == "append", last
    assert last["trajectory"] == view["turns"][3]["trajectory"]
    assert "history_fallback" not in last["metadata"]


def test_another_conversation_on_the_session_is_no_fallback(think: ScriptedHistoryStack) -> None:
    s = think.session()
    client = _openai(s)
    _two_turns(think, client)
    # A sub-agent: its own system message, sharing nothing with the held conversation.
    think.play("Done.")
    _chat(client, [{"role": "system", "content": "You are a sub-agent."}, _user_message("Go.")])
    view = think.view(s["id"])
    sub = view["turns"][-1]
    assert sub["action"] == "start" and sub["history"] == "template", sub
    assert "history_fallback" not in sub["metadata"]
    assert view["drift"]["history_fallbacks"] == []


def test_held_tokens_over_the_context_are_rendered_in_full_if_that_fits(
    think: ScriptedHistoryStack,
) -> None:
    # Measured first: the third prompt under each history (token history keeps the empty
    # think blocks the template drops, so it is the longer one).
    lengths = {}
    for history in ("tokens", "template"):
        s = think.session(history=history)
        held = _two_turns(think, _openai(s))
        think.play("Fine.")
        _chat(_openai(s), [*held, _user_message("Thanks.")])
        lengths[history] = len(think.engine.calls[-1].input_ids)
    assert lengths["tokens"] > lengths["template"], lengths
    # A context between the two: the turn falls back to the template's rendering.
    s = think.session(max_context_tokens=lengths["tokens"])
    client = _openai(s)
    held = _two_turns(think, client)
    think.play("Fine.")
    _chat(client, [*held, _user_message("Thanks.")])
    assert len(think.engine.calls[-1].input_ids) == lengths["template"]
    last = think.view(s["id"])["turns"][-1]
    assert last["history"] == "template", last
    assert "do not fit this session's context" in last["metadata"]["history_fallback"]


def test_a_resent_request_gets_the_prompt_of_its_first_attempt(
    think: ScriptedHistoryStack,
) -> None:
    s = think.session()
    client = _openai(s)
    question = [_user_message(FIRST_QUESTION)]

    def ask(messages: list[dict[str, Any]], text: str) -> dict[str, Any]:
        think.play(text)
        return _chat(client, messages)

    reply = ask(question, LOOP[0][0])
    ask(question, "I cannot tell.")  # the same request again: a regeneration
    second = [*question, reply, *_after(reply, None)]
    ask(second, LOOP[1][0])
    ask(second, "Another answer.")
    calls = think.engine.calls
    assert calls[1].input_ids == calls[0].input_ids
    assert calls[3].input_ids == calls[2].input_ids
    turns = think.view(s["id"])["turns"]
    assert [t["history"] for t in turns] == ["template", "tokens", "tokens", "tokens"]
    # The second turn continues the first reply (not the regenerated one); a regeneration is
    # its own sample: its prompt is a prefix of the held tokens.
    reasons = ["first_turn", "prompt_shorter", "extends", "prompt_shorter"]
    assert [t["reason"] for t in turns] == reasons
    assert turns[2]["trajectory"] == turns[0]["trajectory"]
    assert think.view(s["id"])["drift"]["history_fallbacks"] == []


def test_continuing_the_second_choice_extends_its_trajectory(
    think: ScriptedHistoryStack,
) -> None:
    s = think.session()
    client = _openai(s)
    question: Any = [_user_message("What is the weather in Paris or Tokyo?")]
    think.play(_call_text(("get_weather", {"city": "Paris"})))
    think.play(_call_text(("get_weather", {"city": "Tokyo"})))
    r = client.chat.completions.create(model="tiny", messages=question, tools=SDK_TOOLS, n=2)
    assert len(r.choices) == 2
    # Which trajectory holds which choice: the engine request ids end with the choice index.
    trajectory_of = {
        int(t["metadata"]["rid"].rsplit("-", 1)[1]): t["trajectory"]
        for t in think.view(s["id"])["turns"]
    }
    assert sorted(trajectory_of) == [0, 1] and len(set(trajectory_of.values())) == 2
    choice_calls = think.engine.calls[:2]
    for index in (1, 0):  # the second choice first, then the first: both stay continuable
        reply = r.choices[index].message.model_dump(exclude_none=True)
        think.play("Sunny.")
        _chat(client, [*question, reply, *_after(reply, None)])
        turn = think.view(s["id"])["turns"][-1]
        assert turn["history"] == "tokens" and turn["action"] == "append", turn
        assert turn["trajectory"] == trajectory_of[index], (index, turn)
        choice = next(c for c in choice_calls if str(c.rid).endswith(f"-{index}"))
        held = choice.input_ids + choice.output_ids
        assert think.engine.calls[-1].input_ids[: len(held)] == held
    samples = think.samples(s["id"])
    assert len(samples) == 2 and all(x["metadata"]["num_turns"] == 2 for x in samples)


def test_streamed_and_plain_tool_loops_give_the_same_tokens(
    think: ScriptedHistoryStack,
) -> None:
    plain, streamed = think.session(), think.session()
    _tool_loop(think, plain)
    _tool_loop(think, streamed, stream=True)
    calls = think.engine.calls
    n = len(LOOP)
    assert [c.input_ids for c in calls[:n]] == [c.input_ids for c in calls[n:]]
    assert [c.output_ids for c in calls[:n]] == [c.output_ids for c in calls[n:]]
    (a,), (b,) = think.samples(plain["id"]), think.samples(streamed["id"])
    assert a["tokens"] == b["tokens"] and a["loss_mask"] == b["loss_mask"]
    assert b["metadata"]["history_modes"] == ["template"] + ["tokens"] * (n - 1)
    check_exact_sample(think, streamed["id"], turns=n)


def test_an_anthropic_tool_loop_is_one_sample(think: ScriptedHistoryStack) -> None:
    s = think.session()
    client = anthropic.Anthropic(
        base_url=s["anthropic_base_url"], api_key=s["api_key"], max_retries=0
    )
    tools: Any = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    messages: list[Any] = [_user_message(FIRST_QUESTION)]
    for text, follow_up in LOOP:
        think.play(text)
        reply = client.messages.create(model="tiny", max_tokens=200, messages=messages, tools=tools)
        # The SDK's own content blocks go back as they came; tool results quote their ids.
        messages.append({"role": "assistant", "content": reply.content})
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": _weather(str(b.input["city"]))}
            for b in reply.content
            if b.type == "tool_use" and isinstance(b.input, dict)
        ]
        if results:
            messages.append({"role": "user", "content": results})
        elif follow_up:
            messages.append(_user_message(follow_up))
    samples = think.samples(s["id"])
    assert len(samples) == 1, think.view(s["id"])["drift"]
    check_exact_sample(think, s["id"], turns=len(LOOP))
    assert samples[0]["metadata"]["history_modes"] == ["template"] + ["tokens"] * (len(LOOP) - 1)


# -- gridsim episodes through the player ---------------------------------------------------------

# The model's side of a gridsim episode: two simulations, then a submission (which ends it). The
# tiny models cannot play gridsim: greedy, the tiny Qwen3 model writes no tool call there (thinking
# off or on), so its episodes last one turn and nothing could fork; the scripted engine plays the
# model instead, through the real player, env server, gateway and template.
CHARGE_AT_MIDNIGHT = [1] + [0] * 23
CYCLE = [1] + [0] * 17 + [-1] + [0] * 5
GRIDSIM_MOVES = [
    ("simulate_schedule", CHARGE_AT_MIDNIGHT),
    ("simulate_schedule", CYCLE),
    ("submit_schedule", CYCLE),
]
TURNS = len(GRIDSIM_MOVES)
# Per template (by its tiny model's fixture: the id tests/tiers.py reads), the gateway settings
# and the samples of one episode under template history. The Qwen3 template drops the (empty,
# thinking off) think block of every assistant turn but the last, so each turn's re-rendered
# prompt forks from the tokens held: one sample per turn. The Qwen 2.5 one is append-only: its
# re-rendered prompt always extends them, one sample per episode.
GRIDSIM_TEMPLATES: dict[str, tuple[str, dict[str, Any], int]] = {
    "tiny_think_model_dir": ("Qwen3", {}, TURNS),
    "tiny_model_dir": ("Qwen 2.5", {"reasoning_parser": "none", "chat_template_kwargs": {}}, 1),
}


def _check_exact_samples(samples: Sequence[Any], calls: Sequence[Any]) -> None:
    """``check_exact_sample`` for one played episode's samples (their order is the calls'): each
    covers its ``num_turns`` engine calls in turn; its tokens are the last one's input + output,
    its loss mask 1 exactly on the tokens the engine produced, its logprobs the engine's."""
    k = 0
    for sample in samples:
        covered = calls[k : k + sample.metadata["num_turns"]]
        k += len(covered)
        assert covered, (k, len(calls))
        last = covered[-1]
        assert sample.tokens == last.input_ids + last.output_ids
        prompt_len = len(covered[0].input_ids)
        assert sample.response_length == len(sample.tokens) - prompt_len
        mask = [0] * len(sample.tokens)
        logprobs = [0.0] * len(sample.tokens)
        end = 0
        for call in covered:  # each turn's prompt extends the tokens of the turns before
            start = len(call.input_ids)
            assert start >= end
            end = start + len(call.output_ids)
            assert sample.tokens[:end] == call.input_ids + call.output_ids
            assert len(call.logprobs) == len(call.output_ids)
            mask[start:end] = [1] * len(call.output_ids)
            logprobs[start:end] = call.logprobs
        assert sample.loss_mask == mask[prompt_len:]
        assert sample.rollout_log_probs == pytest.approx(logprobs[prompt_len:], abs=1e-6)
    assert k == len(calls)


@pytest.mark.parametrize("model", list(GRIDSIM_TEMPLATES))
async def test_gridsim_episodes_are_one_sample_each_under_token_history(
    model: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from corral.envs.server import build_app
    from corral.gateway.client import GatewayAdmin
    from corral.rollouts.player import Player, Rollout
    from corral.rollouts.rows import Row, RowSettings, write_rows

    template, overrides, forks = GRIDSIM_TEMPLATES[model]
    model_dir: Path = request.getfixturevalue(model)
    episodes = 3
    out = tmp_path / "rows"
    rollouts: dict[str, list[Rollout]] = {}
    with serve(build_app(ROOT / "bundles" / "gridsim")) as env_url:
        await asyncio.to_thread(write_rows, env_url, out, RowSettings(max_turns=TURNS))
        lines = (out / "all.jsonl").read_text().splitlines()
        rows = [Row.model_validate(json.loads(line)) for line in lines][:episodes]
        for mode in ("tokens", "template"):  # the gateway's own setting this time
            with scripted_stack(model_dir, history=mode, **overrides) as stack:
                for _ in rows:
                    for name, schedule in GRIDSIM_MOVES:
                        stack.play(_call_text((name, {"schedule": schedule})))
                async with GatewayAdmin(stack.url, ADMIN) as admin, Player(admin) as player:
                    rollouts[mode] = [await player.play(row) for row in rows]
                assert stack.script.pending == 0
                calls = stack.engine.calls
                assert len(calls) == episodes * TURNS
                for e, rollout in enumerate(rollouts[mode]):  # the episodes ran one at a time
                    _check_exact_samples(rollout.samples, calls[e * TURNS : (e + 1) * TURNS])
    per_rollout = {
        mode: sum(len(r.samples) for r in played) / len(played) for mode, played in rollouts.items()
    }
    figure = (
        f"gridsim, {episodes} episodes of {TURNS} turns, {template} template, thinking off: "
        f"{per_rollout['tokens']:.2f} samples per rollout under tokens history, "
        f"{per_rollout['template']:.2f} under template history"
    )
    print("\n" + figure)
    played = [r for rs in rollouts.values() for r in rs]
    assert not any(r.failed for r in played), [r.reason for r in played]
    assert all(r.turns == TURNS for r in played), figure
    # The env saw the same moves either way: the same rewards.
    assert [r.reward for r in rollouts["tokens"]] == [r.reward for r in rollouts["template"]]
    assert per_rollout == {"tokens": 1.0, "template": float(forks)}, figure
    for r in rollouts["tokens"]:
        (sample,) = r.samples
        assert sample.metadata["history_modes"] == ["template"] + ["tokens"] * (TURNS - 1)
        assert sample.metadata["num_turns"] == TURNS
    for r in rollouts["template"]:
        assert [s.metadata["num_turns"] for s in r.samples] == [TURNS // forks] * forks
        assert all(set(s.metadata["history_modes"]) == {"template"} for s in r.samples)
