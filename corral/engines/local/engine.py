"""``LocalEngine``: a transformers causal LM behind SGLang's native generate semantics.

This is corral's embedded default engine and its test engine. It is **not** a replacement for
SGLang: no paged attention, no prefix cache, no CUDA graphs, no tensor parallelism. It exists so
that corral runs end to end on a laptop or a CPU CI machine and so that tests can check exact
token-level behaviour (logprobs, stop handling, aborts, weight swaps) against a real model.

Scheduling is continuous batching. A scheduler task on the event loop admits waiting requests
and runs one *step* at a time in a dedicated worker thread; a step prefills the newly admitted
requests (one left-padded batch) and decodes one token for every request already running (one
batch over a left-padded KV cache). A request that arrives while a step runs joins at the next
step; it never waits for its batch mates to finish. Weights are swapped between steps only.

Supported models: decoder-only transformers models whose layers are all full attention and use
transformers' ``DynamicCache`` (Llama, Qwen2/2.5/3, Mistral without a sliding window, ...).
Others are refused at load time with a ``ValueError`` rather than served wrongly.

An engine lives on one event loop between ``start()`` and ``stop()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

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

log = logging.getLogger(__name__)

__all__ = ["InvalidRequestError", "LocalEngine"]


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (the HTTP layer answers 400 with this message)."""


# ---------------------------------------------------------------------------------------------
# Per-request state
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Seq:
    """One request's state. Mutated only on the event loop, except ``kv`` (worker thread)."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    top_n: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    event: asyncio.Event
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    # Text a streamed chunk may show: never shrinks (held back while a stop string may be forming).
    text: str = ""
    finish: FinishReason | None = None
    weight_version: str = "default"
    # Per-layer (key, value) of shape [1, heads, kv_len, head_dim] while the sequence is not
    # part of the worker's decode batch. Owned by the worker thread.
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass(frozen=True, slots=True)
class _TokenResult:
    """What one step produced for one sequence (computed in the worker thread)."""

    seq: _Seq
    token: int
    logprob: float
    top: list[LogprobEntry] | None
    text: str
    finish: FinishReason | None


# ---------------------------------------------------------------------------------------------
# Sampling and stop checks (worker thread, pure functions of their inputs)
# ---------------------------------------------------------------------------------------------


def _sample(seqs: Sequence[_Seq], logits: torch.Tensor) -> list[tuple[int, float, Any]]:
    """Pick one token per row of ``logits`` [B, V].

    The logprob reported is the token's log-probability under the distribution it was sampled
    from *before* top-k/top-p filtering: ``log_softmax(logits / T)`` (``T == 0``: greedy argmax,
    ``log_softmax(logits)``). Each row draws from its own request's generator, so a seeded
    request gives the same tokens whatever its batch mates are.
    """
    logits = logits.float()
    temps = torch.tensor(
        [s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs],
        device=logits.device,
    )
    logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
    out: list[tuple[int, float, Any]] = []
    vocab = logits.shape[-1]
    for i, s in enumerate(seqs):
        p = s.params
        row = logprobs[i]
        if p.temperature == 0:
            token = int(torch.argmax(logits[i]))
        else:
            probs = row.exp()
            if 0 < p.top_k < vocab:
                vals, idx = torch.topk(probs, p.top_k)
            elif p.top_p < 1.0:
                vals, idx = torch.sort(probs, descending=True)
            else:
                vals, idx = probs, None
            if p.top_p < 1.0:
                # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
                cum = vals.cumsum(0)
                vals = torch.where(cum - vals < p.top_p, vals, torch.zeros_like(vals))
            choice = int(torch.multinomial(vals, 1, generator=s.generator))
            token = choice if idx is None else int(idx[choice])
        top = None
        if s.top_n > 0:
            t_vals, t_idx = torch.topk(row, min(s.top_n, vocab))
            top = list(zip(t_vals.tolist(), t_idx.tolist(), [None] * len(t_vals), strict=True))
        out.append((token, float(row[token]), top))
    return out


def _held_back(text: str, stops: Sequence[str]) -> str:
    """``text`` minus a trailing partial UTF-8 character and any suffix a stop string starts with.

    Streamed text then only ever grows: nothing shown is later trimmed away.
    """
    text = text.rstrip("\ufffd")
    cut = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), cut, -1):
            if text.endswith(stop[:n]):
                cut = n
                break
    return text[: len(text) - cut] if cut else text


def _check(seq: _Seq, token: int, tokenizer: Any) -> tuple[str, FinishReason | None]:
    """Text and finish reason after appending ``token``, in SGLang's order: length, stop token,
    stop string. Output ids always keep ``token``; only the text is trimmed."""
    p = seq.params
    ids = [*seq.output_ids, token]
    full = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
    if len(ids) >= p.max_new_tokens:
        return full, FinishReason.model_validate({"type": "length", "length": p.max_new_tokens})
    if token in seq.stop_ids:
        text = full
        if not p.no_stop_trim:
            text = tokenizer.decode(ids[:-1], skip_special_tokens=p.skip_special_tokens)
        return text, FinishReason(type="stop", matched=token)
    if p.stop:
        hits = [(full.find(s), s) for s in p.stop if s and s in full]
        if hits:
            at, stop = min(hits)
            return (full if p.no_stop_trim else full[:at]), FinishReason(type="stop", matched=stop)
    return _held_back(full, p.stop or ()), None


# ---------------------------------------------------------------------------------------------
# The worker: model forward passes and KV-cache bookkeeping (runs in one dedicated thread)
# ---------------------------------------------------------------------------------------------


# transformers 5.2x renamed the KV cache (argument and output field) from ``past_key_values``
# to ``cache``; the engine speaks whichever the installed version has.
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, each with ``keys``/``values`` [batch, heads, len, head_dim]."""
    return list(cache.layers)


