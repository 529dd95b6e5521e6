"""Render OpenAI chat requests into prompt token ids with the model's own chat template.

The gateway renders the template itself and sends token ids, so the tokens it records are
exactly the tokens the engine saw. Rendering is deterministic for a given tokenizer, template
and input, which is what lets later turns be checked against the tokens already held.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from corral.gateway.openai_types import ChatMessage, ToolDef


class TemplateError(ValueError):
    """The chat template could not render the conversation (the message says why)."""


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    token_ids: list[int]
    # Text forced after the generation prompt (tool_choice); part of the prompt, never sampled.
    prefill: str


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages in the form Hugging Face chat templates expect.

    Tool-call arguments become objects (templates serialise them with ``tojson``); arguments
    that are not a JSON object stay strings, which the template renders as written.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        d["content"] = m.text()
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            calls = []
            for call in m.tool_calls:
                try:
                    args: Any = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    args = call.function.arguments
                if not isinstance(args, dict):
                    args = call.function.arguments
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": args},
                    }
                )
            d["tool_calls"] = calls
        out.append(d)
    return out


def template_tools(tools: Sequence[ToolDef] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template.

    ``default_kwargs`` (e.g. ``{"enable_thinking": False}``) apply to every render; a
    request's ``chat_template_kwargs`` win over them.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, default_kwargs: dict[str, Any] | None = None
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.default_kwargs = dict(default_kwargs or {})
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        merged = {**self.default_kwargs, **(kwargs or {})}
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,  # type: ignore[arg-type]
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **merged,
            )
        except Exception as exc:  # jinja raises its own types, templates raise anything
            raise TemplateError(f"the chat template failed: {exc}") from exc
        if not isinstance(text, str):
            raise TemplateError("the chat template did not render text")
        return text

    def encode(self, text: str) -> list[int]:
        # The rendered text already holds the template's special tokens; add none. The fast
        # tokenizer's Rust backend is called directly: the Python wrapper costs more than the
        # encoding itself on the gateway's hot path.
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None = None,
        *,
        prefill: str = "",
    ) -> RenderedPrompt:
        text = self.render_text(messages, tools, kwargs) + prefill
        return RenderedPrompt(token_ids=self.encode(text), prefill=prefill)

    def message_at(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
        position: int,
    ) -> int:
        """Index of the message whose rendered tokens hold token ``position``, for explaining
        drift.

        Binary search over rendered prefixes of the conversation: O(log n) renders, and the
        gateway asks only when a turn forks. A prefix the template refuses (some insist on a
        user message) counts as starting at 0.
        """

        def start(k: int) -> int:
            if k == 0:
                return 0
            try:
                text = self.render_text(messages[:k], tools, kwargs, add_generation_prompt=False)
            except TemplateError:
                return 0
            return len(self.encode(text))

        lo, hi = 0, len(messages) - 1  # invariant: start(lo) <= position
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if start(mid) <= position:
                lo = mid
            else:
                hi = mid - 1
        return lo
