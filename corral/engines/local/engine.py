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
import math
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

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from corral.engines.local.grammar import ConstraintError, Grammars, Matcher, constraint_of
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
    """One request's state. Mutated only on the event loop, except ``kv`` and ``matcher``
    (worker thread)."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    top_n: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    event: asyncio.Event
    # False for a caller that only wants the finished request (``generate``): its text is then
    # decoded once, at the end, unless stop strings need it every step.
    chunks: bool = True
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    # Text a streamed chunk may show: never shrinks (held back while a stop string may be forming).
    text: str = ""
    finish: FinishReason | None = None
    weight_version: str = "default"
    # Where the sequence's KV lives while it is not part of the worker's decode batch: a row
    # of a prefill's block. Owned by the worker thread.
    kv: tuple[_Block, int] | None = None
    # A constrained request's grammar state (advanced by the worker thread during steps) and the
    # tokens that end it where the grammar allows ending (EOS ids and stop_token_ids).
    matcher: Matcher | None = None
    grammar_end: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class _TokenResult:
    """What one step produced for one sequence (computed in the worker thread)."""

    seq: _Seq
    token: int
    logprob: float
    top: list[LogprobEntry] | None
    text: str | None  # None: not decoded this step (nobody reads it before the end)
    finish: FinishReason | None


@dataclass(frozen=True, slots=True)
class _Block:
    """The KV of a batch of sequences, left-padded: row ``i``'s real keys and values are the
    last ``lens[i]`` columns of every layer's [rows, heads, width, head_dim] tensors."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    lens: list[int]

    @property
    def width(self) -> int:
        return int(self.layers[0][0].shape[2]) if self.layers else 0

    def take(self, rows: list[int]) -> _Block:
        """These rows (in this order), with the columns no kept row uses cut off."""
        lens = [self.lens[r] for r in rows]
        cut = self.width - max(lens)
        if rows == list(range(len(self.lens))) and cut == 0:
            return self
        index = torch.tensor(rows, device=self.layers[0][0].device)
        layers = [
            (k.index_select(0, index)[:, :, cut:], v.index_select(0, index)[:, :, cut:])
            for k, v in self.layers
        ]
        return _Block(layers, lens)

    @staticmethod
    def concat(blocks: list[_Block]) -> _Block:
        """The blocks' rows one after the other, left-padded to the widest (zeros, masked)."""
        if len(blocks) == 1:
            return blocks[0]
        width = max(b.width for b in blocks)
        layers = []
        for layer in range(len(blocks[0].layers)):
            ks, vs = [], []
            for b in blocks:
                k, v = b.layers[layer]
                pad = (0, 0, width - b.width, 0)
                ks.append(torch.nn.functional.pad(k, pad) if pad[2] else k)
                vs.append(torch.nn.functional.pad(v, pad) if pad[2] else v)
            layers.append((torch.cat(ks), torch.cat(vs)))
        return _Block(layers, [n for b in blocks for n in b.lens])


# ---------------------------------------------------------------------------------------------
# Sampling and stop checks (worker thread, pure functions of their inputs)
# ---------------------------------------------------------------------------------------------


def _adjust(seqs: Sequence[_Seq], logits: torch.Tensor) -> None:
    """Apply each row's ``logit_bias`` and frequency / presence penalties to ``logits`` in place
    (before a grammar's mask and before sampling, so the reported logprobs are of the
    distribution actually sampled from). The penalties count the tokens the request has
    generated so far, not its prompt (OpenAI's and SGLang's definition). Rows without any cost
    nothing."""
    for i, s in enumerate(seqs):
        p = s.params
        if p.logit_bias:
            ids = torch.tensor([int(k) for k in p.logit_bias], device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device)
            logits[i].index_add_(0, ids, bias.to(logits.dtype))
        if (p.frequency_penalty or p.presence_penalty) and s.output_ids:
            ids, counts = torch.tensor(s.output_ids).unique(return_counts=True)
            penalty = p.frequency_penalty * counts.float() + p.presence_penalty
            logits[i].index_add_(0, ids.to(logits.device), -penalty.to(logits.device, logits.dtype))


