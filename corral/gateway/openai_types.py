"""OpenAI chat-completions request and response models, as the gateway accepts and returns them.

Requests are strict: a field the gateway does not know, or knows (from the ``openai`` SDK's
own request types) but cannot honour, is a 400 naming the field, never silently ignored. The
fields that change nothing for a self-hosted model are accepted and listed in
:data:`IGNORED_FIELDS`.
"""

from __future__ import annotations

import functools
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from corral.gateway.turns import Message
from corral.gateway.turns import ToolCall as TurnToolCall

INT64 = 2**63

# Request fields OpenAI defines that change nothing for a self-hosted model: accepted, ignored.
IGNORED_FIELDS = frozenset(
    {
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "verbosity",
    }
)


@functools.cache
def openai_request_fields() -> frozenset[str]:
    """The request fields of Chat Completions, from the ``openai`` SDK's own types."""
    from openai.types.chat import completion_create_params

    return frozenset(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class RefusalPart(_Strict):
    """An earlier refusal echoed back in history: no template renders it."""

    type: Literal["refusal"]
    refusal: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # Sent back by SDKs on assistant turns; the template renders none of them, so they are
    # neither rendered nor recorded.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only 'assistant' messages may carry 'tool_calls'")
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def to_turn(self) -> Message:
        """The message as the turn pipeline holds it (``developer`` is ``system``)."""
        return Message(
            role="system" if self.role == "developer" else self.role,
            content=self.text(),
            tool_calls=tuple(
                TurnToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                for c in self.tool_calls or ()
            ),
            tool_call_id=self.tool_call_id,
            name=self.name,
            reasoning=self.reasoning_content,
        )


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class StreamOptions(_Strict):
    include_usage: bool = False
    # Padding against a side channel of hosted APIs; nothing to hide on a self-hosted model.
    include_obfuscation: bool | None = None


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs 'json_schema'")
        return self


class ChatCompletionRequest(BaseModel):
    # Extra fields are sorted by ``unknown_fields``: OpenAI's own that the gateway ignores,
    # cannot honour, or does not know at all.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, le=INT64 - 1)
    n: int = Field(default=1, ge=1, le=64)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_range(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad_keys = [key for key in v or {} if not key.isdigit()]
        if bad_keys:  # every one named, not just the first
            raise ValueError(f"logit_bias keys are token ids, got {bad_keys}")
        for bias in (v or {}).values():
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values lie in [-100, 100], got {bias}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if (isinstance(v, list) and any(s == "" for s in v)) or v == "":
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("n", "logprobs", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v: Any, info: Any) -> Any:
        # OpenAI's SDKs and LangChain send null for "not set" on these.
        return cls.model_fields[info.field_name].default if v is None else v

    def combination_problem(self) -> tuple[str, str] | None:
        """``(param, message)`` for fields that are fine alone but not together, else None."""
        if self.tool_choice not in (None, "auto", "none") and not self.tools:
            return "tool_choice", "'tool_choice' requires 'tools'"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            names = {t.function.name for t in self.tools}
            if self.tool_choice.function.name not in names:
                return "tool_choice", (
                    f"'tool_choice' names '{self.tool_choice.function.name}', "
                    f"which is not among the tools: {sorted(names)}"
                )
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "'top_logprobs' requires 'logprobs': true"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "'stream_options' is only allowed with 'stream': true"
        return None

    def unknown_fields(self) -> tuple[list[str], list[str]]:
        """Extra fields the client sent: (OpenAI's, which the gateway cannot honour; unknown
        to OpenAI). The ignored ones are in neither, nor are OpenAI's fields sent as null
        (unset) or ``modalities: ["text"]`` (what a text model does anyway)."""
        extra = [
            k
            for k, v in (self.model_extra or {}).items()
            if k not in IGNORED_FIELDS
            and v is not None
            and not (k == "modalities" and v == ["text"])
        ]
        known = openai_request_fields()
        return [k for k in extra if k in known], [k for k in extra if k not in known]

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# ---- responses ------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


FinishReasonName = Literal["stop", "length", "tool_calls", "abort"]


class Choice(BaseModel):
    index: int
    message: ResponseMessage
    finish_reason: FinishReasonName
    logprobs: ChoiceLogprobs | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    finish_reason: FinishReasonName | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
