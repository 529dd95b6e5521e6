"""The engine protocol: SGLang's native HTTP API, as typed models.

The gateway speaks exactly this to any engine, so a real SGLang server or router drops in
for ``corral.engines.local``. Token ids go in and token ids come out; the engine never
re-tokenizes. Only the fields corral uses are modelled; unknown fields in an engine's
answer are kept (``extra="allow"``) and ignored.

What the local engine accepts is SGLang's whole ``GenerateReqInput`` (what SGLang's routers
forward), through :func:`parse_generate_input`: the modelled fields are honoured, every other
field of SGLang's request is in :data:`GENERATE_FIELDS` / :data:`SAMPLING_FIELDS`, which say
for each why it changes nothing here (accepted and ignored) or, for a value the engine cannot
honour, why it is refused; a field SGLang does not have is refused, so that nothing is
silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    """SGLang's ``sampling_params``. Defaults follow SGLang.

    Constrained decoding, as SGLang: at most one of ``json_schema`` (a JSON Schema, as a JSON
    string; SGLang's OpenAI layer sends ``'{"type": "object"}'`` for ``response_format``
    ``json_object``), ``regex`` (the whole output matches it) and ``ebnf`` (a grammar) may be
    set. The engine guarantees the output (up to ``max_new_tokens``) is in the constraint's
    language; what syntax each accepts depends on the engine's grammar backend (the local
    engine's: :mod:`corral.engines.local.grammar`).
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1  # -1: no top-k filtering (SGLang's convention)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # OpenAI's semantics, as SGLang's: subtracted from a token's logit per time it was generated
    # (frequency) and once if it was (presence); logit_bias adds to a token's logit (keys are
    # token ids as strings).
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingParams:
        # SGLang's check (SamplingParams.verify), with its message.
        if sum(c is not None for c in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        return self


class GenerateRequest(BaseModel):
    """``POST /generate`` body, token-in form only.

    ``routing_key`` is not part of the body (never serialised): an engine client sends it as
    the ``X-SMG-Routing-Key`` header, which SGLang's routers hash (smg's
    ``consistent_hashing``, sglang-router's ``manual`` policy) so that every request with the
    same key reaches the same worker; the gateway uses the session id.
    """

    model_config = ConfigDict(extra="forbid")

    input_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = True
    top_logprobs_num: int = Field(default=0, ge=0)
    stream: bool = False
    rid: str | None = None
    routing_key: str | None = Field(default=None, exclude=True)


class FinishReason(BaseModel):
    """``meta_info.finish_reason``: why generation stopped.

    ``matched`` is the stop token id (int) or stop string (str) that ended it, when one did.
    """

    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None


# SGLang's logprob triple: [logprob, token_id, token_text_or_null].
LogprobEntry = tuple[float, int, str | None]


class MetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    finish_reason: FinishReason | None = None  # None while a stream is still running
    prompt_tokens: int
    completion_tokens: int
    output_token_logprobs: list[LogprobEntry] = Field(default_factory=list)
    # Per output position, the top alternatives (only when top_logprobs_num > 0).
    output_top_logprobs: list[list[LogprobEntry] | None] = Field(default_factory=list)
    weight_version: str = "default"


class GenerateResponse(BaseModel):
    """``POST /generate`` answer, and each streamed chunk.

    Streaming follows SGLang's default: every chunk is cumulative (``text``, ``output_ids``
    and ``output_token_logprobs`` hold everything generated so far). An engine started with
    ``--incremental-streaming-output`` sends only the new part instead; the client tells the
    two apart with ``completion_tokens``.
    """

    model_config = ConfigDict(extra="allow")

    # SGLang leaves ``text`` out when started with ``--skip-tokenizer-init``.
    text: str = ""
    output_ids: list[int] = Field(default_factory=list)
    meta_info: MetaInfo


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str = ""
    abort_all: bool = False


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None


class UpdateWeightsResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    success: bool
    message: str = ""
    num_paused_requests: int = 0

    @field_validator("num_paused_requests", mode="before")
    @classmethod
    def _none_is_zero(cls, value: object) -> object:
        # SGLang types it ``Optional[int] = 0`` and may send null.
        return 0 if value is None else value


class ModelInfo(BaseModel):
    """``GET /get_model_info``."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    weight_version: str | None = None


# --- SGLang's GenerateReqInput, as the local engine accepts it ----------------------------


@dataclass(frozen=True)
class FieldRule:
    """What the local engine does with a field of SGLang's request that it does not model.

    ``honours(value)`` is true for the values the engine can serve as SGLang would (SGLang's
    default, "unset" values, or values that change nothing here); ``None`` means every value
    is accepted. A field is then dropped before the request runs. A value for which
    ``honours`` is false is refused with a 400 naming the field and ``reason``; for an ignored
    field (``honours`` ``None``) ``reason`` says why it changes nothing.
    """

    reason: str
    honours: Callable[[Any], bool] | None = None


def _unset(value: Any) -> bool:
    """SGLang's "not asked for": null, false, or an empty list or object."""
    return value is None or value is False or (isinstance(value, list | dict) and not value)


def _is(default: object) -> Callable[[Any], bool]:
    """Honours null (SGLang then takes its default) and ``default`` itself."""

    def check(value: Any) -> bool:
        return value is None or (type(value) is not bool and value == default)

    return check


def _no_prompt_logprobs(value: Any) -> bool:
    return value is None or (type(value) is int and value == -1)


# Every field of SGLang's ``GenerateReqInput`` (python/sglang/srt/managers/io_struct.py) that
# ``GenerateRequest`` does not model, plus ``model`` (sglang-router and smg add it), with what
# the local engine does with it. ``text``, ``logprob_start_len`` and ``sampling_params`` are
# handled in ``parse_generate_input`` first.
GENERATE_FIELDS: Mapping[str, FieldRule] = {
    # -- accepted and ignored: nothing they do applies to this engine --
    "model": FieldRule("the engine serves one model; routers fill in their own model id"),
    "session_id": FieldRule("an identity only: SGLang does not alter the prompt for it either"),
    "log_metrics": FieldRule("no per-request metrics are logged"),
    "no_logs": FieldRule("request contents are never logged"),
    "custom_labels": FieldRule("no per-request metric labels"),
    "priority": FieldRule("requests are scheduled first come, first served"),
    "extra_key": FieldRule("namespaces SGLang's prefix cache; there is no prefix cache"),
    "cache_salt": FieldRule("namespaces SGLang's prefix cache; there is no prefix cache"),
    "routing_key": FieldRule("picks one of SGLang's data-parallel ranks; there is one"),
    "conversation_id": FieldRule("request tracking only"),
    "http_worker_ipc": FieldRule("SGLang-internal (its tokenizer workers' IPC)"),
    "external_trace_header": FieldRule("no tracing"),
    "received_time": FieldRule("a timestamp for SGLang's latency metrics"),
    "kv_router_hint": FieldRule("a KV-cache storage hint; there is no KV-cache storage"),
    "disagg_prefill_dp_rank": FieldRule("a prefill/decode disaggregation hint; not disaggregated"),
    "routed_experts_start_len": FieldRule("used only with return_routed_experts (refused)"),
    "return_bytes": FieldRule("for image generation; this engine generates tokens only"),
    # describe multimodal inputs, which are refused (image_data, video_data, audio_data)
    "modalities": FieldRule("describes multimodal inputs; there are none"),
    "mm_hashes": FieldRule("describes multimodal inputs; there are none"),
    "mm_content_hashes": FieldRule("describes multimodal inputs; there are none"),
    "use_audio_in_video": FieldRule("describes multimodal inputs; there are none"),
    "video_config": FieldRule("describes multimodal inputs; there are none"),
    "images_config": FieldRule("describes multimodal inputs; there are none"),
    "max_dynamic_patch": FieldRule("describes multimodal inputs; there are none"),
    "min_dynamic_patch": FieldRule("describes multimodal inputs; there are none"),
    "image_max_dynamic_patch": FieldRule("describes multimodal inputs; there are none"),
    "video_max_dynamic_patch": FieldRule("describes multimodal inputs; there are none"),
    "need_wait_for_mm_inputs": FieldRule("encoder disaggregation; there are no multimodal inputs"),
    "num_items_assigned": FieldRule("encoder disaggregation; there are no multimodal inputs"),
    "encoder_urls": FieldRule("encoder disaggregation; there are no multimodal inputs"),
    # -- honoured at their defaults only; anything else is refused --
    "routed_dp_rank": FieldRule("there is only data-parallel rank 0", _is(0)),
    "data_parallel_rank": FieldRule("there is only data-parallel rank 0", _is(0)),
    "return_text_in_logprobs": FieldRule(
        "token texts are not put in logprobs (decode output_ids instead)", _unset
    ),
    "token_ids_logprob": FieldRule("logprobs of chosen token ids are not computed", _unset),
    "return_sampling_mask": FieldRule("sampling masks are not returned", _unset),
    "return_flat_raw_top_logprobs": FieldRule("prompt top logprobs are not computed", _unset),
    "return_flat_raw_top_logprobs_b64": FieldRule("prompt top logprobs are not computed", _unset),
    "return_hidden_states": FieldRule("hidden states are not returned", _unset),
    "return_routed_experts": FieldRule("not a mixture-of-experts engine", _unset),
    "return_indexer_topk": FieldRule("no sparse-attention indexer", _unset),
    "return_entropy": FieldRule("entropies are not computed", _unset),
    "return_prompt_token_ids": FieldRule("prompt token ids are not echoed back", _unset),
    "input_embeds": FieldRule("input embeddings are not accepted; send input_ids", _unset),
    "image_data": FieldRule("a text-only engine: no image inputs", _unset),
    "video_data": FieldRule("a text-only engine: no video inputs", _unset),
    "audio_data": FieldRule("a text-only engine: no audio inputs", _unset),
    "positional_embed_overrides": FieldRule("embedding overrides are not supported", _unset),
    "session_params": FieldRule(
        "SGLang's stateful sessions are not kept; send the whole prompt", _unset
    ),
    "lora_path": FieldRule("LoRA adapters are not supported", _unset),
    "lora_id": FieldRule("LoRA adapters are not supported", _unset),
    "custom_logit_processor": FieldRule("custom logit processors are not run", _unset),
    "bootstrap_host": FieldRule("prefill/decode disaggregation is not supported", _unset),
    "bootstrap_port": FieldRule("prefill/decode disaggregation is not supported", _unset),
    "bootstrap_room": FieldRule("prefill/decode disaggregation is not supported", _unset),
    "bootstrap_pair_key": FieldRule("prefill/decode disaggregation is not supported", _unset),
    "decode_tp_size": FieldRule("prefill/decode disaggregation is not supported", _unset),
    "background": FieldRule("background (OpenAI Responses API) requests are not run", _unset),
    "require_reasoning": FieldRule("reasoning cannot be enforced", _unset),
    "max_thinking_tokens": FieldRule("thinking budgets cannot be enforced", _unset),
    "multi_item_delimiter_indices": FieldRule("multi-item scoring is not supported", _unset),
}

# The same for SGLang's ``SamplingParams`` (python/sglang/srt/sampling/sampling_params.py)
# fields that corral's ``SamplingParams`` does not model. ``stop`` as one string is turned
# into a list in ``parse_generate_input``.
SAMPLING_FIELDS: Mapping[str, FieldRule] = {
    "custom_params": FieldRule("read only by custom logit processors, which are refused"),
    "stream_interval": FieldRule(
        "streams send a chunk per decode step; chunks are cumulative, so the tokens are the same"
    ),
    "min_p": FieldRule("min-p filtering is not implemented (0 only)", _is(0)),
    "repetition_penalty": FieldRule("repetition penalty is not implemented (1 only)", _is(1)),
    "min_new_tokens": FieldRule("min_new_tokens is not implemented (0 only)", _is(0)),
    "n": FieldRule("one sequence per request (send n requests)", _is(1)),
    "stop_regex": FieldRule("stop regexes are not supported (use stop strings)", _unset),
    "structural_tag": FieldRule("structural tags are not supported (use ebnf)", _unset),
    "spaces_between_special_tokens": FieldRule(
        "text is decoded with the tokenizer's default spacing (true only)",
        lambda v: v is None or v is True,
    ),
}


class UnsupportedFieldsError(ValueError):
    """A request asks for what the engine cannot do: ``fields`` maps each field (``a.b`` for
    a nested one) to why. The message names them all."""

    def __init__(self, fields: Mapping[str, str]) -> None:
        self.fields = dict(fields)
        super().__init__(
            "not supported by corral's local engine: "
            + "; ".join(f"{name} ({why})" for name, why in self.fields.items())
        )


def _apply(
    data: dict[str, Any], rules: Mapping[str, FieldRule], prefix: str, refused: dict[str, str]
) -> None:
    """Drop the fields ``rules`` accept from ``data``; note the refused ones in ``refused``."""
    for name in [n for n in data if n in rules]:
        value = data.pop(name)
        rule = rules[name]
        if rule.honours is not None and not rule.honours(value):
            refused[f"{prefix}{name}={_short(value)}"] = rule.reason


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, bool) else str(value).lower()
    return text if len(text) <= 40 else text[:37] + "..."