def _sample(seqs: Sequence[_Seq], logits: torch.Tensor) -> list[tuple[int, float, Any]]:
    """Pick one token per row of ``logits`` [B, V], for the whole batch at once.

    The logprob reported is the token's log-probability under the distribution it was sampled
    from *before* top-k/top-p filtering: ``log_softmax(logits / T)`` (``T == 0``: greedy argmax,
    ``log_softmax(logits)``). A constrained row's logits arrive with ``-inf`` outside its
    grammar's allowed tokens, so its logprobs (and top logprobs, which then list allowed tokens
    only) are of the masked distribution renormalised over the allowed tokens, the one actually
    sampled from, as SGLang reports them; a token the grammar forces has logprob 0. A sampled
    row draws by the exponential race (the argmax of ``p / E`` with ``E ~ Exp(1)`` per token
    picks token ``i`` with probability ``p_i``) with noise from its own request's generator, so
    a seeded request gives the same tokens whatever its batch mates are. One device-to-host
    copy per step.
    """
    logits = logits.float()
    batch, vocab = logits.shape
    device = logits.device
    params = [s.params for s in seqs]
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    logprobs = torch.log_softmax(logits / temps.to(device)[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    if sampled:
        rows = torch.tensor(sampled, device=device)
        probs = logprobs.index_select(0, rows).exp()
        top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in sampled]
        top_p = [params[i].top_p for i in sampled]
        if min(top_k) < vocab or min(top_p) < 1.0:
            # Keep each row's top_k most likely tokens and, of those, the smallest prefix whose
            # mass reaches top_p (the most likely token always stays).
            vals, order = torch.sort(probs, dim=-1, descending=True)
            rank = torch.arange(vocab, device=device)[None, :]
            keep = rank < torch.tensor(top_k, device=device)[:, None]
            cum = vals.cumsum(-1)
            keep &= (cum - vals) < torch.tensor(top_p, device=device)[:, None]
            probs = torch.zeros_like(probs).scatter_(1, order, vals * keep)
        noise = torch.empty_like(probs)
        for row, i in enumerate(sampled):
            noise[row].exponential_(generator=seqs[i].generator)
        # A zero draw would divide a filtered-out token's 0 by 0 (NaN wins argmax).
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        tokens = tokens.index_copy(0, rows, torch.argmax(probs / noise, dim=-1))
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top_n = max(s.top_n for s in seqs)
    tops: list[Any] = [None] * batch
    if top_n > 0:
        t_vals, t_idx = torch.topk(logprobs, min(top_n, vocab), dim=-1)
        vals_l, idx_l = t_vals.tolist(), t_idx.tolist()
        for i, s in enumerate(seqs):
            if s.top_n > 0:
                n = min(s.top_n, vocab)
                # Masked-out tokens (-inf, not JSON) are no alternatives.
                tops[i] = [
                    (v, t, None)
                    for v, t in zip(vals_l[i][:n], idx_l[i][:n], strict=True)
                    if v != -math.inf
                ]
    return list(zip(tokens.tolist(), chosen.tolist(), tops, strict=True))


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


def _decode_all(tokenizer: Any, batches: list[tuple[list[int], bool]]) -> list[str]:
    """Decode ``(ids, skip_special_tokens)`` pairs; one call into the Rust tokenizer per flag
    value when the tokenizer has one (a Python call per sequence is most of a decode step's
    CPU at a few hundred sequences)."""
    out: list[str] = [""] * len(batches)
    backend = getattr(tokenizer, "_tokenizer", None)
    for skip in (True, False):
        picked = [i for i, (_, flag) in enumerate(batches) if flag is skip]
        if not picked:
            continue
        ids = [batches[i][0] for i in picked]
        if backend is not None and hasattr(backend, "decode_batch"):
            texts = backend.decode_batch(ids, skip_special_tokens=skip)
        else:
            texts = [tokenizer.decode(x, skip_special_tokens=skip) for x in ids]
        for i, text in zip(picked, texts, strict=True):
            out[i] = text
    return out


def _check(
    seqs: Sequence[_Seq], tokens: Sequence[int], tokenizer: Any
) -> list[tuple[str | None, FinishReason | None]]:
    """Text and finish reason of each sequence after appending its token, in SGLang's order:
    length, stop token (for a constrained request also an EOS id or stop token its grammar
    allowed), stop string. Output ids always keep the token; only the text is trimmed.
    The text is decoded only where it is read: a finished request, a request with stop strings
    (to find them) and a streamed one; elsewhere it is None."""
    finishes: list[FinishReason | None] = []
    wanted: list[tuple[list[int], bool]] = []
    slots: list[int | None] = []
    for seq, token in zip(seqs, tokens, strict=True):
        p = seq.params
        ids = [*seq.output_ids, token]
        finish: FinishReason | None = None
        if len(ids) >= p.max_new_tokens:
            finish = FinishReason.model_validate({"type": "length", "length": p.max_new_tokens})
        elif token in seq.stop_ids or token in seq.grammar_end:
            finish = FinishReason(type="stop", matched=token)
            if not p.no_stop_trim:
                ids = ids[:-1]
        finishes.append(finish)
        if finish is not None or p.stop or seq.chunks:
            slots.append(len(wanted))
            wanted.append((ids, p.skip_special_tokens))
        else:
            slots.append(None)
    texts = _decode_all(tokenizer, wanted)
    out: list[tuple[str | None, FinishReason | None]] = []
    for seq, finish, slot in zip(seqs, finishes, slots, strict=True):
        if slot is None:
            out.append((None, None))
            continue
        full, p = texts[slot], seq.params
        if finish is None and p.stop:
            hits = [(full.find(s), s) for s in p.stop if s and s in full]
            if hits:
                at, stop = min(hits)
                text = full if p.no_stop_trim else full[:at]
                out.append((text, FinishReason(type="stop", matched=stop)))
                continue
        out.append((full if finish is not None else _held_back(full, p.stop or ()), finish))
    return out


# ---------------------------------------------------------------------------------------------
# The worker: model forward passes and KV-cache bookkeeping (runs in one dedicated thread)
# ---------------------------------------------------------------------------------------------


# transformers 5.2x renamed the KV cache (argument and output field) from ``past_key_values``
# to ``cache``; the engine speaks whichever the installed version has.
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), [batch, heads, len, head_dim] (full-attention layers only:
    the engine refuses other models at load time)."""
    layers: list[Any] = list(cache.layers)
    return [(lay.keys, lay.values) for lay in layers]


class _Worker:
    """Runs steps. Not thread-safe: the engine calls it from its single worker thread only.

    The decode batch is one left-padded :class:`_Block` kept across steps while its membership
    is unchanged (the common case). When requests join (a prefill's block) or leave, the new
    batch is assembled block-wise: each block's surviving rows in one ``index_select`` per
    layer, then one left-pad and concatenation per layer, whatever the number of sequences.
    Padding columns hold zeros and are masked.
    """

    def __init__(
        self, model: Any, tokenizer: Any, device: torch.device, grammars: Grammars
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.grammars = grammars
        self._batch: list[_Seq] = []
        self._cache: DynamicCache | None = None  # the decode batch's KV, left-padded
        self._lens: list[int] = []  # each row's real KV length

    def reset(self) -> None:
        """Forget the decode batch (after a failed step; its requests have been finished)."""
        self._batch, self._cache, self._lens = [], None, []

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
        _adjust(seqs, logits)
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        errors = self._constrain(seqs, constrained, logits) if constrained else {}
        picks = _sample(seqs, logits)
        tokens = [token for token, _, _ in picks]
        for i in constrained:
            seq, token = seqs[i], tokens[i]
            assert seq.matcher is not None
            # An ending token is not fed to the matcher: the request ends with it.
            if i not in errors and token not in seq.grammar_end and not seq.matcher.consume(token):
                errors[i] = seq.matcher.error or f"the grammar refused token {token}"
        checks = _check(seqs, tokens, self.tokenizer)
        results = []
        for i, (s, (token, lp, top), (text, finish)) in enumerate(
            zip(seqs, picks, checks, strict=True)
        ):
            if i in errors:
                finish = FinishReason(type="abort", message=f"constraint failed: {errors[i]}")
            results.append(_TokenResult(s, token, lp, top, text, finish))
        return results

    def _constrain(self, seqs: list[_Seq], rows: list[int], logits: torch.Tensor) -> dict[int, str]:
        """Set ``logits`` (in place) to ``-inf`` outside each constrained row's allowed tokens;
        where its grammar may end, its ending tokens are allowed. Returns, per row whose matcher
        failed, why; such a row is left only its ending tokens (its request is then aborted)."""
        matchers = [seqs[i].matcher for i in rows]
        allowed = self.grammars.allowed([m for m in matchers if m is not None])
        width = logits.shape[1]
        if allowed.shape[1] != width:  # a model whose logits are padded past its vocabulary
            padded = np.zeros((len(rows), width), dtype=np.bool_)
            padded[:, : min(width, allowed.shape[1])] = allowed[:, :width]
            allowed = padded
        else:
            allowed = allowed.copy()  # writable and contiguous
        eos = self.grammars.eos
        errors: dict[int, str] = {}
        for r, i in enumerate(rows):
            seq, matcher = seqs[i], matchers[r]
            assert matcher is not None
            ends = [t for t in seq.grammar_end if t < width]
            if eos is not None and allowed[r, eos]:
                allowed[r, ends] = True
            error = matcher.error
            if error or not allowed[r].any():
                errors[i] = error or "the grammar allows no token here"
                allowed[r] = False
                allowed[r, ends] = True
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # In place through numpy: on a CPU, torch's masked_fill over a 150k vocabulary costs
            # some 2 ms a row, this some 0.03 ms.
            view = logits.numpy()
            for r, i in enumerate(rows):
                keep = allowed[r]
                if 2 * int(np.count_nonzero(keep)) < width:  # few allowed: keep those
                    idx = np.flatnonzero(keep)
                    kept = view[i, idx]
                    view[i].fill(-np.inf)
                    view[i, idx] = kept
                else:
                    view[i, np.flatnonzero(~keep)] = -np.inf
        else:
            index = torch.tensor(rows, device=logits.device)
            mask = torch.from_numpy(allowed).to(logits.device)
            logits.index_copy_(
                0, index, logits.index_select(0, index).masked_fill_(~mask, -math.inf)
            )
        return errors

    def _prefill(self, seqs: list[_Seq]) -> torch.Tensor:
        """Left-padded prefill; the sequences' KV stays together as one block."""
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
        cache = getattr(out, _CACHE)
        block = _Block(_kv(cache), [len(s.prompt) for s in seqs])
        for i, s in enumerate(seqs):
            s.kv = (block, i)
        return out.logits[:, -1]

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """One token for each of ``seqs`` (each has a sampled token not yet in its KV)."""
        if (
            self._cache is None
            or len(self._batch) != len(seqs)
            or any(a is not b for a, b in zip(self._batch, seqs, strict=False))
        ):
            self._regroup(seqs)
        assert self._cache is not None
        width = self._cache.get_seq_length()  # the left-padded KV's columns
        lens = torch.tensor(self._lens)
        # Row i's real KV occupies the last lens[i] columns; the new token goes at column width.
        cols = torch.arange(width + 1)
        mask = (cols[None, :] >= (width - lens)[:, None]).long()
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs])
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=lens[:, None].to(self.device),
            **{_CACHE: self._cache},
            use_cache=True,
        )
        self._lens = [n + 1 for n in self._lens]
        return out.logits[:, -1]

    def _regroup(self, seqs: list[_Seq]) -> None:
        """Make ``seqs`` (in this order) the decode batch: rows of the current batch and of
        prefill blocks, taken block-wise."""
        where: dict[int, tuple[_Block, int]] = {}
        if self._cache is not None:
            current = _Block(_kv(self._cache), self._lens)
            for row, s in enumerate(self._batch):
                where[id(s)] = (current, row)
        for s in seqs:
            if s.kv is not None:
                where[id(s)] = s.kv
        if any(id(s) not in where for s in seqs):
            raise RuntimeError("a decoding sequence has no KV cache (scheduler bug)")
        # Consecutive sequences from the same block are taken together (the scheduler keeps
        # the running batch first and appends each prefill's sequences in order).
        parts: list[_Block] = []
        run_block: _Block | None = None
        run_rows: list[int] = []
        for s in seqs:
            block, row = where[id(s)]
            if block is not run_block and run_block is not None:
                parts.append(run_block.take(run_rows))
                run_rows = []
            run_block = block
            run_rows.append(row)
        assert run_block is not None
        parts.append(run_block.take(run_rows))
        for s in seqs:
            s.kv = None
        block = _Block.concat(parts)
        self._cache = DynamicCache(block.layers)
        self._lens = list(block.lens)
        self._batch = list(seqs)


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


