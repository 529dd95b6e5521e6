"""Rendering and incremental detokenization against the tiny model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from corral.gateway.detokenize import IncrementalDetokenizer
from corral.gateway.openai_types import ChatMessage
from corral.gateway.rendering import ChatRenderer, TemplateError, template_messages


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("text", ["Hello, world!", "naïve café — 東京 🌦️ ok", "<tool_call>\n{}"])
def test_detokenizer_streams_exactly_the_full_decode(tokenizer: object, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    for step in (1, 2, 3):
        detok = IncrementalDetokenizer(tokenizer)  # type: ignore[arg-type]
        pieces = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
        pieces.append(detok.flush())
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)  # a split character is held back


def test_template_messages_turn_arguments_into_objects_and_keep_bad_ones() -> None:
    messages = [
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "a",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    },
                    {
                        "id": "b",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{x: 1"},
                    },
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}},
                ],
            }
        ),
        ChatMessage.model_validate(
            {
                "role": "developer",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ),
    ]
    out = template_messages(messages)
    args = [c["function"]["arguments"] for c in out[0]["tool_calls"]]
    assert args == [{"x": 1}, "{x: 1", "[1]"]
    assert out[1] == {"role": "system", "content": "ab"}


def test_message_at_finds_the_message_holding_a_token(tokenizer: object) -> None:
    renderer = ChatRenderer(tokenizer)  # type: ignore[arg-type]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again."},
    ]
    ids = renderer.render(messages, None).token_ids
    starts = [
        len(renderer.encode(renderer.render_text(messages[:k], None, add_generation_prompt=False)))
        for k in range(1, len(messages))
    ]
    expected = [sum(p >= s for s in starts) for p in range(len(ids))]
    assert [renderer.message_at(messages, None, None, p) for p in range(len(ids))] == expected
    assert expected[0] == 0 and expected[-1] == 3 and sorted(expected) == expected


def test_renderer_reports_template_failures(tokenizer: object) -> None:
    renderer = ChatRenderer(tokenizer)  # type: ignore[arg-type]
    with pytest.raises(TemplateError, match="chat template failed"):
        renderer.render([{"role": "user", "content": {"not": "text"}}], None)
