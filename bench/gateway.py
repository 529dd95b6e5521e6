"""The gateway's cost, per wire dialect: the same engine and prompts, straight to the engine vs
through the gateway, plus the gateway's CPU per turn along long coding-agent sessions.

Run: ``python bench/gateway.py [--quick]`` (``--help`` for the knobs).

Every number is a ratio against a baseline measured in the same run (these machines are noisy):

1. Dialects. The engine (``corral engine``, pinned to one torch thread) and the gateway
   (``corral gateway``) run as separate processes. A warm-up plays the tiny model's weather
   conversations (system prompt, the ``get_weather``/``add`` tools, tool calls answered with
   scripted results) through the gateway; every turn is then rendered by the gateway's own
   code in this process, once per dialect (Chat Completions; Anthropic Messages: ``system``,
   ``tools`` with ``input_schema``, ``tool_use``/``tool_result`` blocks, ``max_tokens``;
   Responses: ``instructions``, input items, ``function`` tools, ``max_output_tokens``), and the
   three prompt-id lists must be equal (else the bench says which turn differs and where). Once
   per run one conversation is also played through the gateway in each dialect and the token
   ids the gateway recorded (what the engine got and gave) are compared across dialects.
   Measured passes replay the turns straight to ``/generate`` with the recorded ids and play
   them live through the gateway in each dialect, plain and streamed (``stream: true`` on both
   paths; a stream is timed to its last byte), greedy, so both paths make the engine do the same
   work. Paths alternate round by round. Per concurrency, dialect and mode: turns/s, latency
   p50/p99 per turn, the added latency, the throughput ratio and the gateway's CPU seconds per
   turn over the timed window (summed over its threads from ``/proc/<pid>/task/*/schedstat``,
   nanosecond resolution, where utime + stime of ``/proc/<pid>/stat`` counts 10 ms ticks; both
   totals are printed): the median pass's, and as a ratio to Chat Completions' in the same mode
   (the median of the per-round ratios: within a round the dialects run back to back).
2. Long sessions. A second gateway (started in a child process with ``create_gateway(...,
   max_context_tokens=...)``: ``corral gateway`` has no flag for the context) sits in front of
   a stand-in engine that answers every ``/generate`` at once with the same short tool call,
   canonically tokenized, so only the gateway's own cost is measured. Sessions start from
   Claude Code's first request (``tests/fixtures/agent_requests/claude_code_messages.json``:
   its system prompt and 12 tools, translated into each dialect) and grow by one tool call and
   one tool result per turn. Each request runs alone between two idle points of the gateway,
   so its CPU (schedstat, as above; the recording after the answer included) is its own; the
   median over the sessions is reported at turns 1, 32 and 128 (turn 1 encodes the whole
   prompt; later turns only what is new). The sessions use the gateway's default history mode
   (``GatewaySettings.history``); part 4 compares the two.
3. Memory per held session (RSS of the dialect gateway before and after filling sessions).
4. History modes. Per tiny template (``cached_tiny_model("qwen25"|"qwen3", imprint=False)``:
   only the tokenizer and template matter here), a stand-in gateway as in part 2 plays coding
   sessions of 128 turns (Chat Completions, the whole conversation resent each turn plus a
   tool result of 400 characters) with the session option ``history`` set to ``template``
   (the whole conversation rendered and encoded, reusing the encoding of earlier prompts:
   :class:`corral.gateway.rendering.PrefixEncoder`) and to ``tokens`` (the held tokens plus a
   rendered suffix: :mod:`corral.gateway.history`), turn by turn in lockstep. The Qwen3-style
   template gets ``chat_template_kwargs {"enable_thinking": false}``: its generation prompt
   holds an empty think block that its rendering of history drops. Gateway CPU per request is
   measured as in part 2 (schedstat between idle points: parse, render, the engine call,
   recording); per reported turn (1, 32, 128) the median over the sessions and the turns
   within 2 of it (turn 1 alone), and the median of the per-turn ratios tokens / template.
   After the last turn: samples per session (one per trajectory) and the turns built from held
   tokens.

5. Worker processes (``--workers 1 2 4`` runs this part alone). One ``corral gateway --workers
   N`` per N in front of one stand-in engine (as in part 2), and ``--workers N[0] --journal DIR
   --journal-sync interval``, all started at once; then ``--workers-rounds`` rounds in which each
   gateway in turn (the order rotating) plays ``--workers-sessions`` (1,000) concurrent Chat
   Completions sessions of ``--workers-turns`` turns (turn 1 untimed), each answering the
   stand-in's tool call, the sessions deleted after the round. Per N: turns/s, CPU per turn
   (schedstat, summed over the parent and the workers, over the timed window), both as medians
   and as the median of the per-round ratios to the first N; the share of turns forwarded to
   their session's owner; sessions per worker and RSS growth per session (round 1). The journal
   row: the journal's own time on the loop (its ``/metrics`` counter) over the journalled
   gateway's CPU in the same window (target under 10%), CPU per turn against the journal-less
   gateway (the per-round ratios, then the median: noisier), and the journal's bytes per turn.

Last, the targets, each PASS or FAIL (the exit status is 1 when one fails): the same engine
prompt ids in every dialect; per dialect and mode, added latency p50 at most 1 ms (at the lowest
concurrency) and a throughput ratio of at least 0.9 (at the highest); every dialect's CPU per
turn within 10% of Chat Completions' (over all levels, per mode); a long session's CPU at its
last reported turn within 20% of turn 1's; under token history every session ends as 1 sample,
under template history too with the Qwen 2.5-style template and as more than 1 with the
Qwen3-style one (else part 4 is not measuring what it says).

``--quick`` (about 4 minutes on 2 cores): 1 and 16 sessions, 80 turns per path and level, 2 long
sessions per dialect, a small memory fill, 1 history session per mode and template. The default
(12-15 minutes): 1 and 64 sessions, 400 turns, 8 long sessions per dialect, 3 history sessions.
``--only-history`` runs part 4 alone.

The load generator is aiohttp (httpx costs several ms of client CPU per request on these
cores); request bodies are serialised before the clock starts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import aiohttp
from aiohttp import web
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from starlette.datastructures import Headers, QueryParams
from transformers import AutoTokenizer

from corral.engines.sglang import SGLangClient
from corral.engines.tiny_model import CONDITIONS, TOOLS, cached_tiny_model
from corral.gateway.dialects.anthropic_messages import AnthropicMessages
from corral.gateway.dialects.base import Dialect, RequestContext
from corral.gateway.dialects.chat_completions import ChatCompletions
from corral.gateway.dialects.openai_responses import OpenAIResponses
from corral.gateway.pipeline import TurnPipeline
from corral.gateway.server import create_gateway, model_context_length
from corral.gateway.sessions import SessionOptions, SessionStore
from corral.gateway.settings import GatewaySettings
from corral.serving import KEEP_ALIVE_S, free_port

ROOT = Path(__file__).resolve().parent.parent
ADMIN_VAR = "CORRAL_BENCH_ADMIN"
ADMIN = "bench-admin"
MODEL_NAME = "bench"
DIALECTS = ("chat_completions", "anthropic_messages", "openai_responses")
BASELINE = DIALECTS[0]
MODES = ("plain", "stream")
Mode = str  # one of MODES

SYSTEM = "You are a weather assistant. Use the tools."
USER_TURNS = [
    "What is the weather in Paris?",
    "And in Tokyo?",
    "Say hello.",
    "What is the weather in Lima and Oslo?",
    "Thanks. Say hello.",
]
CLAUDE_CODE = ROOT / "tests" / "fixtures" / "agent_requests" / "claude_code_messages.json"
# What the stand-in engine answers every turn of a long session (then the EOS token).
STAND_IN_CALL = (
    '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/workspace/src/app.py"}}\n'
    "</tool_call>"
)
# The gateway's targets: what it may add to an engine call, and what it may cost.
MAX_ADDED_P50_S = 1e-3
MIN_RATIO = 0.9
MAX_CPU_VS_BASELINE = 0.10
MAX_LONG_GROWTH = 0.20


# ---- a conversation in no wire format --------------------------------------------------------


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Msg:
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    calls: tuple[Call, ...] = ()
    call_id: str | None = None  # of a tool result


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class Prompt:
    """One request's conversation: system text blocks (joined with a newline where a dialect
    takes one string, as the gateway joins Anthropic's blocks), tools and messages."""

    system: tuple[str, ...]
    tools: tuple[ToolDef, ...]
    messages: tuple[Msg, ...]

    @property
    def system_text(self) -> str:
        return "\n".join(self.system)


@dataclass(frozen=True)
class Reply:
    message: Msg
    prompt_tokens: int = 0
    completion_tokens: int = 0


# ---- the three wire dialects, client side ----------------------------------------------------


class Wire(Protocol):
    name: str

    def url(self, session: dict[str, Any]) -> str: ...

    def headers(self, key: str) -> dict[str, str]: ...

    def body(self, prompt: Prompt, max_tokens: int, stream: bool) -> dict[str, Any]: ...

    def reply(self, data: dict[str, Any]) -> Reply: ...

    def stream_reply(self, events: list[tuple[str | None, str]]) -> Reply: ...


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