# config.json fields that differ between two saves of the same architecture.
_VOLATILE_CONFIG = frozenset(
    {"_name_or_path", "name_or_path", "torch_dtype", "dtype", "transformers_version"}
)


def _same_model_tensors(
    path: str | Path, model: Any, device: torch.device
) -> dict[str, torch.Tensor] | None:
    """The safetensors of ``path`` when its config is ``model``'s (up to volatile fields);
    None when it is another architecture or has no safetensors files. Raises ``OSError`` /
    ``ValueError`` for an unreadable folder."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = Path(path)
    new = AutoConfig.from_pretrained(str(folder)).to_dict()
    old = model.config.to_dict()
    if {k: v for k, v in new.items() if k not in _VOLATILE_CONFIG} != {
        k: v for k, v in old.items() if k not in _VOLATILE_CONFIG
    }:
        return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file), device=str(device)))
    return tensors


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
    * Constrained decoding (``json_schema`` / ``regex`` / ``ebnf``, see
      :mod:`corral.engines.local.grammar`): every token is sampled from the model's
      distribution masked to what the grammar allows, so the output is in the grammar's
      language up to ``max_new_tokens``; it ends (``stop``, EOS) only where the grammar may end,
      ``ignore_eos`` notwithstanding. A constraint that does not compile is an
      ``InvalidRequestError``; a grammar failing mid-generation aborts its request. Requests
      without a constraint never touch the grammar machinery, and batch freely with those
      that have one.
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
        # Cheap until the first constrained request (llguidance is imported then).
        self._grammars = Grammars(tokenizer, self.vocab_size, self.eos_token_ids)
        self._worker = _Worker(model, tokenizer, self.device, self._grammars)
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
        if constraint_of(req.sampling_params) is not None:
            # Compile off the event loop (the first constrained request also builds the
            # tokenizer's grammar view); ``_submit`` then finds it cached.
            await asyncio.to_thread(self._compile, req.sampling_params)
        seq = self._submit(req, chunks=False)
        try:
            await seq.event.wait()  # set once, when the request finishes
        finally:
            if seq.finish is None:
                self.abort(seq.rid, "client went away")
        return self._snapshot(seq, req.return_logprob)

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

        A folder of the loaded architecture (the same ``config.json`` but for names, dtype and
        versions: a trainer's next weights) has its tensors copied into the loaded model as
        :meth:`update_weights_from_tensors` does, with no new model built (a fresh
        ``from_pretrained`` per training step costs more than the copy).
        """
        try:
            tensors = await asyncio.to_thread(
                _same_model_tensors, model_path, self._worker.model, self.device
            )
        except Exception as exc:
            return UpdateWeightsResponse(
                success=False, message=f"failed to load {model_path}: {exc}"
            )
        if tensors is not None:
            answer = await self.update_weights_from_tensors(tensors, weight_version)
            if answer.success:
                self.model_path = str(model_path)
                return UpdateWeightsResponse(
                    success=True, message=f"weights loaded from {model_path}"
                )
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
        """Raise ``InvalidRequestError`` if ``req`` cannot be served (its constraint is compiled
        to find out, and kept in the cache); otherwise return."""
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
        if p.logit_bias:
            bad_keys = [
                k for k in p.logit_bias if not k.isdigit() or not 0 <= int(k) < self.vocab_size
            ]
            if bad_keys:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids in [0, {self.vocab_size}); got "
                    f"{bad_keys[:5]}"
                )
        if req.rid is not None and req.rid in self._active:
            raise InvalidRequestError(f"duplicate request id {req.rid!r} is already in flight")
        if constraint_of(p) is not None:
            self._compile(p)

    def _compile(self, p: SamplingParams) -> Matcher | None:
        """A fresh matcher for ``p``'s constraint (None without one); compiled grammars are
        cached, so validating and then submitting compiles once."""
        constraint = constraint_of(p)
        if constraint is None:
            return None
        try:
            return self._grammars.compile(*constraint)
        except ConstraintError as exc:
            raise InvalidRequestError(str(exc)) from exc

    def _submit(self, req: GenerateRequest, *, chunks: bool = True) -> _Seq:
        if not self.health():
            raise RuntimeError("engine is not running (call start())")
        self.validate(req)
        p = req.sampling_params
        stop_ids: frozenset[int] = frozenset()
        if not p.ignore_eos:  # like SGLang, ignore_eos disables stop_token_ids too
            stop_ids = self.eos_token_ids | frozenset(p.stop_token_ids or ())
        gen = torch.Generator(device=self.device)
        gen.manual_seed(p.sampling_seed if p.sampling_seed is not None else secrets.randbits(62))
        matcher = self._compile(p)
        grammar_end: frozenset[int] = frozenset()
        if matcher is not None:
            # Ending where the grammar may end is always allowed, ignore_eos or not (SGLang
            # too ends a request whose grammar has terminated).
            grammar_end = self.eos_token_ids | frozenset(p.stop_token_ids or ())
            if self._grammars.eos is not None:
                grammar_end |= {self._grammars.eos}
        seq = _Seq(
            rid=req.rid or uuid.uuid4().hex,
            prompt=list(req.input_ids),
            params=p,
            top_n=req.top_logprobs_num,
            stop_ids=stop_ids,
            generator=gen,
            event=asyncio.Event(),
            chunks=chunks,
            weight_version=self.weight_version,
            matcher=matcher,
            grammar_end=grammar_end,
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
        if not seq.chunks and reason.type == "abort":
            # Its text was never decoded along the way: what it generated so far.
            full = self.tokenizer.decode(
                seq.output_ids, skip_special_tokens=seq.params.skip_special_tokens
            )
            seq.text = _held_back(full, seq.params.stop or ())
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
                if r.text is not None:
                    seq.text = r.text
                seq.weight_version = version
                if r.finish is not None:
                    self._finish(seq, r.finish)
                elif seq.chunks:
                    seq.event.set()
            self._running = [s for s in decode + prefill if s.finish is None]
