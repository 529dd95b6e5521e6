"""Render OpenAI chat requests into prompt token ids with the model's own chat template.

The gateway renders the template itself and sends token ids, so the tokens it records are
exactly the tokens the engine saw. Rendering is deterministic for a given tokenizer, template
and input, which is what lets later turns be checked against the tokens already held.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    return [m.to_turn().template() for m in messages]


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


@dataclass
class HeldPrompt:
    """A prompt already encoded for a session: its text, its ids, and where the boundary
    marker's occurrences sit among the ids (token indices, in order)."""

    text: str
    ids: array[int]
    marker_at: list[int] = field(default_factory=list)


class PrefixEncoder:
    """Encodes a prompt reusing the ids of an earlier prompt that shares its beginning.

    A coding agent's session resends a growing conversation every turn; encoding all of it
    again costs more the longer the session runs. Here the new text is compared with the held
    prompts' texts, and only the text from the last *boundary* inside the shared part is
    encoded; the ids before it are the held ones. A boundary is an occurrence of the marker: a
    special added token (``<|im_start|>`` for ChatML) matched on the raw text, never stripping
    its neighbours. Hugging Face tokenizers split such tokens out of the text before anything
    else, so the text on either side encodes on its own and the joined ids are exactly those of
    a full encoding. A tokenizer with no such token encodes in full every time.

    ``keep`` bounds the held prompts per session (a side conversation must not evict the main
    one). Thread-safe as long as one session's ``held`` list is used by one call at a time.
    """

    def __init__(self, renderer: ChatRenderer, *, keep: int = 3) -> None:
        self.renderer = renderer
        self.keep = keep
        self.marker, self.marker_id = _boundary_marker(renderer.tokenizer)

    def encode(self, text: str, held: list[HeldPrompt]) -> list[int]:
        """The ids of ``text`` (as :meth:`ChatRenderer.encode` gives them); ``held`` is
        updated in place with this prompt, most recent first."""
        if self.marker is None:
            return self.renderer.encode(text)
        best: HeldPrompt | None = None
        best_shared = 0
        for prompt in held:
            shared = _shared_prefix(prompt.text, text)
            if shared > best_shared:
                best, best_shared = prompt, shared
        # Reused: the held ids before ``start_token``, the text's first ``start_char``
        # characters, holding the marker's first ``kept`` occurrences.
        start_char = start_token = kept = 0
        if best is not None:
            # The last marker that starts inside the shared text and whose token is held.
            cut = text.rfind(self.marker, 0, best_shared - len(self.marker) + 1)
            if cut > 0:
                occurrence = text.count(self.marker, 0, cut)
                if occurrence < len(best.marker_at):
                    start_char, start_token, kept = cut, best.marker_at[occurrence], occurrence
        tail = self.renderer.encode(text[start_char:])
        ids = array("i", best.ids[:start_token]) if best is not None else array("i")
        ids.extend(tail)
        marker_at = list(best.marker_at[:kept]) if best is not None else []
        marker_at.extend(start_token + i for i, t in enumerate(tail) if t == self.marker_id)
        prompt = HeldPrompt(text=text, ids=ids, marker_at=marker_at)
        # The prompt this one extends is superseded by it; any other stays (a side
        # conversation must not evict the main one) until the oldest falls off.
        superseded = best if best is not None and best_shared == len(best.text) else None
        held[:] = [prompt, *(p for p in held if p is not superseded)][: self.keep]
        return ids.tolist()


def _boundary_marker(tokenizer: PreTrainedTokenizerBase) -> tuple[str | None, int | None]:
    """The special added token that starts every message of the template, if any."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    candidates = {
        token.content: token_id
        for token_id, token in decoder.items()
        if token.special
        and not (token.lstrip or token.rstrip or token.single_word)
        and not token.normalized
    }
    if not candidates:
        return None, None
    try:
        sample = tokenizer.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            tokenize=False,
        )
    except Exception:  # a template that refuses the probe: no incremental encoding
        return None, None
    counts = {content: str(sample).count(content) for content in candidates}
    content = max(counts, key=lambda c: counts[c])
    if counts[content] < 2:
        return None, None
    return content, candidates[content]


def _shared_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings, compared in slices (C speed)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo], a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
