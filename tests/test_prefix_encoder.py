"""``PrefixEncoder``: a growing conversation is encoded from where it changed, and the ids are
always exactly those of a full encoding (both tiny templates, unicode, side conversations
interleaved, histories rewritten)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from corral.gateway.rendering import ChatRenderer, HeldPrompt, PrefixEncoder

FIXTURE = Path(__file__).parent / "fixtures" / "agent_requests" / "claude_code_messages.json"
TEXTS = [
    "fix foo.py",
    "naïve café ☕ — 日本語",
    "a\u0301 combining",
    "",
    "line\nbreaks\n\n",
    "<think>x",
]


def _encoders(model: Path) -> tuple[ChatRenderer, PrefixEncoder, list[int]]:
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(model)))
    encoded: list[int] = []
    plain = renderer.encode

    def counting(text: str) -> list[int]:
        encoded.append(len(text))
        return plain(text)

    renderer.encode = counting  # type: ignore[method-assign]
    return renderer, PrefixEncoder(renderer), encoded


@pytest.mark.parametrize("which", ["tiny_model_dir", "tiny_think_model_dir"])
def test_incremental_ids_equal_a_full_encoding(which: str, request: pytest.FixtureRequest) -> None:
    renderer, encoder, encoded = _encoders(request.getfixturevalue(which))
    assert encoder.marker == "<|im_start|>"
    rng = random.Random(7)
    main: list[dict[str, Any]] = [{"role": "system", "content": "You are a coder. " * 200}]
    side: list[dict[str, Any]] = [{"role": "system", "content": "Write a title."}]
    held: list[HeldPrompt] = []
    edited = False  # since the main conversation was last encoded
    for turn in range(40):
        main.append({"role": "user", "content": rng.choice(TEXTS) + str(turn)})
        conversation = main
        if turn % 7 == 3:  # a side request between two main turns
            conversation = [*side, {"role": "user", "content": rng.choice(TEXTS)}]
        if turn % 11 == 5:  # the client rewrites an earlier message
            main[1]["content"] += " (edited)"
            edited = True
        text = renderer.render_text(conversation, None)
        encoded.clear()
        ids = encoder.encode(text, held)
        assert ids == ChatRenderer.encode(renderer, text), turn
        if conversation is main:
            if turn > 1 and not edited:
                assert sum(encoded) < len(text) / 4, (turn, encoded, len(text))
            edited = False
        main.append({"role": "assistant", "content": rng.choice(TEXTS)})
    assert len(held) <= encoder.keep


def test_a_coding_agents_first_request_then_a_growing_session(tiny_model_dir: Path) -> None:
    renderer, encoder, encoded = _encoders(tiny_model_dir)
    body = json.loads(FIXTURE.read_text())
    system = "\n".join(block["text"] for block in body["system"])
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "parameters": t["input_schema"]},
        }
        for t in body["tools"]
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "fix the bug"},
    ]
    held: list[HeldPrompt] = []
    for turn in range(12):
        text = renderer.render_text(messages, tools)
        encoded.clear()
        assert encoder.encode(text, held) == ChatRenderer.encode(renderer, text)
        if turn:
            assert sum(encoded) < 2_000  # only the new turn, not the 40 KB of tools
        call = {"id": f"c{turn}", "type": "function"}
        call["function"] = {"name": "Bash", "arguments": {"command": f"cat f{turn}.py"}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{turn}", "content": "x = 1\n" * 30})
