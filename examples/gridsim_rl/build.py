"""Stage 2: the tokenizer and the randomly initialised model, as one Hugging Face folder.

:func:`train_tokenizer` trains a byte-level BPE (Hugging Face ``tokenizers``, as corral's tiny
model does) on gridsim text and wraps it with a ChatML tool-calling template: corral's Qwen 2.5
template (``corral.engines.chat_templates``) or :data:`COMPACT_TEMPLATE`, the same turns without
the system turn; either way the gateway's ``qwen25`` tool-call parser reads back what a model
writes. Qwen's special tokens (``<|endoftext|>`` pad, ``<|im_start|>``, ``<|im_end|>`` eos) and
Qwen's non-special markers (``<tool_call>`` ...) as in corral's tiny model.

The pre-tokenizer is a regex split before the byte-level mapping, shaped for this task: an hour
label (``07:00``) stays whole; a number keeps its sign and a leading space or ``[``/``,``
(`` 61``, `` -54``, ``, -1``); cents stay whole (``.83``); words as in GPT-2. So an hour of the
price table is 4 tokens (label, integer part, cents, newline) whatever the price, a schedule
entry is one token, and the integer part of a price is one token that can carry its magnitude.

:func:`build_model` writes the folder: a seeded random Qwen3 decoder (tied embeddings) in
bfloat16, the tokenizer and a generation config; ``build.json`` beside them holds the counts.
Qwen3, not Qwen2: transformers' ``AutoTokenizer`` loads a ``qwen2`` model's tokenizer as
``Qwen2Tokenizer``, which replaces the pre-tokenizer with Qwen's own (digits one by one)
whatever ``tokenizer.json`` holds; for ``qwen3`` it keeps the file's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from corral.engines.chat_templates import QWEN25, QWEN25_COMPACT
from corral.engines.tiny_model import MARKER_TOKENS, SPECIAL_TOKENS
from corral.envs.episode import Task

from .days import row_messages
from .settings import ModelSettings, TokenizerSettings

# qwen25-compact leaves out the system turn: the system prompt and tool schemas, identical in
# every gridsim row, are not rendered (a prompt is ~190 tokens instead of ~930).
TEMPLATES = {"qwen25": QWEN25, "qwen25-compact": QWEN25_COMPACT}
PRE_TOKENIZER_PATTERN = (
    r"'s|'t|'re|'ve|'m|'ll|'d"
    r"|\p{N}+:\p{N}+"  # hour labels
    r"|[\[,] ?-?\p{N}+"  # list items: [0  , 0  , -1
    r"| ?-?\p{N}+"  # integers, signed, with their leading space
    r"|\.\p{N}+"  # decimals
    r"| ?\p{L}+"
    r"| ?[^\s\p{L}\p{N}]+"
    r"|\s+(?!\S)|\s+"
)
# Conversations rendered in full (system prompt and tools included) for the BPE corpus; the other
# days add only their user prompt and reply, so the fixed text does not crowd out the numbers.
_FULL_RENDERS = 50
BUILD_FILE = "build.json"


def submission_call(schedule: Sequence[int]) -> dict[str, Any]:
    """The OpenAI tool call of a submission (arguments as a JSON string, as OpenAI sends them)."""
    return {
        "id": "call_0",
        "type": "function",
        "function": {
            "name": "submit_schedule",
            "arguments": json.dumps({"schedule": list(schedule)}),
        },
    }


def conversation(task: Task, schedule: Sequence[int]) -> list[dict[str, Any]]:
    """The row's messages of ``task`` and the submission of ``schedule`` as the reply."""
    reply = {"role": "assistant", "content": None, "tool_calls": [submission_call(schedule)]}
    return [*row_messages(task), reply]


def corpus(conversations: Iterable[dict[str, Any]], template_name: str) -> list[str]:
    """The BPE's training text from transcripts (``{"messages", "tools"}``, see
    :mod:`.transcripts`): the first ones rendered whole with the chat template, the rest as
    their user prompt and reply; template markers become newlines (they are added tokens,
    never merged)."""
    from jinja2 import Environment

    # The tokenizer does not exist yet: a bare Jinja environment with transformers' tojson.
    env = Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    template = env.from_string(TEMPLATES[template_name])
    texts = []
    for i, line in enumerate(conversations):
        messages = line["messages"]
        reply = messages[-1]
        reply = {**reply, "tool_calls": [_with_object_arguments(c) for c in reply["tool_calls"]]}
        if i < _FULL_RENDERS:
            texts.append(template.render(messages=[*messages[:-1], reply], tools=line["tools"]))
        else:
            texts.append(template.render(messages=[messages[-2], reply], tools=None))
    for marker in (*SPECIAL_TOKENS, *MARKER_TOKENS):
        texts = [t.replace(marker, "\n") for t in texts]
    return texts


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    # What corral.gateway.rendering.template_messages hands the template: arguments as objects.
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}


def train_tokenizer(texts: Iterable[str], settings: TokenizerSettings) -> Any:
    """A ``PreTrainedTokenizerFast`` trained on ``texts`` (module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=settings.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols: any text round-trips whatever the corpus held.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=TEMPLATES[settings.template],
        clean_up_tokenization_spaces=False,
    )


def build_model(out: Path, tokenizer: Any, settings: ModelSettings) -> dict[str, Any]:
    """Write the model folder ``out`` (module docstring) and return what ``build.json`` holds:
    ``parameters``, ``safetensors_bytes``, ``vocab_size`` and the settings."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer.model_max_length = settings.max_position_embeddings
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_hidden_layers,
        num_attention_heads=settings.num_attention_heads,
        num_key_value_heads=settings.num_key_value_heads,
        head_dim=settings.hidden_size // settings.num_attention_heads,
        attention_bias=False,
        max_position_embeddings=settings.max_position_embeddings,
        rope_theta=settings.rope_theta,
        initializer_range=settings.init_std,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    # fork_rng: seed the weights without touching the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        random.seed(settings.seed)
        model = Qwen3ForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    info = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "safetensors_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
        "vocab_size": len(tokenizer),
        "model": settings.model_dump(),
    }
    (out / BUILD_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info