class ChatWire:
    name = "chat_completions"

    def url(self, session: dict[str, Any]) -> str:
        return f"{session['base_url']}/chat/completions"

    def headers(self, key: str) -> dict[str, str]:
        return _bearer(key)

    def body(self, prompt: Prompt, max_tokens: int, stream: bool) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        if prompt.system:
            messages.append({"role": "system", "content": prompt.system_text})
        for m in prompt.messages:
            if m.role == "assistant":
                wire: dict[str, Any] = {
                    "role": "assistant",
                    "content": m.content if m.content or not m.calls else None,
                }
                if m.calls:
                    wire["tool_calls"] = [
                        {
                            "id": c.id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for c in m.calls
                    ]
                messages.append(wire)
            elif m.role == "tool":
                messages.append({"role": "tool", "tool_call_id": m.call_id, "content": m.content})
            else:
                messages.append({"role": m.role, "content": m.content})
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "messages": messages,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if prompt.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.parameters,
                    },
                }
                for t in prompt.tools
            ]
        return body

    def reply(self, data: dict[str, Any]) -> Reply:
        message = data["choices"][0]["message"]
        calls = tuple(
            Call(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or ()
        )
        usage = data.get("usage") or {}
        return Reply(
            Msg("assistant", message.get("content") or "", calls),
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", 0),
        )

    def stream_reply(self, events: list[tuple[str | None, str]]) -> Reply:
        text: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        for _, data in events:
            if data == "[DONE]":
                break
            for choice in json.loads(data)["choices"]:
                delta = choice.get("delta") or {}
                text.append(delta.get("content") or "")
                for c in delta.get("tool_calls") or ():
                    call = calls.setdefault(c["index"], {"id": "", "name": "", "arguments": ""})
                    call["id"] = c.get("id") or call["id"]
                    fn = c.get("function") or {}
                    call["name"] += fn.get("name") or ""
                    call["arguments"] += fn.get("arguments") or ""
        found = tuple(Call(**calls[i]) for i in sorted(calls))
        return Reply(Msg("assistant", "".join(text), found))


class AnthropicWire:
    name = "anthropic_messages"

    def url(self, session: dict[str, Any]) -> str:
        return f"{session['anthropic_base_url']}/v1/messages"

    def headers(self, key: str) -> dict[str, str]:
        return {
            "x-api-key": key,
            "anthropic-version": "2023-06-01",
            "Content-Type": "application/json",
        }

    def body(self, prompt: Prompt, max_tokens: int, stream: bool) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        for m in prompt.messages:
            if m.role == "assistant":
                blocks: list[dict[str, Any]] = (
                    [{"type": "text", "text": m.content}] if m.content else []
                )
                blocks += [
                    {"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c)}
                    for c in m.calls
                ]
                messages.append({"role": "assistant", "content": blocks or m.content})
            elif m.role == "tool":
                result = {"type": "tool_result", "tool_use_id": m.call_id, "content": m.content}
                last = messages[-1] if messages else None
                if (
                    last is not None
                    and last["role"] == "user"
                    and isinstance(last["content"], list)
                    and last["content"][-1]["type"] == "tool_result"
                ):
                    last["content"].append(result)
                else:
                    messages.append({"role": "user", "content": [result]})
            else:
                messages.append({"role": m.role, "content": m.content})
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "messages": messages,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if len(prompt.system) == 1:
            body["system"] = prompt.system[0]
        elif prompt.system:
            body["system"] = [{"type": "text", "text": text} for text in prompt.system]
        if prompt.tools:
            body["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in prompt.tools
            ]
        return body

    def reply(self, data: dict[str, Any]) -> Reply:
        text = [b["text"] for b in data["content"] if b["type"] == "text"]
        calls = tuple(
            Call(b["id"], b["name"], json.dumps(b["input"], ensure_ascii=False))
            for b in data["content"]
            if b["type"] == "tool_use"
        )
        usage = data.get("usage") or {}
        return Reply(
            Msg("assistant", "\n".join(text), calls),
            usage.get("input_tokens", 0),
            usage.get("output_tokens", 0),
        )

    def stream_reply(self, events: list[tuple[str | None, str]]) -> Reply:
        blocks: dict[int, dict[str, str]] = {}
        for kind, data in events:
            event = json.loads(data)
            if kind == "content_block_start":
                block = event["content_block"]
                blocks[event["index"]] = {
                    "type": block["type"],
                    "id": block.get("id", ""),
                    "name": block.get("name", ""),
                    "text": "",
                }
            elif kind == "content_block_delta":
                delta = event["delta"]
                piece = delta.get("text") or delta.get("partial_json") or ""
                blocks[event["index"]]["text"] += piece
        ordered = [blocks[i] for i in sorted(blocks)]
        text = [b["text"] for b in ordered if b["type"] == "text"]
        calls = tuple(
            Call(b["id"], b["name"], b["text"] or "{}") for b in ordered if b["type"] == "tool_use"
        )
        return Reply(Msg("assistant", "\n".join(text), calls))


class ResponsesWire:
    """Stateless, as Codex drives it: ``store: false`` and the whole conversation as input."""

    name = "openai_responses"

    def url(self, session: dict[str, Any]) -> str:
        return f"{session['base_url']}/responses"

    def headers(self, key: str) -> dict[str, str]:
        return _bearer(key)

    def body(self, prompt: Prompt, max_tokens: int, stream: bool) -> dict[str, Any]:
        items: list[dict[str, Any]] = []
        for m in prompt.messages:
            if m.role == "assistant":
                if m.content or not m.calls:
                    part = {"type": "output_text", "text": m.content}
                    items.append({"type": "message", "role": "assistant", "content": [part]})
                items += [
                    {
                        "type": "function_call",
                        "call_id": c.id,
                        "name": c.name,
                        "arguments": c.arguments,
                    }
                    for c in m.calls
                ]
            elif m.role == "tool":
                items.append(
                    {"type": "function_call_output", "call_id": m.call_id, "output": m.content}
                )
            else:
                part = {"type": "input_text", "text": m.content}
                items.append({"type": "message", "role": m.role, "content": [part]})
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "input": items,
            "temperature": 0,
            "max_output_tokens": max_tokens,
            "store": False,
            "stream": stream,
        }
        if prompt.system:
            body["instructions"] = prompt.system_text
        if prompt.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                }
                for t in prompt.tools
            ]
        return body

    def reply(self, data: dict[str, Any]) -> Reply:
        text: list[str] = []
        calls: list[Call] = []
        for item in data["output"]:
            if item["type"] == "message":
                text += [p["text"] for p in item["content"] if p["type"] == "output_text"]
            elif item["type"] == "function_call":
                calls.append(Call(item["call_id"], item["name"], item["arguments"]))
        usage = data.get("usage") or {}
        return Reply(
            Msg("assistant", "".join(text), tuple(calls)),
            usage.get("input_tokens", 0),
            usage.get("output_tokens", 0),
        )

    def stream_reply(self, events: list[tuple[str | None, str]]) -> Reply:
        for kind, data in reversed(events):
            if kind in ("response.completed", "response.incomplete"):
                return self.reply(json.loads(data)["response"])
        raise RuntimeError(f"the stream did not complete: {events[-1:]}")


WIRES: dict[str, Wire] = {w.name: w for w in (ChatWire(), AnthropicWire(), ResponsesWire())}


def _input(call: Call) -> Any:
    try:
        return json.loads(call.arguments)
    except json.JSONDecodeError:
        return {}


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event."""
    out: list[tuple[str | None, str]] = []
    for block in text.split("\n\n"):
        kind: str | None = None
        data: list[str] = []
        for line in block.splitlines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            out.append((kind, "\n".join(data)))
    return out


# ---- scripted conversations ------------------------------------------------------------------


class Script(Protocol):
    def next_prompt(self) -> Prompt: ...

    def answer(self, reply: Msg) -> None: ...


def weather_tools() -> tuple[ToolDef, ...]:
    return tuple(
        ToolDef(t["function"]["name"], t["function"]["description"], t["function"]["parameters"])
        for t in TOOLS
    )


def weather_result(call: Call) -> str:
    """A scripted tool result for one of the tiny model's tools."""
    args = _input(call)
    if not isinstance(args, dict):
        return "error: bad arguments"
    if call.name == "get_weather":
        city = str(args.get("city", ""))
        return json.dumps(
            {"city": city, "weather": CONDITIONS[len(city) % len(CONDITIONS)], "temp_c": 21}
        )
    if call.name == "add":
        try:
            return str(int(args["a"]) + int(args["b"]))
        except (KeyError, TypeError, ValueError):
            return "error: bad arguments"
    return f"error: no tool {call.name}"


class WeatherScript:
    """The tiny model's weather conversation ``k``: a tool call's results come next, else the
    next user message."""

    def __init__(self, k: int, tools: tuple[ToolDef, ...]) -> None:
        self.k = k
        self.tools = tools
        self.users = 0
        self.messages: list[Msg] = []

    def next_prompt(self) -> Prompt:
        last = self.messages[-1] if self.messages else None
        if last is not None and last.calls:
            self.messages += [Msg("tool", weather_result(c), call_id=c.id) for c in last.calls]
        else:
            text = USER_TURNS[(self.k + self.users) % len(USER_TURNS)]
            self.messages.append(Msg("user", text))
            self.users += 1
        return Prompt((SYSTEM,), self.tools, tuple(self.messages))

    def answer(self, reply: Msg) -> None:
        self.messages.append(reply)