class _Worker:
    """Runs steps. Not thread-safe: the engine calls it from its single worker thread only.

    The decode batch keeps one left-padded ``DynamicCache`` across steps while its membership
    is unchanged (the common case); when a request joins or leaves, the survivors' KV is sliced
    out and a new, tightly padded cache is built. Padding columns hold zeros and are masked.
    """

    def __init__(self, model: Any, tokenizer: Any, device: torch.device) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self._batch: list[_Seq] = []
        self._cache: DynamicCache | None = None
        self._lens: torch.Tensor = torch.zeros(0, dtype=torch.long)
        self._width = 0

    def reset(self) -> None:
        """Forget the decode batch (after a failed step; its requests have been finished)."""
        self._batch, self._cache, self._width = [], None, 0

    @torch.inference_mode()
    def step(self, prefill: list[_Seq], decode: list[_Seq]) -> list[_TokenResult]:
        seqs: list[_Seq] = []
        rows: list[torch.Tensor] = []
        if decode:
            rows.append(self._decode(decode))
            seqs += decode
        if prefill:
            rows.append(self._prefill(prefill))
            seqs += prefill
        if not seqs:
            return []
        logits = torch.cat(rows)
        results = []
        for s, (token, lp, top) in zip(seqs, _sample(seqs, logits), strict=True):
            text, finish = _check(s, token, self.tokenizer)
            results.append(_TokenResult(s, token, lp, top, text, finish))
        return results

    def _prefill(self, seqs: list[_Seq]) -> torch.Tensor:
        """Left-padded prefill; each sequence keeps its own (unpadded) slice of the KV."""
        width = max(len(s.prompt) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s.prompt) :] = torch.tensor(s.prompt)
            mask[i, width - len(s.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            **{_CACHE: DynamicCache()},
            use_cache=True,
            logits_to_keep=1,
        )
        for i, s in enumerate(seqs):
            start = width - len(s.prompt)
            s.kv = [
                (lay.keys[i : i + 1, :, start:], lay.values[i : i + 1, :, start:])
                for lay in _layers(getattr(out, _CACHE))
            ]
        return out.logits[:, -1]

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """One token for each of ``seqs`` (each has a sampled token not yet in its KV)."""
        if (
            self._cache is None
            or len(self._batch) != len(seqs)
            or any(a is not b for a, b in zip(self._batch, seqs, strict=False))
        ):
            self._rebuild(seqs)
        assert self._cache is not None
        width = self._width
        # Row i's real KV occupies the last lens[i] columns; the new token goes at column width.
        cols = torch.arange(width + 1)
        mask = (cols[None, :] >= (width - self._lens)[:, None]).long()
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs])
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=self._lens[:, None].to(self.device),
            **{_CACHE: self._cache},
            use_cache=True,
        )
        self._width += 1
        self._lens = self._lens + 1
        return out.logits[:, -1]

    def _rebuild(self, seqs: list[_Seq]) -> None:
        keep = {id(s) for s in seqs}
        if self._cache is not None:
            for row, s in enumerate(self._batch):
                if id(s) in keep:
                    start = self._width - int(self._lens[row])
                    s.kv = [
                        (lay.keys[row : row + 1, :, start:], lay.values[row : row + 1, :, start:])
                        for lay in _layers(self._cache)
                    ]
        lens = [s.kv[0][0].shape[2] for s in seqs if s.kv is not None]
        if len(lens) != len(seqs):
            raise RuntimeError("a decoding sequence has no KV cache (scheduler bug)")
        width = max(lens)
        layers = []
        for layer in range(len(seqs[0].kv or ())):
            ks, vs = [], []
            for s in seqs:
                k, v = (s.kv or [])[layer]
                pad = (0, 0, width - k.shape[2], 0)
                ks.append(torch.nn.functional.pad(k, pad))
                vs.append(torch.nn.functional.pad(v, pad))
            layers.append((torch.cat(ks), torch.cat(vs)))
        for s in seqs:
            s.kv = None
        self._cache = DynamicCache(layers)
        self._batch = list(seqs)
        self._lens = torch.tensor(lens, dtype=torch.long)
        self._width = width


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


