"""Grammar-constrained decoding for the local engine: SGLang's ``json_schema``, ``regex``, ``ebnf``.

Backed by llguidance (chosen by measurement: ``bench/constrained.py``). A constrained request gets
one :class:`Matcher`; before each of its tokens is sampled, the logits of every token the grammar
does not allow are set to ``-inf``, so greedy and temperature sampling alike only pick allowed
tokens, and the sampled token then advances the matcher. The grammar's end is the request's end:
where the grammar allows ending, the engine's EOS ids and the request's ``stop_token_ids`` are
allowed (the LLM's EOS in llguidance's mask stands for all of them); once the grammar is complete
nothing else is. Unconstrained requests never touch this module.

What each field accepts (the syntax SGLang accepts with ``--grammar-backend llguidance``; its
JSON layout there is llguidance's default, any whitespace):

- ``json_schema``: a JSON Schema. Keywords llguidance does not implement are refused, never
  ignored, so an accepted schema is guaranteed. The layout is ``json.dumps``'s (``", "`` and
  ``": "``, no other whitespace): what chat templates render tool-call arguments in, so that
  generated JSON re-renders token for token. A schema may override this with llguidance's
  ``"x-guidance"`` options (e.g. ``{"whitespace_flexible": true}``).
- ``regex``: Rust ``regex`` syntax (no look-around, no back-references); the whole output must
  match.
- ``ebnf``: llguidance's Lark dialect (what :mod:`corral.gateway.constraints` writes; it can
  inline JSON Schemas with ``%json {...}``, whose layout is llguidance's default, any
  whitespace, unless the inline schema has ``"x-guidance"`` options) or GBNF (llama.cpp /
  xgrammar EBNF, ``root ::= ...``), which llguidance converts.

Tokens: the tokenizer's special tokens (EOS, ``<|im_start|>``...) are never text; a Lark grammar
names them as ``<|im_end|>``. Added tokens that are *not* special (Qwen's ``<tool_call>``,
``<think>``) are text here, as the tokenizer decodes them: a grammar's ``"<tool_call>"`` is
produced by that one token, the tokenization the chat template renders (llguidance alone would
treat every added token as special and spell such markers out byte by byte).

Logprobs: a constrained token's reported logprob is of the distribution it was sampled from,
the model's softmax masked to the allowed tokens and renormalised over them (SGLang applies its
grammar mask to the logits in place before its sampler takes ``log_softmax``, so it reports the
same); a token the grammar forces has logprob 0. For RL that is the behaviour policy's true
probability, which is what importance ratios need; but a trainer that recomputes logprobs with
the bare model (no mask) gets ``log p(token) - log Z`` lower, ``Z`` being the model's mass on
the allowed tokens, so ``new/old`` ratios start below 1 wherever the grammar cut something off.
Either recompute under the same mask, treat the gap as rollout/trainer mismatch (truncated
importance sampling), or leave forced tokens (logprob 0) out of the loss.

Stops: ``stop`` strings and ``stop_token_ids`` still end a constrained request wherever they
appear, as in SGLang, so an output they cut short need not be complete; EOS is allowed only
where the grammar may end.

Failure modes: a schema, regex or grammar that does not compile is a :class:`ConstraintError`
with llguidance's message (the engine answers 400). Compilation and every mask are bounded by
llguidance's parser limits (fuel), so a pathological grammar fails instead of hanging. A matcher
that fails during generation (a limit hit, a library error) ends its request with ``abort`` and
the error as message; it never lets an unconstrained token through.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

__all__ = [
    "ConstraintError",
    "ConstraintKind",
    "Grammars",
    "Matcher",
    "byte_decoder",
    "constraint_of",
]

ConstraintKind = Literal["json_schema", "regex", "ebnf"]

# json.dumps's layout (see the module docstring); a schema's own "x-guidance" overrides it.
_JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_CACHE_SIZE = 128


class ConstraintError(ValueError):
    """A constraint that cannot be served: does not compile, or llguidance is missing."""


def constraint_of(params: Any) -> tuple[ConstraintKind, str] | None:
    """The (kind, text) of a ``SamplingParams``' constraint, or None when it has none."""
    kinds: tuple[ConstraintKind, ...] = ("json_schema", "regex", "ebnf")
    for kind in kinds:
        value = getattr(params, kind, None)
        if value is not None:
            return kind, str(value)
    return None


class Matcher:
    """One request's grammar state. Used by one thread at a time (the engine's worker)."""

    def __init__(self, ll: Any) -> None:
        self._ll = ll

    def consume(self, token: int) -> bool:
        """Advance by ``token``; False (and :attr:`error` set) when the grammar refuses it."""
        return bool(self._ll.consume_token(token))

    @property
    def error(self) -> str:
        """Why the matcher failed, or "" while it has not."""
        return str(self._ll.get_error()) if self._ll.is_error() else ""


def byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes-to-unicode table), inverted."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    codes = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def _is_byte_level(spec: dict[str, Any]) -> bool:
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return spec.get("model", {}).get("type") == "BPE" and any(
        isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts
    )


