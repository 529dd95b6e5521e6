"""Incremental detokenization: text deltas from a growing list of token ids.

Byte-level BPE tokens can end inside a UTF-8 character; a delta is held back until the
character is complete, so streamed text never carries a replacement character that the full
decode would not.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

# How many already-emitted tokens to re-decode as context: enough for a split character and
# for tokenizers whose decoding of a token depends on its left neighbour.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens already turned into emitted text

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=self._skip))

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) < len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        return delta

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character decodes as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]