def claude_code_start() -> Prompt:
    """Claude Code's first request as a prompt: its system blocks, tools and messages."""
    data = json.loads(CLAUDE_CODE.read_text())

    def text(content: str | list[dict[str, Any]]) -> str:
        if isinstance(content, str):
            return content
        return "\n".join(b["text"] for b in content)

    return Prompt(
        system=tuple(b["text"] for b in data["system"]),
        tools=tuple(
            ToolDef(t["name"], t.get("description", ""), t["input_schema"]) for t in data["tools"]
        ),
        messages=tuple(Msg(m["role"], text(m["content"])) for m in data["messages"]),
    )


def file_text(turn: int, chars: int) -> str:
    """A tool result of about ``chars`` characters (a numbered source listing), new per turn."""
    lines: list[str] = []
    size = 0
    while size < chars:
        line = f"{len(lines) + 1:>6}\tdef step_{turn}_{len(lines)}(state):  # turn {turn}\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


class CodingScript:
    """A coding agent's session: Claude Code's first request, then one tool result per call."""

    def __init__(self, start: Prompt, result_chars: int) -> None:
        self.start = start
        self.result_chars = result_chars
        self.messages = list(start.messages)
        self.turn = 0

    def next_prompt(self) -> Prompt:
        self.turn += 1
        last = self.messages[-1]
        if last.role == "assistant":
            if last.calls:
                self.messages += [
                    Msg("tool", file_text(self.turn, self.result_chars), call_id=c.id)
                    for c in last.calls
                ]
            else:
                self.messages.append(Msg("user", "Go on."))
        return replace(self.start, messages=tuple(self.messages))

    def answer(self, reply: Msg) -> None:
        self.messages.append(reply)


# ---- the gateway's own rendering, in this process --------------------------------------------


class GatewayRenderer:
    """The gateway's dialect parsers and turn pipeline (default settings) in this process: the
    prompt ids a gateway sends the engine for a request body."""

    def __init__(self, model: str, max_context_tokens: int) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        settings = GatewaySettings(
            model_name=Path(model).name, max_context_tokens=max_context_tokens
        )
        # Never called: rendering needs no engine.
        engine = SGLangClient("http://127.0.0.1:9")
        self._pipeline = TurnPipeline(settings, engine, self.tokenizer)
        self._store = SessionStore(max_sessions=4, max_held_tokens=10**9, default_ttl_s=None)
        dialects: list[Dialect] = [ChatCompletions(), AnthropicMessages(), OpenAIResponses()]
        self._dialects = {d.name: d for d in dialects}

    def prompt_ids(self, dialect: str, prompt: Prompt, max_tokens: int) -> list[int]:
        body = WIRES[dialect].body(prompt, max_tokens, stream=False)
        session = self._store.create(SessionOptions())
        try:
            ctx = RequestContext(session=session, headers=Headers(), query=QueryParams())
            request = self._dialects[dialect].parse(body, ctx)
            return list(self._pipeline.prepare(session, request).prompt_ids)
        finally:
            self._store.delete(session.id)

    def difference(self, a: Sequence[int], b: Sequence[int]) -> str:
        """Where two id lists part, with the text around it."""
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if at is None:
            at = min(len(a), len(b))
        context = self.tokenizer.decode(list(a[max(0, at - 8) : at]))
        return (
            f"first difference at token {at} of {len(a)} vs {len(b)}, after {context!r}: "
            f"{self.tokenizer.decode(list(a[at : at + 8]))!r} vs "
            f"{self.tokenizer.decode(list(b[at : at + 8]))!r}"
        )


# ---- processes -------------------------------------------------------------------------------


@contextmanager
def process(
    args: list[str], env: dict[str, str], health_url: str
) -> Iterator[subprocess.Popen[bytes]]:
    # stderr to a file: an unread pipe fills up and blocks the server mid-benchmark.
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            if not asyncio.run(_wait_healthy(health_url, proc)):
                log.seek(0)
                raise RuntimeError(f"{args} did not start: {log.read().decode()[-2000:]}")
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + 120
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                async with http.get(url) as r:
                    if r.status == 200:
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)  # polling a process we started, not test synchronisation
    return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc; clock-tick resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds_fine(pid: int) -> float:
    """CPU time of a process's live threads so far, in nanoseconds' resolution (schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


async def settle(pid: int) -> None:
    """Wait until the process is idle (its background work for the last requests done)."""
    previous = cpu_seconds_fine(pid)
    for _ in range(200):
        await asyncio.sleep(0.005)
        now = cpu_seconds_fine(pid)
        if now - previous < 50e-6:
            return
        previous = now


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def serve_gateway(engine_url: str, model: str, port: int, max_context_tokens: int) -> None:
    """``corral gateway`` with the context set (the CLI has no flag for it)."""
    import uvicorn

    app = create_gateway(
        engine_url,
        model,
        admin_token=os.environ[ADMIN_VAR],
        max_context_tokens=max_context_tokens,
    )
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_S,
    )


def serve_stand_in(model: str, port: int) -> None:
    """An engine that answers every ``/generate`` at once with ``STAND_IN_CALL`` + EOS."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = int(tokenizer.eos_token_id)
    ids = [*tokenizer.encode(STAND_IN_CALL, add_special_tokens=False), eos]
    logprobs = [[-0.01, i, None] for i in ids]

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("stream"):
            return web.json_response({"error": {"message": "no streaming here"}}, status=400)
        meta = {
            "id": body.get("rid"),
            "finish_reason": {"type": "stop", "matched": eos},
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(ids),
            "output_token_logprobs": logprobs,
            "weight_version": "default",
        }
        return web.json_response({"text": STAND_IN_CALL, "output_ids": ids, "meta_info": meta})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": model, "weight_version": "default"})

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", ok)
    app.router.add_get("/health", ok)
    app.router.add_get("/get_model_info", model_info)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# ---- requests --------------------------------------------------------------------------------