class _TokenSource:
    """What llguidance's ``TokenizerWrapper`` reads: every id's bytes, the special ids, EOS and
    an encoder (llguidance uses it only for helpers the engine does not call)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos: int, llguidance: Any) -> None:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        added = spec.get("added_tokens") or []
        special = {int(a["id"]) for a in added if a.get("special")}
        text = {int(a["id"]): str(a["content"]).encode() for a in added if not a.get("special")}
        tokens = [b""] * vocab_size  # ids the tokenizer does not have are never allowed
        if _is_byte_level(spec):
            table = byte_decoder()
            for piece, i in spec["model"]["vocab"].items():
                if 0 <= i < vocab_size:
                    tokens[i] = bytes(table[c] for c in piece)
        else:
            # Other tokenizer kinds (SentencePiece-style and so on): llguidance's own reading.
            plain = llguidance.LLTokenizer(
                tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos
            )
            tokens = [plain.decode_bytes([i]) for i in range(vocab_size)]
        for i in range(vocab_size):
            if i in text:
                tokens[i] = text[i]
            elif i in special:
                # llguidance names special tokens by their text; it never treats them as text.
                tokens[i] = str(tokenizer.convert_ids_to_tokens(i)).encode()
        self.tokens = tokens
        self.special_token_ids = sorted(i for i in special | {eos} if i < vocab_size)
        self.eos_token_id = eos
        self.bos_token_id = None
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))


class Grammars:
    """One engine's constrained decoding: the tokenizer's llguidance view (built on first use,
    about 40 ms for the tiny model and 2 s for a 150k vocabulary on a CPU core) and a cache of
    compiled grammars (the last 128 distinct constraints), so that ``n`` choices or repeated
    tool schemas compile once.

    ``compile`` may be called from any thread; ``allowed``/matchers from the worker thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        eos = tokenizer.eos_token_id
        if eos_ids and eos not in eos_ids:
            eos = min(eos_ids)
        # The id whose bit in llguidance's mask means "the grammar may end here".
        self.eos: int | None = eos
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._llg: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def ready(self) -> None:
        """Build the tokenizer view now (blocking); raises :class:`ConstraintError`."""
        with self._lock:
            if self._ll_tokenizer is not None:
                return
            try:
                import llguidance
            except ImportError as exc:
                raise ConstraintError(
                    "constrained decoding (json_schema, regex, ebnf) needs llguidance: "
                    "pip install 'corral[local]'"
                ) from exc
            if self.eos is None:
                raise ConstraintError("the model has no EOS token: a grammar could never end")
            if getattr(self._tokenizer, "backend_tokenizer", None) is None:
                raise ConstraintError("constrained decoding needs a fast (Rust) tokenizer")
            source = _TokenSource(self._tokenizer, self.vocab_size, self.eos, llguidance)
            self._ll_tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(source), n_vocab=self.vocab_size
            )
            self._executor = llguidance.LLExecutor(num_threads=min(4, os.cpu_count() or 1))
            self._llg = llguidance

    def compile(self, kind: ConstraintKind, text: str) -> Matcher:
        """A fresh matcher for this constraint; :class:`ConstraintError` saying why not."""
        self.ready()
        key = (kind, text)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = self._build(kind, text)
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return Matcher(template.deep_copy())

    def _build(self, kind: ConstraintKind, text: str) -> Any:
        llg = self._llg
        try:
            if kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_LAYOUT)
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(text)
            else:
                grammar = llg.grammar_from("ebnf", text)
        except (ValueError, TypeError) as exc:
            raise ConstraintError(f"invalid {kind}: {exc}") from exc
        matcher = llg.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            # The first mask (computing it does not advance the matcher): a grammar that admits
            # no output (a schema that only refers to itself, say) or is too large for the
            # parser's limits fails here, as a bad request, not mid-generation.
            probe = matcher
            words = (self.vocab_size + 31) // 32
            mask = np.zeros(words, dtype=np.int32)  # held: llguidance writes through it
            probe.unsafe_compute_mask_ptr(mask.ctypes.data, 4 * words)
            if probe.is_error():
                message = probe.get_error().strip().splitlines()[0]
                raise ConstraintError(f"{kind} admits no output ({message})")
        if matcher.is_error():
            raise ConstraintError(f"invalid {kind}: {matcher.get_error().strip()}")
        return matcher

    def allowed(self, matchers: Sequence[Matcher]) -> np.ndarray:
        """Each matcher's allowed next tokens, a [len(matchers), vocab_size] bool array.

        A failed matcher allows only EOS (check :attr:`Matcher.error`). The masks of several
        matchers are computed in parallel, outside the GIL.
        """
        n, words = len(matchers), (self.vocab_size + 31) // 32
        bitmask = np.zeros((n, words), dtype=np.int32)  # held: llguidance writes through it
        if n == 1:
            matchers[0]._ll.unsafe_compute_mask_ptr(bitmask.ctypes.data, words * 4)
        else:
            pairs = [(m._ll, i) for i, m in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, words * 4, n)
        # Bit j of word w is token 32 w + j (little-endian words). numpy unpacks this some
        # 100 times faster than torch's shifts do on a CPU.
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return bits[:, : self.vocab_size].view(np.bool_)