def _drop_nulls(data: dict[str, Any], model: type[BaseModel], keep: frozenset[str]) -> None:
    # SGLang reads null as "the default" for these (its dataclass / __post_init__ does);
    # pydantic would refuse null for a non-optional field.
    for name in list(data):
        if data[name] is None and name in model.model_fields and name not in keep:
            del data[name]


def parse_generate_input(data: object) -> GenerateRequest:
    """SGLang's ``GenerateReqInput`` JSON (a dict) as a ``GenerateRequest`` the local engine
    runs, following the module's field tables.

    Raises ``UnsupportedFieldsError`` naming every field whose value the engine cannot honour,
    and pydantic's ``ValidationError`` for a body that is malformed (an unknown field, a
    wrong type). Batch requests (a list of prompts) are refused; so is ``text`` (the engine
    is token-in: send ``input_ids``).
    """
    if not isinstance(data, dict):
        return GenerateRequest.model_validate(data)  # the ValidationError says why
    body = dict(data)
    refused: dict[str, str] = {}
    _apply(body, GENERATE_FIELDS, "", refused)
    text = body.get("text")
    if text is not None:
        del body["text"]
        refused[f"text={_short(text)}"] = "token-in only: send input_ids, not text"
        body.setdefault("input_ids", [0])  # so that only the refusal is reported
    elif "text" in body:
        del body["text"]
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        refused["input_ids"] = "batch requests are not supported: send one prompt per request"
        body["input_ids"] = [0]
    if "logprob_start_len" in body:
        start = body.pop("logprob_start_len")
        if body.get("return_logprob") and not _no_prompt_logprobs(start):
            refused[f"logprob_start_len={_short(start)}"] = (
                "prompt logprobs are not computed (-1 only: output tokens)"
            )
    _drop_nulls(body, GenerateRequest, keep=frozenset({"rid"}))
    sampling = body.get("sampling_params")
    if sampling is None:
        body.pop("sampling_params", None)
    elif isinstance(sampling, dict):
        sampling = dict(sampling)
        _apply(sampling, SAMPLING_FIELDS, "sampling_params.", refused)
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = [sampling["stop"]]  # SGLang takes one string or a list
        nullable = frozenset(n for n, f in SamplingParams.model_fields.items() if f.default is None)
        _drop_nulls(sampling, SamplingParams, keep=nullable)
        body["sampling_params"] = sampling
    if refused:
        raise UnsupportedFieldsError(refused)
    return GenerateRequest.model_validate(body)