async def new_session(
    http: aiohttp.ClientSession, gateway: str, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    async with http.post(
        f"{gateway}/sessions", json=options or {}, headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        r.raise_for_status()
        return dict(await r.json())


async def delete_session(http: aiohttp.ClientSession, gateway: str, session_id: str) -> None:
    async with http.delete(
        f"{gateway}/sessions/{session_id}", headers={"Authorization": f"Bearer {ADMIN}"}
    ):
        pass


async def samples(http: aiohttp.ClientSession, gateway: str, session_id: str) -> list[Any]:
    async with http.get(
        f"{gateway}/sessions/{session_id}/samples", headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        r.raise_for_status()
        return list(await r.json())


async def session_view(http: aiohttp.ClientSession, gateway: str, session_id: str) -> Any:
    """``GET /sessions/{id}``: the session's trajectories (one sample each), turns and drift."""
    async with http.get(
        f"{gateway}/sessions/{session_id}", headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        r.raise_for_status()
        return await r.json()


async def ask(
    http: aiohttp.ClientSession,
    wire: Wire,
    session: dict[str, Any],
    prompt: Prompt,
    max_tokens: int,
    stream: bool,
    extra: dict[str, Any] | None = None,
) -> tuple[float, Reply]:
    """One turn through the gateway: (seconds to the answer's last byte, the reply).
    ``extra``: more top-level body fields (``chat_template_kwargs``)."""
    data = json.dumps({**wire.body(prompt, max_tokens, stream), **(extra or {})}).encode()
    headers = wire.headers(session["api_key"])
    t0 = time.perf_counter()
    async with http.post(wire.url(session), data=data, headers=headers) as r:
        raw = await r.read()
    took = time.perf_counter() - t0
    if r.status != 200:
        raise RuntimeError(f"{wire.name} answered {r.status}: {raw.decode()[:1000]}")
    text = raw.decode()
    reply = wire.stream_reply(sse_events(text)) if stream else wire.reply(json.loads(text))
    return took, reply


async def play(
    http: aiohttp.ClientSession,
    wire: Wire,
    session: dict[str, Any],
    script: Script,
    turns: int,
    max_tokens: int,
    stream: bool,
) -> list[tuple[float, Prompt, Reply]]:
    """A conversation played live: each turn's history holds the replies this session got."""
    out = []
    for _ in range(turns):
        prompt = script.next_prompt()
        took, reply = await ask(http, wire, session, prompt, max_tokens, stream)
        script.answer(reply.message)
        out.append((took, prompt, reply))
    return out


def _connector() -> aiohttp.TCPConnector:
    return aiohttp.TCPConnector(limit=0)


# ---- part 1: the dialects against the engine -------------------------------------------------


@dataclass
class Turn:
    prompt: Prompt  # the conversation so far, as the warm-up played it
    input_ids: list[int]  # what the gateway sends the engine for it (every dialect)
    max_new_tokens: int


@dataclass
class PathRun:
    """One path (direct, or a dialect) at one concurrency and mode, over the rounds."""

    latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    # Gateway paths: CPU seconds per turn of each pass (schedstat), and the totals by
    # schedstat and by utime + stime (ticks).
    cpu_per_pass: list[float] = field(default_factory=list)
    cpu: float = 0.0
    cpu_ticks: float = 0.0

    def add(
        self, latencies: list[float], elapsed: float, cpu: float = 0.0, cpu_ticks: float = 0.0
    ) -> None:
        self.latencies += latencies
        self.elapsed += elapsed
        self.cpu_per_pass.append(cpu / len(latencies))
        self.cpu += cpu
        self.cpu_ticks += cpu_ticks

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.elapsed

    @property
    def cpu_per_turn(self) -> float:
        """The median pass's: one pass that a neighbour's burst slowed does not move it."""
        return statistics.median(self.cpu_per_pass)


def paired_cpu_ratios(runs: dict[tuple[Mode, str], PathRun], mode: Mode, d: str) -> list[float]:
    """Per round: a dialect's CPU per turn over the baseline's in the same round (they ran back
    to back, so the machine's state was about the same)."""
    base = runs[mode, BASELINE].cpu_per_pass
    return [x / y for x, y in zip(runs[mode, d].cpu_per_pass, base, strict=True)]


async def record_conversations(
    gateway: str, sessions: int, turns: int, max_tokens: int, tools: tuple[ToolDef, ...]
) -> list[list[tuple[Prompt, Reply]]]:
    """Warm-up: play each conversation once through the gateway (Chat Completions), so that
    the assistant turns are the model's own."""
    async with aiohttp.ClientSession(connector=_connector()) as http:

        async def one(k: int) -> list[tuple[Prompt, Reply]]:
            session = await new_session(http, gateway)
            played = await play(
                http, WIRES[BASELINE], session, WeatherScript(k, tools), turns, max_tokens, False
            )
            await delete_session(http, gateway, session["id"])
            return [(prompt, reply) for _, prompt, reply in played]

        return list(await asyncio.gather(*(one(k) for k in range(sessions))))


def render_turns(
    renderer: GatewayRenderer, conversations: list[list[tuple[Prompt, Reply]]], max_tokens: int
) -> tuple[list[list[Turn]], list[str]]:
    """Every turn's prompt ids as each dialect renders it; the turns (with the baseline's
    ids) and a line per turn where a dialect's ids differ from the baseline's."""
    out: list[list[Turn]] = []
    problems: list[str] = []
    for k, conversation in enumerate(conversations):
        turns = []
        for t, (prompt, _) in enumerate(conversation):
            ids = {d: renderer.prompt_ids(d, prompt, max_tokens) for d in DIALECTS}
            for d in DIALECTS[1:]:
                if ids[d] != ids[BASELINE]:
                    problems.append(
                        f"conversation {k} turn {t + 1}: {d} vs {BASELINE}: "
                        + renderer.difference(ids[d], ids[BASELINE])
                    )
            turns.append(Turn(prompt, ids[BASELINE], max_tokens))
        out.append(turns)
    return out, problems


async def check_recorded(
    gateway: str, renderer: GatewayRenderer, turns: int, max_tokens: int, tools: tuple[ToolDef, ...]
) -> tuple[dict[str, tuple[int, int, bool]], list[str]]:
    """One conversation played through the gateway in each dialect, one turn at a time (so the
    greedy replies cannot differ by batch): per dialect (turns whose prompt ids, rendered here,
    start a sample the gateway recorded; turns; recorded tokens equal to the baseline's)."""
    recorded: dict[str, list[list[int]]] = {}
    found: dict[str, int] = {}
    async with aiohttp.ClientSession() as http:
        for d in DIALECTS:
            session = await new_session(http, gateway)
            played = await play(
                http, WIRES[d], session, WeatherScript(0, tools), turns, max_tokens, False
            )
            recorded[d] = [s["tokens"] for s in await samples(http, gateway, session["id"])]
            await delete_session(http, gateway, session["id"])
            found[d] = 0
            for _, prompt, _ in played:
                ids = renderer.prompt_ids(d, prompt, max_tokens)
                found[d] += any(tokens[: len(ids)] == ids for tokens in recorded[d])
    out = {}
    problems = []
    for d in DIALECTS:
        same = recorded[d] == recorded[BASELINE]
        if not same:
            a = [t for s in recorded[d] for t in s]
            b = [t for s in recorded[BASELINE] for t in s]
            problems.append(
                f"recorded tokens, {d} vs {BASELINE} ({len(recorded[d])} vs "
                f"{len(recorded[BASELINE])} samples): " + renderer.difference(a, b)
            )
        out[d] = (found[d], turns, same)
    return out, problems


async def run_direct(
    engine: str, conversations: list[list[Turn]], stream: bool
) -> tuple[list[float], float]:
    async with aiohttp.ClientSession(connector=_connector()) as http:

        async def one(turns: list[Turn]) -> list[float]:
            out = []
            for turn in turns:
                payload = {
                    "input_ids": turn.input_ids,
                    "sampling_params": {"max_new_tokens": turn.max_new_tokens, "temperature": 0},
                    "return_logprob": True,
                    "stream": stream,
                }
                data = json.dumps(payload).encode()
                t0 = time.perf_counter()
                async with http.post(
                    f"{engine}/generate", data=data, headers={"Content-Type": "application/json"}
                ) as r:
                    r.raise_for_status()
                    await r.read()
                out.append(time.perf_counter() - t0)
            return out

        t0 = time.perf_counter()
        lat = await asyncio.gather(*(one(c) for c in conversations))
        return [x for xs in lat for x in xs], time.perf_counter() - t0


async def run_gateway(
    gateway: str,
    pid: int,
    wire: Wire,
    sessions: int,
    turns: int,
    max_tokens: int,
    stream: bool,
    tools: tuple[ToolDef, ...],
) -> tuple[list[float], float, float, float]:
    """(latencies, seconds, gateway CPU seconds by schedstat and by utime + stime) of
    ``sessions`` conversations played live."""
    async with aiohttp.ClientSession(connector=_connector()) as http:
        opened = [await new_session(http, gateway) for _ in range(sessions)]
        await settle(pid)
        cpu0, ticks0 = cpu_seconds_fine(pid), cpu_seconds(pid)
        t0 = time.perf_counter()
        played = await asyncio.gather(
            *(
                play(http, wire, s, WeatherScript(k, tools), turns, max_tokens, stream)
                for k, s in enumerate(opened)
            )
        )
        elapsed = time.perf_counter() - t0
        await settle(pid)  # the last turns' recording
        cpu, ticks = cpu_seconds_fine(pid) - cpu0, cpu_seconds(pid) - ticks0
        for s in opened:
            await delete_session(http, gateway, s["id"])
        return [took for xs in played for took, _, _ in xs], elapsed, cpu, ticks


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure_level(
    engine: str,
    gateway: str,
    pid: int,
    conversations: list[list[Turn]],
    args: argparse.Namespace,
    tools: tuple[ToolDef, ...],
    progress: Progress,
) -> dict[tuple[Mode, str], PathRun]:
    """Every path at one concurrency; ``direct`` and each dialect, plain and streamed."""
    n = len(conversations)
    rounds = max(3, -(-args.min_turns // (n * args.turns)))
    runs: dict[tuple[Mode, str], PathRun] = {
        (mode, path): PathRun() for mode in MODES for path in ("direct", *DIALECTS)
    }
    task = progress.add_task(f"{n} session(s)", total=rounds * len(runs))
    for r in range(rounds):
        # Alternate the paths round by round so none always runs on a warmer (or busier)
        # machine; the direct baseline of a mode runs right before its dialects.
        order = DIALECTS[r % 3 :] + DIALECTS[: r % 3]
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            stream = mode == "stream"
            runs[mode, "direct"].add(*asyncio.run(run_direct(engine, conversations, stream)))
            progress.advance(task)
            for d in order:
                runs[mode, d].add(
                    *asyncio.run(
                        run_gateway(
                            gateway, pid, WIRES[d], n, args.turns, args.max_tokens, stream, tools
                        )
                    )
                )
                progress.advance(task)
    progress.remove_task(task)
    return runs


async def fill_sessions(gateway: str, sessions: int, turns: int, tools: tuple[ToolDef, ...]) -> int:
    """Long multi-turn sessions held by the gateway; returns the tokens they hold."""
    async with aiohttp.ClientSession(connector=_connector()) as http:

        async def one(k: int) -> int:
            session = await new_session(http, gateway)
            script = WeatherScript(k, tools)
            await play(http, WIRES[BASELINE], session, script, turns, 48, False)
            return sum(len(s["tokens"]) for s in await samples(http, gateway, session["id"]))

        return sum(await asyncio.gather(*(one(k) for k in range(sessions))))


# ---- part 2: long sessions -------------------------------------------------------------------


@dataclass
class Step:
    """One turn of a dialect's long sessions, each session's turn measured on its own."""

    cpu: list[float]  # gateway CPU seconds, per session
    latency: list[float]  # seconds to the answer, per session
    prompt_tokens: int
    body_bytes: int

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


async def long_sessions(
    gateway: str,
    pid: int,
    sessions: int,
    turns: int,
    result_chars: int,
    progress: Progress,
) -> dict[str, list[Step]]:
    """Every dialect's sessions in lockstep: turn t of one dialect's sessions, then of the
    next (rotating), so that the machine's mood shifts hit all dialects alike. Each request runs
    alone between two idle points of the gateway, so its CPU (recording included) is its own;
    a turn's figure is the median over the sessions (a GC pass or a preemption hits one)."""
    start = claude_code_start()
    steps: dict[str, list[Step]] = {d: [] for d in DIALECTS}
    task = progress.add_task("long sessions (turns)", total=turns)
    async with aiohttp.ClientSession(connector=_connector()) as http:
        for d in DIALECTS:  # warm-up: first-use costs (template compilation, imports)
            warm = await new_session(http, gateway)
            await play(http, WIRES[d], warm, CodingScript(start, result_chars), 3, 64, False)
            await delete_session(http, gateway, warm["id"])
        opened = {d: [await new_session(http, gateway) for _ in range(sessions)] for d in DIALECTS}
        scripts = {
            d: [CodingScript(start, result_chars) for _ in range(sessions)] for d in DIALECTS
        }
        for t in range(turns):
            for d in DIALECTS[t % 3 :] + DIALECTS[: t % 3]:
                wire = WIRES[d]
                step = Step([], [], 0, 0)
                for session, script in zip(opened[d], scripts[d], strict=True):
                    prompt = script.next_prompt()
                    step.body_bytes = step.body_bytes or len(
                        json.dumps(wire.body(prompt, 64, False))
                    )
                    await settle(pid)
                    cpu0 = cpu_seconds_fine(pid)
                    took, reply = await ask(http, wire, session, prompt, 64, False)
                    await settle(pid)
                    step.cpu.append(cpu_seconds_fine(pid) - cpu0)
                    step.latency.append(took)
                    step.prompt_tokens = reply.prompt_tokens
                    script.answer(reply.message)
                steps[d].append(step)
            progress.advance(task)
        for d in DIALECTS:
            for s in opened[d]:
                await delete_session(http, gateway, s["id"])
    progress.remove_task(task)
    return steps


# ---- part 4: history modes along one long session ----------------------------------------------


# The baseline first: ratios are tokens / template.
HISTORY_MODES = ("template", "tokens")


@dataclass(frozen=True)
class HistoryCase:
    """A tiny template, the template variables the client sends on every request, and whether
    template history should split the session into a sample per turn."""

    template: Literal["qwen25", "qwen3"]
    kwargs: dict[str, Any]
    splits: bool


# Qwen3's template with thinking off puts an empty think block in each generation prompt and
# drops it from the earlier answers when it renders them as history, so under template history
# no turn extends the held tokens; Qwen 2.5's renders history as the model wrote it.
HISTORY_CASES = (
    HistoryCase("qwen25", {}, splits=False),
    HistoryCase("qwen3", {"enable_thinking": False}, splits=True),
)


@dataclass
class HistoryEnd:
    """A session's state after its last turn (from ``GET /sessions/{id}``)."""

    samples: int  # trajectories: the session's samples, one each
    token_turns: int  # turns whose prompt was the held tokens plus a rendered suffix
    fallbacks: list[str]  # why token history was not used, per turn that asked for it


@dataclass
class HistoryRun:
    """One template's sessions in both history modes, played in lockstep."""

    case: HistoryCase
    # mode -> session -> turn: the gateway's CPU seconds (schedstat) for that request alone.
    cpu: dict[str, list[list[float]]]
    prompt_tokens: list[int]  # per turn, as the gateway reported them (template history)
    ends: dict[str, list[HistoryEnd]]  # mode -> per session

    def window(self, turn: int, half: int) -> list[int]:
        """The turns (1-based) pooled for ``turn``: turn 1 alone (the only turn rendered in
        full in both modes), else ``turn - half .. turn + half`` within turns 2 to the last."""
        last = len(self.prompt_tokens)
        if turn == 1:
            return [1]
        return list(range(max(2, turn - half), min(last, turn + half) + 1))

    def cpu_at(self, mode: str, turn: int, half: int) -> float:
        """Median over the sessions and the window's turns."""
        return statistics.median(s[t - 1] for s in self.cpu[mode] for t in self.window(turn, half))

    def ratio_at(self, turn: int, half: int) -> float:
        """Median of per-turn ratios tokens / template: turn t of both modes ran back to back,
        so each pair saw about the same machine."""
        pairs = zip(self.cpu["tokens"], self.cpu["template"], strict=True)
        return statistics.median(
            a[t - 1] / b[t - 1] for a, b in pairs for t in self.window(turn, half)
        )


def history_end(view: dict[str, Any]) -> HistoryEnd:
    return HistoryEnd(
        samples=len(view["trajectories"]),
        token_turns=sum(t["history"] == "tokens" for t in view["turns"]),
        fallbacks=[f["reason"] for f in view["drift"]["history_fallbacks"]],
    )


async def history_sessions(
    gateway: str,
    pid: int,
    sessions: int,
    turns: int,
    result_chars: int,
    case: HistoryCase,
    progress: Progress,
) -> HistoryRun:
    """``sessions`` coding-agent sessions per history mode (session option ``history``), turn t
    of every session of one mode, then of the other (which goes first alternates), each
    request alone between two idle points of the gateway (as :func:`long_sessions`). Chat
    Completions; every request resends the whole conversation, the case's template variables
    as ``chat_template_kwargs``."""
    start = claude_code_start()
    wire = WIRES[BASELINE]
    extra = {"chat_template_kwargs": case.kwargs} if case.kwargs else None
    run = HistoryRun(case, {m: [[] for _ in range(sessions)] for m in HISTORY_MODES}, [], {})
    task = progress.add_task(f"history modes, {case.template} (turns)", total=turns)
    async with aiohttp.ClientSession(connector=_connector()) as http:
        for mode in HISTORY_MODES:  # warm-up: first-use costs (template compilation, probes)
            warm = await new_session(http, gateway, {"history": mode})
            script = CodingScript(start, result_chars)
            for _ in range(3):
                _, reply = await ask(http, wire, warm, script.next_prompt(), 64, False, extra)
                script.answer(reply.message)
            await delete_session(http, gateway, warm["id"])
        opened = {
            m: [await new_session(http, gateway, {"history": m}) for _ in range(sessions)]
            for m in HISTORY_MODES
        }
        scripts = {
            m: [CodingScript(start, result_chars) for _ in range(sessions)] for m in HISTORY_MODES
        }
        for t in range(turns):
            for mode in HISTORY_MODES if t % 2 == 0 else HISTORY_MODES[::-1]:
                for k in range(sessions):
                    prompt = scripts[mode][k].next_prompt()
                    await settle(pid)
                    cpu0 = cpu_seconds_fine(pid)
                    _, reply = await ask(http, wire, opened[mode][k], prompt, 64, False, extra)
                    await settle(pid)
                    run.cpu[mode][k].append(cpu_seconds_fine(pid) - cpu0)
                    scripts[mode][k].answer(reply.message)
                    if mode == "template" and k == 0:
                        run.prompt_tokens.append(reply.prompt_tokens)
            progress.advance(task)
        for mode in HISTORY_MODES:
            run.ends[mode] = [
                history_end(await session_view(http, gateway, s["id"])) for s in opened[mode]
            ]
            for s in opened[mode]:
                await delete_session(http, gateway, s["id"])
    progress.remove_task(task)
    return run


# ---- output ----------------------------------------------------------------------------------


def mark(ok: bool) -> str:
    return "[green]PASS[/green]" if ok else "[red]FAIL[/red]"


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f}"


async def metric_lines(gateway: str, prefix: str) -> list[str]:
    async with aiohttp.ClientSession() as http, http.get(f"{gateway}/metrics") as r:
        text = await r.text()
    return [line for line in text.splitlines() if line.startswith(prefix)]


def dialect_table(results: dict[int, dict[tuple[Mode, str], PathRun]]) -> Table:
    table = Table(title="straight to the engine vs through the gateway, per dialect (per turn)")
    for col in (
        "sessions",
        "mode",
        "dialect",
        "turns",
        "direct turns/s",
        "gateway turns/s",
        "ratio",
        "direct p50 ms",
        "gateway p50 ms",
        "added p50 ms",
        "added p99 ms",
        "gateway CPU ms/turn (median pass)",
        f"CPU vs {BASELINE} (per-round median)",
    ):
        table.add_column(col, justify="right")
    for n, runs in results.items():
        for mode in MODES:
            direct = runs[mode, "direct"]
            for d in DIALECTS:
                gw = runs[mode, d]
                table.add_row(
                    str(n),
                    mode,
                    d,
                    str(len(gw.latencies)),
                    f"{direct.rate:.1f}",
                    f"{gw.rate:.1f}",
                    f"{gw.rate / direct.rate:.3f}",
                    ms(statistics.median(direct.latencies)),
                    ms(statistics.median(gw.latencies)),
                    ms(statistics.median(gw.latencies) - statistics.median(direct.latencies)),
                    ms(pct(gw.latencies, 0.99) - pct(direct.latencies, 0.99)),
                    ms(gw.cpu_per_turn),
                    f"{statistics.median(paired_cpu_ratios(runs, mode, d)):.3f}",
                )
        table.add_section()
    return table


def at_turns(wanted: Sequence[int], turns: int) -> list[int]:
    return sorted({min(max(1, t), turns) for t in wanted})


def long_table(steps: dict[str, list[Step]], report: list[int], sessions: int) -> Table:
    table = Table(
        title=f"long sessions: Claude Code's first request + one tool call and result per turn, "
        f"{sessions} session(s) per dialect, stand-in engine (the gateway's cost only)"
    )
    for col in (
        "dialect",
        "turn",
        "prompt tokens",
        "body KB",
        "CPU ms (median)",
        "CPU ms (min-max)",
        "latency ms (median)",
        f"CPU vs turn {report[0]}",
    ):
        table.add_column(col, justify="left" if col == "dialect" else "right")
    for d, ss in steps.items():
        first = ss[report[0] - 1].cpu_median
        for t in report:
            s = ss[t - 1]
            table.add_row(
                d,
                str(t),
                str(s.prompt_tokens),
                f"{s.body_bytes / 1e3:.0f}",
                ms(s.cpu_median),
                f"{ms(min(s.cpu))}-{ms(max(s.cpu))}",
                ms(statistics.median(s.latency)),
                f"{s.cpu_median / first:.3f}",
            )
        table.add_section()
    return table


def case_name(case: HistoryCase) -> str:
    return case.template + "".join(f", {k}={v}" for k, v in case.kwargs.items())


def history_table(runs: Sequence[HistoryRun], report: list[int], half: int) -> Table:
    sessions = len(runs[0].cpu["tokens"])
    table = Table(
        title=f"history modes: Claude Code's first request + one tool call and result per turn, "
        f"{sessions} session(s) per mode, stand-in engine; gateway CPU per request (median over "
        f"the sessions and turns t-{half}..t+{half}; turn 1 alone)"
    )
    for col in (
        "template",
        "turn",
        "prompt tokens",
        "template ms",
        "tokens ms",
        "ratio tokens/template (paired)",
    ):
        table.add_column(col, justify="left" if col == "template" else "right")
    for run in runs:
        for t in report:
            table.add_row(
                case_name(run.case),
                str(t),
                str(run.prompt_tokens[t - 1]),
                ms(run.cpu_at("template", t, half)),
                ms(run.cpu_at("tokens", t, half)),
                f"{run.ratio_at(t, half):.3f}",
            )
        table.add_section()
    return table


def history_ends_table(runs: Sequence[HistoryRun]) -> Table:
    table = Table(title="history modes: each session after its last turn")
    for col in ("template", "mode", "turns", "samples", "turns from held tokens", "fallbacks"):
        table.add_column(col, justify="left" if col in ("template", "mode") else "right")
    for run in runs:
        turns = len(run.prompt_tokens)
        for mode in HISTORY_MODES:
            ends = run.ends[mode]
            reasons = sorted({r for e in ends for r in e.fallbacks})
            table.add_row(
                case_name(run.case),
                mode,
                str(turns),
                ", ".join(str(e.samples) for e in ends),
                ", ".join(str(e.token_turns) for e in ends),
                "; ".join(reasons) or "none",
            )
        table.add_section()
    return table


def history_checks(run: HistoryRun) -> list[tuple[str, str, str, bool]]:
    """(target, mode, value, ok): token history keeps a session one sample; template history
    does too, unless the case's template rewrites history (then it must split, else the
    bench is not measuring what it says)."""
    out = []
    for mode in HISTORY_MODES:
        counts = [e.samples for e in run.ends[mode]]
        value = ", ".join(map(str, counts))
        if mode == "tokens" or not run.case.splits:
            out.append(
                (
                    f"history, {case_name(run.case)}: 1 sample",
                    mode,
                    value,
                    counts == [1] * len(counts),
                )
            )
        else:
            target = f"history, {case_name(run.case)}: more than 1 sample (history rewritten)"
            out.append((target, mode, value, all(c > 1 for c in counts)))
    return out


def targets_table(
    results: dict[int, dict[tuple[Mode, str], PathRun]],
    same_ids: bool,
    steps: dict[str, list[Step]] | None,
    report: list[int],
    history: Sequence[HistoryRun] = (),
) -> tuple[Table, bool]:
    table = Table(title="targets")
    for col in ("target", "dialect", "mode", "value", ""):
        table.add_column(col, justify="right" if col == "value" else "left")
    passed = same_ids
    if results:
        table.add_row("same engine prompt ids in every dialect", "all", "both", "", mark(same_ids))

    def row(target: str, d: str, mode: str, value: str, ok: bool) -> None:
        nonlocal passed
        passed = passed and ok
        table.add_row(target, d, mode, value, mark(ok))

    for mode in MODES if results else ():
        low, high = min(results), max(results)
        for d in DIALECTS:
            runs = results[low]
            added = statistics.median(runs[mode, d].latencies) - statistics.median(
                runs[mode, "direct"].latencies
            )
            row(f"added p50 <= 1 ms ({low} session(s))", d, mode, f"{ms(added)} ms", added <= 1e-3)
        for d in DIALECTS:
            runs = results[high]
            ratio = runs[mode, d].rate / runs[mode, "direct"].rate
            row(f"throughput ratio >= 0.9 ({high} sessions)", d, mode, f"{ratio:.3f}", ratio >= 0.9)
        for d in DIALECTS[1:]:
            ratio = statistics.median(
                x for runs in results.values() for x in paired_cpu_ratios(runs, mode, d)
            )
            row(
                f"CPU/turn within 10% of {BASELINE}'s (median of per-round ratios, all levels)",
                d,
                mode,
                f"{ratio:.3f}",
                ratio <= 1 + MAX_CPU_VS_BASELINE,
            )
    if steps is not None:
        first, last = report[0], report[-1]
        for d, ss in steps.items():
            growth = ss[last - 1].cpu_median / ss[first - 1].cpu_median
            row(
                f"long session: turn {last} CPU within 20% of turn {first}'s",
                d,
                "plain",
                f"{growth:.3f}",
                growth <= 1 + MAX_LONG_GROWTH,
            )
    for run in history:
        for target, mode, value, ok in history_checks(run):
            row(target, "chat_completions", mode, value, ok)
    return table, passed


# ---- main ------------------------------------------------------------------------------------


# ---- part 5: worker processes ------------------------------------------------------------------


@dataclass
class WorkersRound:
    """One round of the workers part's load on one gateway."""

    turns: int
    elapsed: float
    cpu: float  # the gateway's processes (parent + workers), schedstat seconds, timed window
    rss: int  # growth over the round's sessions, bytes
    forwarded: int  # timed turns another worker took and forwarded to the owner
    owners: dict[int, int]  # sessions per worker
    journal_s: float = 0.0  # the journal's own time on the loop (its /metrics), timed window

    @property
    def rate(self) -> float:
        return self.turns / self.elapsed

    @property
    def cpu_per_turn(self) -> float:
        return self.cpu / self.turns


@dataclass
class WorkersGateway:
    """One ``corral gateway --workers N`` (with ``--journal`` or not) and its rounds."""

    name: str
    workers: int
    url: str
    pids: list[int]
    journal: Path | None = None
    rounds: list[WorkersRound] = field(default_factory=list)

    def median(self, value: str) -> float:
        return statistics.median(getattr(r, value) for r in self.rounds)


def gateway_pids(parent: int) -> list[int]:
    """The gateway's processes: ``parent`` and its children (the workers)."""
    children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    return [parent, *map(int, children)]


def _worker_of(session_id: str) -> int:
    head, dot, _ = session_id.partition(".")
    return int(head[1:]) if dot and head[:1] == "w" and head[1:].isdigit() else 0


async def worker_round(
    gw: WorkersGateway, sessions: int, turns: int, progress: Progress
) -> WorkersRound:
    """``sessions`` Chat Completions sessions at once, each answering the stand-in engine's
    tool call with a short result for ``turns`` turns; turn 1 (the whole prompt encoded) is
    untimed; the sessions are deleted at the end (so every round starts from the same
    state)."""
    system = "You are a coding agent. Read files with the Read tool, then answer."
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession(connector=_connector()) as http:
        rss0 = sum(rss_bytes(p) for p in gw.pids)
        made = await asyncio.gather(*(new_session(http, gw.url) for _ in range(sessions)))
        convs = [
            [{"role": "system", "content": system}, {"role": "user", "content": f"task {k}"}]
            for k in range(sessions)
        ]
        forwarded = 0
        task = progress.add_task(f"{gw.name}: {sessions} sessions", total=sessions * turns)

        async def turn(k: int, timed: bool) -> None:
            nonlocal forwarded
            s, messages = made[k], convs[k]
            body = json.dumps({"model": MODEL_NAME, "messages": messages, "max_tokens": 32})
            headers = {"Authorization": f"Bearer {s['api_key']}"}
            headers["Content-Type"] = "application/json"
            async with http.post(
                f"{s['base_url']}/chat/completions", data=body.encode(), headers=headers
            ) as r:
                raw = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"turn answered {r.status}: {raw.decode()[:500]}")
                if timed and "x-corral-forwarded-by" in r.headers:
                    forwarded += 1
            message = json.loads(raw)["choices"][0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or []:
                result = f"line {len(messages)}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            progress.advance(task)

        await asyncio.gather(*(turn(k, False) for k in range(sessions)))
        for p in gw.pids:
            await settle(p)
        journal0 = await journal_seconds(http, gw) if gw.journal is not None else 0.0
        cpu0 = sum(cpu_seconds_fine(p) for p in gw.pids)
        t0 = time.perf_counter()

        async def rest(k: int) -> None:
            for _ in range(turns - 1):
                await turn(k, True)

        await asyncio.gather(*(rest(k) for k in range(sessions)))
        elapsed = time.perf_counter() - t0
        cpu = sum(cpu_seconds_fine(p) for p in gw.pids) - cpu0
        journal_s = (await journal_seconds(http, gw) - journal0) if gw.journal is not None else 0.0
        rss = sum(rss_bytes(p) for p in gw.pids) - rss0
        owners: dict[int, int] = {}
        for s in made:
            owners[_worker_of(s["id"])] = owners.get(_worker_of(s["id"]), 0) + 1

        async def delete(s: dict[str, Any]) -> None:
            async with http.delete(f"{gw.url}/sessions/{s['id']}", headers=admin) as r:
                r.raise_for_status()

        await asyncio.gather(*(delete(s) for s in made))
        progress.remove_task(task)
    return WorkersRound(
        sessions * (turns - 1), elapsed, cpu, rss, forwarded, owners, journal_s=journal_s
    )


async def journal_seconds(http: aiohttp.ClientSession, gw: WorkersGateway) -> float:
    """The journal's time on the gateway's loop so far, summed over workers (/metrics)."""
    async with http.get(f"{gw.url}/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("corral_gateway_journal_seconds_total")
    )


@contextmanager
def workers_gateway(
    name: str,
    model: str,
    env: dict[str, str],
    stand_in: str,
    workers: int,
    sessions: int,
    journal: Path | None = None,
) -> Iterator[WorkersGateway]:
    gp = free_port()
    url = f"http://127.0.0.1:{gp}"
    argv = [
        *(sys.executable, "-m", "corral.cli", "gateway"),
        *("--engine-url", stand_in, "--model", model, "--port", str(gp)),
        *("--admin-token-var", ADMIN_VAR, "--served-model-name", MODEL_NAME),
        *("--workers", str(workers), "--log-level", "warning"),
        *("--max-sessions", str(2 * sessions)),
    ]
    if journal is not None:
        argv += ["--journal", str(journal), "--journal-sync", "interval"]
    with process(argv, env, f"{url}/health") as proc:
        yield WorkersGateway(name, workers, url, gateway_pids(proc.pid), journal)


def workers_part(args: argparse.Namespace, env: dict[str, str], console: Console) -> None:
    """Part 5: ``corral gateway --workers N`` for each N, and ``--journal`` at the first N, all
    started at once in front of one stand-in engine, then ``--workers-rounds`` rounds in
    which each gateway in turn (the order rotating) plays the same load: medians over the
    rounds; ratios are the medians of per-round ratios (within a round they ran back to back,
    the machine about the same)."""
    model = args.model or str(cached_tiny_model("qwen25"))
    sp = free_port()
    stand_in = f"http://127.0.0.1:{sp}"
    me = [sys.executable, str(Path(__file__).resolve()), "--model", model]
    n = args.workers_sessions
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            process([*me, "--serve", "stand-in", "--port", str(sp)], env, f"{stand_in}/health")
        )
        gateways = [
            stack.enter_context(workers_gateway(f"--workers {w}", model, env, stand_in, w, n))
            for w in args.workers
        ]
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-j-")))
        journaled = stack.enter_context(
            workers_gateway(
                f"--workers {args.workers[0]} --journal",
                model,
                env,
                stand_in,
                args.workers[0],
                n,
                folder / "journal",
            )
        )
        everyone = [*gateways, journaled]
        progress = stack.enter_context(Progress(console=console, transient=True))
        for r in range(args.workers_rounds):
            for gw in everyone[r % len(everyone) :] + everyone[: r % len(everyone)]:
                gw.rounds.append(asyncio.run(worker_round(gw, n, args.workers_turns, progress)))
        journal_bytes = sum(
            f.stat().st_size for f in (folder / "journal").rglob("*") if f.is_file()
        )
    base = gateways[0]

    def paired(gw: WorkersGateway, value: str) -> float:
        return statistics.median(
            getattr(a, value) / getattr(b, value)
            for a, b in zip(gw.rounds, base.rounds, strict=True)
        )

    table = Table(
        title=f"corral gateway --workers N: {n} concurrent sessions, {args.workers_turns - 1} "
        f"timed turns each (Chat Completions, stand-in engine), median of "
        f"{args.workers_rounds} rounds; {os.cpu_count()} cores shared by the gateway, the load "
        "generator and the engine"
    )
    for col in (
        "workers",
        "turns/s",
        f"vs --workers {base.workers}",
        "CPU ms/turn",
        f"CPU vs --workers {base.workers}",
        "forwarded",
        "sessions per worker (round 1)",
        "RSS kB/session (round 1)",
    ):
        table.add_column(col, justify="right")
    for gw in gateways:
        first = gw.rounds[0]
        table.add_row(
            str(gw.workers),
            f"{gw.median('rate'):.0f}",
            f"{paired(gw, 'rate'):.2f}x",
            f"{gw.median('cpu_per_turn') * 1e3:.2f}",
            f"{paired(gw, 'cpu_per_turn'):.2f}x",
            f"{statistics.median(r.forwarded / r.turns for r in gw.rounds):.0%}",
            " ".join(str(first.owners.get(k, 0)) for k in range(gw.workers)),
            f"{first.rss / n / 1e3:.1f}",
        )
    console.print(table)
    # The journal's share of its gateway's CPU, measured inside the same run (its own time on
    # the loop, from /metrics, over the gateway processes' CPU): free of the run-to-run noise
    # that the paired comparison with the journal-less gateway carries on a shared machine.
    share = statistics.median(r.journal_s / r.cpu for r in journaled.rounds)
    extra = paired(journaled, "cpu_per_turn") - 1
    per_round = ", ".join(
        f"{a.cpu_per_turn / b.cpu_per_turn - 1:+.0%}"
        for a, b in zip(journaled.rounds, base.rounds, strict=True)
    )
    table = Table(title=f"the journal's cost at --workers {base.workers} (same load, same rounds)")
    for col in (
        "run",
        "turns/s",
        "CPU ms/turn",
        "journal ms/turn",
        "journal / turn CPU",
        "CPU vs no journal",
        "journal B/turn",
    ):
        table.add_column(col, justify="right")
    table.add_row(
        "no journal", f"{base.median('rate'):.0f}", f"{base.median('cpu_per_turn') * 1e3:.2f}"
    )
    turns = sum(r.turns + n for r in journaled.rounds)  # the untimed first turns wrote too
    table.add_row(
        "--journal-sync interval",
        f"{journaled.median('rate'):.0f}",
        f"{journaled.median('cpu_per_turn') * 1e3:.2f}",
        f"{statistics.median(r.journal_s / r.turns for r in journaled.rounds) * 1e3:.3f}",
        f"{share:.1%} (target < 10%) {mark(share < 0.1)}",
        f"{extra:+.1%} (rounds: {per_round})",
        f"{journal_bytes / turns:.0f} (live)" if journal_bytes else "0 (compacted away)",
    )
    console.print(table)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run (about 4 minutes on 2 cores): 1 and 16 sessions, fewer rounds, "
        "2 long sessions per dialect, small memory fill, 1 history session per mode; explicit "
        "flags still win",
    )
    parser.add_argument("--sessions", type=int, nargs="+", help="concurrencies (default 1 64)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument(
        "--max-tokens", type=int, default=48, help="output tokens per turn, at most"
    )
    parser.add_argument("--min-turns", type=int, help="turns per path and level, at least (400)")
    parser.add_argument("--model", help="model folder (default: build the tiny model)")
    parser.add_argument("--long-sessions", type=int, help="long sessions per dialect (8)")
    parser.add_argument("--long-turns", type=int, default=128, help="turns per long session")
    parser.add_argument(
        "--long-report", type=int, nargs="+", default=[1, 32, 128], help="turns to report"
    )
    parser.add_argument(
        "--long-result-chars", type=int, default=600, help="characters of each tool result"
    )
    parser.add_argument("--skip-long", action="store_true", help="no long-session part")
    parser.add_argument(
        "--history-sessions", type=int, help="sessions per history mode and template (3)"
    )
    parser.add_argument(
        "--history-turns", type=int, default=128, help="turns per history-mode session"
    )
    parser.add_argument(
        "--history-report", type=int, nargs="+", default=[1, 32, 128], help="turns to report"
    )
    parser.add_argument(
        "--history-window",
        type=int,
        default=2,
        help="turns pooled on each side of a reported turn (turn 1 stands alone)",
    )
    parser.add_argument(
        "--history-result-chars",
        type=int,
        default=400,
        help="characters of each tool result in the history-mode sessions",
    )
    parser.add_argument("--skip-history", action="store_true", help="no history-mode part")
    parser.add_argument(
        "--only-history",
        action="store_true",
        help="the history-mode part alone (no dialects, long sessions or memory)",
    )
    parser.add_argument("--memory-sessions", type=int, help="sessions for the memory fill (32)")
    parser.add_argument("--memory-turns", type=int, help="turns per memory session (30)")
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        help="part 5 alone: corral gateway --workers N for each N (e.g. 1 2 4), then the "
        "journal's cost at the first",
    )
    parser.add_argument(
        "--workers-sessions", type=int, default=1000, help="concurrent sessions in part 5"
    )
    parser.add_argument(
        "--workers-turns", type=int, default=5, help="turns per session in part 5 (1 untimed)"
    )
    parser.add_argument(
        "--workers-rounds", type=int, default=3, help="rounds of part 5's load per gateway"
    )
    # The bench's own child processes.
    parser.add_argument("--serve", choices=["gateway", "stand-in"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--engine-url", help=argparse.SUPPRESS)
    parser.add_argument("--max-context-tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    defaults = {
        "sessions": ([1, 16], [1, 64]),
        "min_turns": (80, 400),
        "long_sessions": (2, 8),
        "history_sessions": (1, 3),
        "memory_sessions": (8, 32),
        "memory_turns": (10, 30),
    }
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


LONG_CONTEXT = 4_000_000  # the context of the stand-in gateways: no session hits it


@contextmanager
def stand_in_gateway(model: str, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """A gateway (a child process of this script, with the context set) in front of a stand-in
    engine, both over ``model``'s tokenizer: (the gateway's URL, its pid)."""
    sp, gp = free_port(), free_port()
    stand_in = f"http://127.0.0.1:{sp}"
    gateway = f"http://127.0.0.1:{gp}"
    me = [sys.executable, str(Path(__file__).resolve()), "--model", model]
    with (
        process([*me, "--serve", "stand-in", "--port", str(sp)], env, f"{stand_in}/health"),
        process(
            [
                *me,
                *("--serve", "gateway", "--port", str(gp), "--engine-url", stand_in),
                *("--max-context-tokens", str(LONG_CONTEXT)),
            ],
            env,
            f"{gateway}/health",
        ) as proc,
    ):
        yield gateway, proc.pid


def dialect_part(
    args: argparse.Namespace,
    model: str,
    renderer: GatewayRenderer,
    env: dict[str, str],
    console: Console,
) -> tuple[dict[int, dict[tuple[Mode, str], PathRun]], list[str]]:
    """Parts 1 and 3 of the module's docstring: (per concurrency, every path's runs; the prompt
    id differences found)."""
    tools = weather_tools()
    corral = [sys.executable, "-m", "corral.cli"]
    results: dict[int, dict[tuple[Mode, str], PathRun]] = {}
    problems: list[str] = []
    ep, gp = free_port(), free_port()
    engine = f"http://127.0.0.1:{ep}"
    gateway = f"http://127.0.0.1:{gp}"
    gateway_args = [
        *corral,
        "gateway",
        *("--engine-url", engine, "--model", model, "--port", str(gp)),
        *("--admin-token-var", ADMIN_VAR),
    ]
    with (
        process([*corral, "engine", "--model", model, "--port", str(ep)], env, f"{engine}/health"),
        process(gateway_args, env, f"{gateway}/health") as gw_proc,
        Progress(console=console, transient=True) as progress,
    ):
        checked, found = asyncio.run(
            check_recorded(gateway, renderer, args.turns, args.max_tokens, tools)
        )
        problems += found
        table = Table(title="the same conversation played in each dialect, one turn at a time")
        for col in ("dialect", "turns whose prompt ids start a recorded sample", "recorded"):
            table.add_column(col)
        for d, (hits, turns, same) in checked.items():
            same_text = "same tokens as chat_completions" if same else "[red]differs[/red]"
            table.add_row(d, f"{hits} of {turns}", same_text)
        console.print(table)
        for n in args.sessions:
            played = asyncio.run(
                record_conversations(gateway, n, args.turns, args.max_tokens, tools)
            )
            conversations, found = render_turns(renderer, played, args.max_tokens)
            problems += found
            results[n] = measure_level(
                engine, gateway, gw_proc.pid, conversations, args, tools, progress
            )
        console.print(
            f"prompt ids: every warm-up turn ({sum(args.sessions) * args.turns} per dialect) "
            f"rendered by the gateway's code for each dialect; "
            f"{'all equal' if not problems else f'{len(problems)} difference(s)'}"
        )
        for line in problems[:10]:
            console.print(f"[red]{line}[/red]")
        console.print(dialect_table(results))
        gateway_runs = [
            r for runs in results.values() for (_, p), r in runs.items() if p != "direct"
        ]
        console.print(
            f"gateway CPU over these passes: {sum(r.cpu for r in gateway_runs):.2f} s by "
            f"schedstat (used above), {sum(r.cpu_ticks for r in gateway_runs):.2f} s by "
            "utime + stime"
        )
        decisions = asyncio.run(metric_lines(gateway, "corral_gateway_merge_"))
        console.print("merge decisions during the benchmark: " + "; ".join(decisions))

        before = rss_bytes(gw_proc.pid)
        tokens = asyncio.run(fill_sessions(gateway, args.memory_sessions, args.memory_turns, tools))
        after = rss_bytes(gw_proc.pid)
        console.print(
            f"memory: {args.memory_sessions} sessions x {args.memory_turns} turns hold "
            f"{tokens} tokens; gateway RSS +{(after - before) / 1e6:.1f} MB = "
            f"{(after - before) / args.memory_sessions / 1e3:.1f} kB per session, "
            f"{(after - before) / max(tokens, 1):.1f} B per held token"
        )
    return results, problems


def long_part(
    args: argparse.Namespace,
    model: str,
    renderer: GatewayRenderer,
    env: dict[str, str],
    console: Console,
    report: list[int],
) -> tuple[dict[str, list[Step]], list[str]]:
    """Part 2: (per dialect, the long sessions' turns; the prompt id differences found)."""
    problems: list[str] = []
    start = claude_code_start()
    first = {d: renderer.prompt_ids(d, start, 64) for d in DIALECTS}
    for d in DIALECTS[1:]:
        if first[d] != first[BASELINE]:
            problems.append(
                f"Claude Code's first request, {d} vs {BASELINE}: "
                + renderer.difference(first[d], first[BASELINE])
            )
            console.print(f"[red]{problems[-1]}[/red]")
    with (
        stand_in_gateway(model, env) as (gateway, pid),
        Progress(console=console, transient=True) as progress,
    ):
        steps = asyncio.run(
            long_sessions(
                gateway,
                pid,
                args.long_sessions,
                args.long_turns,
                args.long_result_chars,
                progress,
            )
        )
        decisions = asyncio.run(metric_lines(gateway, "corral_gateway_merge_"))
    same_first = all(first[d] == first[BASELINE] for d in DIALECTS)
    console.print(
        f"Claude Code's first request: {len(first[BASELINE])} prompt ids, "
        f"{'the same' if same_first else 'NOT the same'} in every dialect"
    )
    console.print(long_table(steps, report, args.long_sessions))
    console.print("long-session merge decisions: " + "; ".join(decisions))
    return steps, problems


def history_part(
    args: argparse.Namespace, env: dict[str, str], console: Console
) -> list[HistoryRun]:
    """Part 4: both history modes, per tiny template (its own stand-in engine and gateway)."""
    runs = []
    report = at_turns(args.history_report, args.history_turns)
    for case in HISTORY_CASES:
        # Untrained weights do: the stand-in engine answers, the model folder gives only the
        # tokenizer and its template.
        model = str(cached_tiny_model(case.template, imprint=False))
        with (
            stand_in_gateway(model, env) as (gateway, pid),
            Progress(console=console, transient=True) as progress,
        ):
            runs.append(
                asyncio.run(
                    history_sessions(
                        gateway,
                        pid,
                        args.history_sessions,
                        args.history_turns,
                        args.history_result_chars,
                        case,
                        progress,
                    )
                )
            )
    console.print(history_table(runs, report, args.history_window))
    console.print(history_ends_table(runs))
    return runs


def main() -> int:
    args = parse_args()
    if args.serve == "gateway":
        serve_gateway(args.engine_url, args.model, args.port, args.max_context_tokens)
        return 0
    if args.serve == "stand-in":
        serve_stand_in(args.model, args.port)
        return 0
    # Wide enough for the tables when the output goes to a file or a pipe.
    console = Console(width=None if sys.stdout.isatty() else 200)
    started = time.perf_counter()
    console.print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start "
        "(other jobs on this machine share the cores)"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", ADMIN_VAR: ADMIN}
    results: dict[int, dict[tuple[Mode, str], PathRun]] = {}
    problems: list[str] = []
    steps = None
    report = at_turns(args.long_report, args.long_turns)
    if args.workers:
        workers_part(args, env, console)
        console.print(f"took {time.perf_counter() - started:.0f} s")
        return 0
    if not args.only_history:
        model = args.model
        if model is None:
            console.print("the tiny model (built once, then cached) ...")
            model = str(cached_tiny_model("qwen25"))
        renderer = GatewayRenderer(model, max(model_context_length(model), LONG_CONTEXT))
        results, problems = dialect_part(args, model, renderer, env, console)
        if not args.skip_long:
            steps, found = long_part(args, model, renderer, env, console, report)
            problems += found
    history = [] if args.skip_history else history_part(args, env, console)

    table, passed = targets_table(results, not problems, steps, report, history)
    console.print(table)
    console.print(f"took {time.perf_counter() - started:.0f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
