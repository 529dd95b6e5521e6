"""OpenAI Responses on the wire: the request and answer models, and which of the API's fields
the gateway ignores or refuses. The translation to and from the turn pipeline is
:mod:`corral.gateway.dialects.openai_responses`."""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Request fields (dotted: nested ones) the gateway accepts and ignores, and why (as docs/gateway.md
# lists them).
IGNORED_FIELDS: dict[str, str] = {
    "model": "the gateway serves one model; the response names it",
    "prompt_cache_key": "prefix caching is the engine's own, by token prefix",
    "prompt_cache_retention": "prefix caching is the engine's own",
    "prompt_cache_options": "prefix caching is the engine's own ('prewarm': true is refused)",
    "safety_identifier": "no abuse monitoring here",
    "user": "no abuse monitoring here",
    "service_tier": "one tier; the response says 'default'",
    "client_metadata": "Codex's per-turn metadata; nothing here reads it",
    "stream_options": "no obfuscation padding is ever added to stream events",
    "truncation": "'auto' and 'disabled' alike: a prompt over the context is a 400, never cut "
    "(the recorded sample must be the conversation the agent sent)",
    "max_tool_calls": "bounds hosted tool calls; none run here",
    "context_management": "no server-side compaction: the conversation goes to the model whole",
    "background_options": "only applies to background responses, which are refused",
    "image": "image options; the model takes text only",
    "access_programs": "OpenAI account programs",
    "text.verbosity": "no verbosity control on a self-hosted model",
    "reasoning.context": "the template decides which earlier reasoning it renders",
    "reasoning.mode": "one reasoning mode",
}

# Content parts: those a text-only model cannot take (a 400), and the text ones.
MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
TEXT_PARTS = frozenset({"input_text", "output_text"})
# Request fields of OpenAI-hosted features: refused whenever set, saying why.
REFUSED_FIELDS = {
    "conversation": "conversations are OpenAI-hosted state: send the items as input, or use "
    "previous_response_id with store: true",
    "prompt": "prompt templates are OpenAI-hosted: send instructions and input instead",
    "moderation": "no moderation model runs here",
}

Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]
SummaryMode = Literal["auto", "concise", "detailed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


@functools.cache
def responses_request_fields() -> frozenset[str]:
    """The request fields of the Responses API, from the ``openai`` SDK's own types."""
    from openai.types.responses import response_create_params as p

    base = p.ResponseCreateParamsBase
    return frozenset(base.__required_keys__ | base.__optional_keys__ | {"stream"})


# ---- the request -----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _Lenient(BaseModel):
    # Items and tools that clients echo back carry fields that change nothing here (ids, status,
    # phase, caller, strict, defer_loading): accepted and ignored.
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ReasoningParam(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: SummaryMode | None = None
    generate_summary: SummaryMode | None = None  # the API's older name for ``summary``
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class TextFormatParam(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextParam(_Strict):
    format: TextFormatParam | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class PromptCacheOptionsParam(_Lenient):
    prewarm: bool = False


class ResponsesRequest(BaseModel):
    """A ``POST /v1/responses`` body. Extra fields are sorted by :meth:`unknown_fields`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning: ReasoningParam | None = None
    text: TextParam | None = None
    include: list[Includable] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    prompt_cache_options: PromptCacheOptionsParam | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    conversation: Any = None
    prompt: Any = None
    moderation: Any = None

    def unknown_fields(self) -> tuple[list[str], list[str]]:
        """Extra fields the client sent: (OpenAI's, which the gateway cannot honour; unknown
        to OpenAI). The ignored ones are in neither."""
        extra = [k for k in (self.model_extra or {}) if k not in IGNORED_FIELDS]
        known = responses_request_fields()
        return [k for k in extra if k in known], [k for k in extra if k not in known]


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Any]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    namespace: str | None = None


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Any]


class TextPart(_Lenient):
    type: str
    text: str


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None
    encrypted_content: str | None = None


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class NamespaceTool(_Lenient):
    type: Literal["namespace"]
    name: str = Field(min_length=1)
    description: str | None = None
    tools: list[Any]


# ---- the answer ------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class OutputLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class SummaryText(BaseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    namespace: str | None = None
    arguments: str
    status: ItemStatus


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] | None = None


class ResponseErrorBody(BaseModel):
    code: str
    message: str
    param: str | None = None
    type: str | None = None


ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class ResponseObject(BaseModel):
    """The ``response`` object; every field is always present (``null`` when unset)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    completed_at: int | None = None
    error: ResponseErrorBody | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None
    # echoed from the request
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=dict)
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=dict)
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: str = "disabled"
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str = "default"
    background: bool = False