def _default_dtype(device: torch.device) -> torch.dtype:
    # float32 on CPU keeps logprobs exact (and bf16 matmuls are slow there); bf16 on GPUs.
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _load_model(path: str | Path, device: torch.device, dtype: torch.dtype) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.to(device).eval()
    text_cfg = model.config.get_text_config(decoder=True)
    layer_types = getattr(text_cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"{path}: layer types {sorted(set(layer_types))} are not supported by the local "
            "engine (full attention only); serve this model with SGLang"
        )
    return model


def _shape_key(model: Any) -> tuple[Any, ...]:
    """What must not change across a weight swap, since running requests keep their KV."""
    c = model.config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return (type(model).__name__, c.vocab_size, c.num_hidden_layers, kv_heads, head_dim)


def _eos_ids(model: Any) -> frozenset[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


class LocalEngine:
    """SGLang's ``/generate`` semantics over a transformers model, batched continuously.

    Not SGLang (see the module docstring). Contracts:

    * ``generate``/``stream`` validate the request first and raise ``InvalidRequestError``
      (nothing is enqueued) for: a prompt plus ``max_new_tokens`` beyond the model's
      ``max_position_embeddings`` (rejected, not clamped, so a caller never gets silently
      shorter outputs; SGLang rejects too-long prompts too), token ids outside the
      vocabulary, ``top_k`` not ``-1`` or ``>= 1``, or a rid already in flight. Unknown
      request fields are already refused by the protocol models.
    * Every accepted request ends with a finish reason: ``length``, ``stop`` (``matched`` is the
      token id or the stop string), or ``abort`` (``message`` says why; what was generated so
      far is kept). Engine failures during a step abort the requests of that step, with the
      error as message; the engine keeps serving.
    * ``output_ids`` include the token that finished the request (EOS / stop token / the token
      completing a stop string); ``text`` is decoded with ``skip_special_tokens`` and trimmed
      before the stop string or stop token unless ``no_stop_trim``.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        max_batch_size: int = 64,
        max_prefill_tokens: int = 16384,
        dtype: torch.dtype | None = None,
        tokenizer_path: str | Path | None = None,
    ) -> None:
        """Load the model and tokenizer (blocking). Raises ``OSError``/``ValueError`` if the
        model cannot be loaded or is of an unsupported kind."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.model_path = str(model_path)
        self.tokenizer_path = str(tokenizer_path or model_path)
        self.device = torch.device(device)
        self.dtype = dtype or _default_dtype(self.device)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        model = _load_model(model_path, self.device, self.dtype)
        tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        text_cfg = model.config.get_text_config(decoder=True)
        self.vocab_size: int = int(text_cfg.vocab_size)
        self.context_length: int | None = getattr(text_cfg, "max_position_embeddings", None)
        self.eos_token_ids = _eos_ids(model)
        self._worker = _Worker(model, tokenizer, self.device)
        self.weight_version = "default"
        self._updates = 0
        self.steps = 0  # scheduler steps run (one batched forward each); for tests and metrics
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._active: dict[str, _Seq] = {}
        self._finished: OrderedDict[str, FinishReason] = OrderedDict()
        self._finished_lock = threading.Lock()
        self._wake = asyncio.Event()
        self._model_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the scheduler task on the running loop. Idempotent."""
        if self._task is not None and not self._task.done():
            return
        self._stopping = False
        self._wake = asyncio.Event()
        self._model_lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-engine")
        self._event_loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._loop(), name="corral-engine-scheduler")

    async def stop(self) -> None:
        """Stop the scheduler after its current step; every unfinished request ends with an
        ``abort`` finish ("engine stopped"). Idempotent."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in list(self._active.values()):
            self._finish(seq, FinishReason(type="abort", message="engine stopped"))
        self._waiting.clear()
        self._running.clear()
        self._worker.reset()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def health(self) -> bool:
        """True while the scheduler task is running."""
        return self._task is not None and not self._task.done() and not self._stopping

    @property
    def tokenizer(self) -> Any:
        """The tokenizer used to decode ``text`` and match stop strings (never to encode input)."""
        return self._worker.tokenizer

    def model_info(self) -> ModelInfo:
        """``/get_model_info``: ``model_path`` follows the last successful weight update."""
        return ModelInfo(
            model_path=self.model_path,
            tokenizer_path=self.tokenizer_path,
            is_generation=True,
            weight_version=self.weight_version,
        )

    def server_info(self) -> dict[str, Any]:
        """Diagnostics in the spirit of SGLang's ``/get_server_info``."""
        return {
            "engine": "corral-local",
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "max_batch_size": self.max_batch_size,
            "max_prefill_tokens": self.max_prefill_tokens,
            "context_length": self.context_length,
            "weight_version": self.weight_version,
            "steps": self.steps,
            "num_running": len(self._running),
            "num_waiting": len(self._waiting),
        }

    @property
    def num_active(self) -> int:
        """Requests accepted and not yet finished."""
        return len(self._active)

    def finish_reason(self, rid: str) -> FinishReason | None:
        """The finish reason of a recently finished request (the last 1024 are kept), else None.
        Safe to call from any thread."""
        with self._finished_lock:
            return self._finished.get(rid)

    # -- requests ---------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        """Run ``req`` to completion. Raises ``InvalidRequestError`` for a bad request. If the
        caller is cancelled, the request is aborted in the engine."""
        last: GenerateResponse | None = None
        async for chunk in self.stream(req):
            last = chunk
        assert last is not None
        return last

    def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateResponse]:
        """Validate and enqueue ``req`` now (raising ``InvalidRequestError``), then iterate its
        cumulative chunks like SGLang's default streaming: each chunk holds everything so far
        and ``finish_reason`` is None until the last. Chunks may coalesce several tokens if the
        consumer is slower than the engine. Closing the iterator early aborts the request."""
        seq = self._submit(req)
        return self._follow(seq, req.return_logprob)

    def abort(self, rid: str, message: str = "aborted by request") -> bool:
        """Finish request ``rid`` with ``{"type": "abort"}``, keeping its output so far.
        Returns whether it was in flight; an unknown or finished rid is a no-op."""
        seq = self._active.get(rid)
        if seq is None:
            return False
        self._finish(seq, FinishReason(type="abort", message=message))
        self._wake.set()
        return True

    def abort_all(self, message: str = "aborted by request") -> int:
        """Abort every request in flight; returns how many."""
        seqs = list(self._active.values())
        for seq in seqs:
            self._finish(seq, FinishReason(type="abort", message=message))
        self._wake.set()
        return len(seqs)

    async def update_weights_from_disk(
        self, model_path: str | Path, weight_version: str | None = None
    ) -> UpdateWeightsResponse:
        """Load new weights from ``model_path`` and swap them in between two steps.

        The load runs off the event loop while generation continues. Running requests are not
        paused: they keep their KV cache and continue under the new weights (their later chunks
        report the new ``weight_version``); abort them first if a clean boundary is needed.
        On failure (unreadable path, different architecture or shapes) nothing changes and
        ``success`` is False with the reason.
        """
        try:
            model = await asyncio.to_thread(_load_model, model_path, self.device, self.dtype)
        except Exception as exc:
            return UpdateWeightsResponse(
                success=False, message=f"failed to load {model_path}: {exc}"
            )
        if _shape_key(model) != _shape_key(self._worker.model):
            return UpdateWeightsResponse(
                success=False,
                message=f"{model_path}: architecture or shapes differ from the loaded model "
                f"({_shape_key(model)} vs {_shape_key(self._worker.model)}); restart the engine",
            )
        async with self._model_lock:  # the scheduler holds it for the duration of a step
            self._worker.model = model
            self._updates += 1
            self.weight_version = weight_version or str(self._updates)
            self.model_path = str(model_path)
        return UpdateWeightsResponse(success=True, message=f"weights loaded from {model_path}")

    async def update_weights_from_tensors(
        self, tensors: Mapping[str, torch.Tensor], weight_version: str | None = None
    ) -> UpdateWeightsResponse:
        """Copy ``tensors`` (a Hugging Face state dict of the loaded architecture, from a
        trainer in this process) into the model between two steps: no disk, no new model.

        Same semantics as :meth:`update_weights_from_disk` for requests in flight. Every
        parameter must be given (tied ones may be left out) with its shape; otherwise nothing
        changes and ``success`` is False with the names that did not fit. Must be awaited on
        the engine's loop (:attr:`loop`; from another thread use
        ``asyncio.run_coroutine_threadsafe``)."""
        async with self._model_lock:
            model = self._worker.model
            own = model.state_dict()
            # Tied parameters appear once among named_parameters: either name may be given.
            unknown = sorted(set(tensors) - set(own))
            missing = sorted(set(dict(model.named_parameters())) - set(tensors))
            shapes = sorted(n for n, t in tensors.items() if n in own and t.shape != own[n].shape)
            if unknown or missing or shapes:
                return UpdateWeightsResponse(
                    success=False,
                    message=f"tensors do not fit the loaded model: unknown {unknown[:5]}, "
                    f"missing {missing[:5]}, wrong shape {shapes[:5]}",
                )
            with torch.no_grad():
                for name, tensor in tensors.items():
                    own[name].copy_(tensor)
            self._updates += 1
            self.weight_version = weight_version or str(self._updates)
        return UpdateWeightsResponse(success=True, message=f"{len(tensors)} tensors loaded")

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine was started on (``None`` before :meth:`start`)."""
        return self._event_loop

    # -- internals --------------------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> None:
        """Raise ``InvalidRequestError`` if ``req`` cannot be served; otherwise return."""
        p = req.sampling_params
        n = len(req.input_ids)
        if self.context_length is not None and n + p.max_new_tokens > self.context_length:
            raise InvalidRequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens: {n} input tokens + {p.max_new_tokens} "
                "max_new_tokens. Reduce the input or max_new_tokens."
            )
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"input_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        if p.top_k != -1 and p.top_k < 1:
            raise InvalidRequestError("top_k must be -1 (disabled) or at least 1")
        if req.rid is not None and req.rid in self._active:
            raise InvalidRequestError(f"duplicate request id {req.rid!r} is already in flight")

    def _submit(self, req: GenerateRequest) -> _Seq:
        if not self.health():
            raise RuntimeError("engine is not running (call start())")
        self.validate(req)
        p = req.sampling_params
        stop_ids: frozenset[int] = frozenset()
        if not p.ignore_eos:  # like SGLang, ignore_eos disables stop_token_ids too
            stop_ids = self.eos_token_ids | frozenset(p.stop_token_ids or ())
        gen = torch.Generator(device=self.device)
        gen.manual_seed(p.sampling_seed if p.sampling_seed is not None else secrets.randbits(62))
        seq = _Seq(
            rid=req.rid or uuid.uuid4().hex,
            prompt=list(req.input_ids),
            params=p,
            top_n=req.top_logprobs_num,
            stop_ids=stop_ids,
            generator=gen,
            event=asyncio.Event(),
            weight_version=self.weight_version,
        )
        self._active[seq.rid] = seq
        if p.max_new_tokens == 0:
            self._finish(seq, FinishReason.model_validate({"type": "length", "length": 0}))
        else:
            self._waiting.append(seq)
            self._wake.set()
        return seq

    async def _follow(self, seq: _Seq, with_logprobs: bool) -> AsyncIterator[GenerateResponse]:
        try:
            while True:
                await seq.event.wait()
                seq.event.clear()
                chunk = self._snapshot(seq, with_logprobs)
                yield chunk
                # Decide on the chunk, not on ``seq``: an abort during the yield still needs
                # its own final chunk.
                if chunk.meta_info.finish_reason is not None:
                    return
        finally:
            if seq.finish is None:
                self.abort(seq.rid, "client went away")

    def _snapshot(self, seq: _Seq, with_logprobs: bool) -> GenerateResponse:
        n = len(seq.output_ids)
        meta = MetaInfo(
            id=seq.rid,
            finish_reason=seq.finish,
            prompt_tokens=len(seq.prompt),
            completion_tokens=n,
            weight_version=seq.weight_version,
        )
        # SGLang's extra meta_info fields (MetaInfo keeps extras).
        setattr(meta, "cached_tokens", 0)  # noqa: B010
        setattr(meta, "e2e_latency", time.monotonic() - seq.created)  # noqa: B010
        if with_logprobs:
            meta.output_token_logprobs = list(
                zip(seq.logprobs, seq.output_ids, [None] * n, strict=True)
            )
            if seq.top_n > 0:
                meta.output_top_logprobs = list(seq.top_logprobs)
        return GenerateResponse(text=seq.text, output_ids=list(seq.output_ids), meta_info=meta)

    def _finish(self, seq: _Seq, reason: FinishReason) -> None:
        if seq.finish is not None:
            return
        seq.finish = reason
        self._active.pop(seq.rid, None)
        with self._finished_lock:
            self._finished[seq.rid] = reason
            while len(self._finished) > 1024:
                self._finished.popitem(last=False)
        seq.event.set()

    def _admit(self) -> list[_Seq]:
        admitted: list[_Seq] = []
        tokens = 0
        while self._waiting and len(self._running) + len(admitted) < self.max_batch_size:
            nxt = self._waiting[0]
            # Bound one prefill's size so decoding requests are not stalled for long; the first
            # request is always admitted, however long.
            if admitted and tokens + len(nxt.prompt) > self.max_prefill_tokens:
                break
            admitted.append(self._waiting.popleft())
            tokens += len(nxt.prompt)
        return admitted

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._waiting = deque(s for s in self._waiting if s.finish is None)
            self._running = [s for s in self._running if s.finish is None]
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            prefill = self._admit()
            decode = list(self._running)
            async with self._model_lock:
                try:
                    results = await loop.run_in_executor(
                        self._executor, self._worker.step, prefill, decode
                    )
                except Exception as exc:
                    log.exception("local engine step failed")
                    self._worker.reset()
                    for seq in prefill + decode:
                        self._finish(
                            seq, FinishReason(type="abort", message=f"engine error: {exc}")
                        )
                    continue
            self.steps += 1
            version = self.weight_version
            for r in results:
                seq = r.seq
                if seq.finish is not None:  # aborted while the step ran
                    continue
                seq.output_ids.append(r.token)
                seq.logprobs.append(r.logprob)
                seq.top_logprobs.append(r.top)
                seq.text = r.text
                seq.weight_version = version
                if r.finish is not None:
                    self._finish(seq, r.finish)
                else:
                    seq.event.set()
            self._running = [s for s in decode + prefill if s.finish is None]
