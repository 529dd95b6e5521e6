"""Anthropic Messages on the wire: the request, answer and stream-event models, and which of
Anthropic's fields the gateway ignores or refuses. The translation to and from the turn
pipeline is :mod:`corral.gateway.dialects.anthropic_messages`."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from corral.gateway.errors import bad_request

# Fields accepted and ignored: each changes nothing for a self-hosted text model, or asks for
# something the gateway does anyway. Dotted paths; ``[]`` is any entry of a list.
IGNORED_FIELDS: MappingProxyType[str, str] = MappingProxyType(
    {
        "cache_control": "prompt caching is Anthropic's; the engine's prefix cache needs no hints",
        "system[].cache_control": "as cache_control",
        "messages[].content[].cache_control": "as cache_control",
        "tools[].cache_control": "as cache_control",
        "context_management": "the client's conversation is rendered as sent; nothing is edited",
        "diagnostics": "there is no prompt cache to diagnose",
        "output_config.effort": "one model, one effort",
        "thinking.budget_tokens": "reasoning length is not capped apart from max_tokens",
        "thinking.display": "reasoning is always returned in full, so that it renders back",
        "metadata": "the user id is Anthropic's abuse tracking",
        "service_tier": "one tier",
        "speed": "one speed",
        "inference_geo": "one place",
        "fallbacks": "one model: nothing to fall back to",
        "fallback_credit_token": "billing",
        "billing_policy": "billing",
        "user_profile_id": "accounts",
        "workspace_id": "accounts",
        "betas": "features are chosen by the fields sent, not by flags",
        "tools[].strict": "tool inputs are parsed from the model's text, never enforced",
        "tools[].eager_input_streaming": "tool inputs stream as they are parsed",
        "tools[].defer_loading": "every tool is offered up front (no deferred loading)",
        "messages[].content[].citations": "citations render nothing",
        "messages[].content[].caller": "only direct calls exist here",
        "messages[].content[].signature": "nothing is signed",
        "messages[].content[].toolset_name": "no toolsets exist here",
    }
)
_IGNORED_TOP = frozenset(k for k in IGNORED_FIELDS if "." not in k and "[" not in k)

# Fields of Anthropic's API that ask for what the gateway cannot do: a 400 each, saying why.
_REFUSED_TOP = MappingProxyType(
    {
        "container": "the gateway runs no code-execution containers",
        "mcp_servers": "the gateway connects the model to no MCP servers; give the agent the tools",
        "compaction": "the gateway does not compact conversations; the client must",
        "thread": "the gateway keeps no server-side threads; send the conversation",
    }
)


# ---- request models ---------------------------------------------------------------------------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlockIn(_Wire):
    type: Literal["text"]
    text: str
    cache_control: Any = None  # ignored (IGNORED_FIELDS)
    citations: list[Any] | None = None  # ignored


class DirectCaller(_Wire):
    type: Literal["direct"]


class ToolUseBlockIn(_Wire):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: Any = None
    caller: DirectCaller | None = None  # a code-execution caller cannot have been ours
    toolset_name: str | None = None


class ToolResultBlockIn(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    # Blocks are checked one by one (text only), to name what is refused.
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False
    cache_control: Any = None
    toolset_name: str | None = None


class ThinkingBlockIn(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # Anthropic requires it; nothing here checks it
    cache_control: Any = None


class RedactedThinkingBlockIn(_Wire):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: Any = None


class MessageIn(_Wire):
    role: Literal["user", "assistant", "system"]
    # Blocks are checked one by one by their type, to name what is refused.
    content: str | list[dict[str, Any]]


class ToolIn(_Wire):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Any = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    # Only "direct" means anything here; checked in ``_tool``.
    allowed_callers: list[str] | None = None


class ToolChoiceIn(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _check_name(self) -> ToolChoiceIn:
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs 'name'")
        if self.type != "tool" and self.name is not None:
            raise ValueError(f"a tool_choice of type '{self.type}' takes no 'name'")
        return self


class ThinkingIn(_Wire):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None  # ignored
    display: Literal["summarized", "omitted"] | None = None  # ignored: always in full


class OutputFormatIn(_Wire):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfigIn(_Wire):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # ignored
    format: OutputFormatIn | None = None


class MessagesRequest(BaseModel):
    """A ``/v1/messages`` body. Extra fields are sorted by :meth:`check_extra_fields`."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    # Required by /v1/messages, absent from count_tokens: checked by the parser.
    max_tokens: int | None = Field(default=None, ge=1)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlockIn] | None = None
    # Entries are checked one by one (``_tool``), to name Anthropic's own tools.
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoiceIn | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    thinking: ThinkingIn | None = None
    output_config: OutputConfigIn | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops_not_empty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop sequences must not be empty")
        return v

    def check_extra_fields(self) -> None:
        """Raise a 400 for an extra field that is refused or unknown; ignored ones pass."""
        for key in self.model_extra or {}:
            if key in _IGNORED_TOP:
                continue
            if key in _REFUSED_TOP:
                raise bad_request(
                    f"unsupported field '{key}': {_REFUSED_TOP[key]}",
                    param=key,
                    code="unsupported_field",
                )
            raise bad_request(
                f"unknown field '{key}': not part of Anthropic's Messages API as this "
                "gateway knows it",
                param=key,
                code="unsupported_field",
            )


# ---- response models --------------------------------------------------------------------------


class TextBlockOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlockOut(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseBlockOut(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


BlockOut = TextBlockOut | ThinkingBlockOut | ToolUseBlockOut


class UsageOut(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[BlockOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: UsageOut


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageOut


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class BlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: BlockOut


class TextDeltaOut(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDeltaOut(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDeltaOut(BaseModel):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDeltaOut(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class BlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDeltaOut | ThinkingDeltaOut | SignatureDeltaOut | InputJsonDeltaOut


class BlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDeltaOut(BaseModel):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDeltaOut
    usage: UsageOut


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (
    MessageStartEvent
    | PingEvent
    | BlockStartEvent
    | BlockDeltaEvent
    | BlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
)
