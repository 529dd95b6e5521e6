"""A tiny Qwen2-family chat model, built offline in seconds, for tests and the embedded default.

``build_tiny_model(out)`` writes a Hugging Face model folder that ``AutoTokenizer`` and
``AutoModelForCausalLM`` load:

- a byte-level BPE tokenizer trained on generated chat text, with Qwen 2.5's special tokens
  (``<|endoftext|>`` = pad, ``<|im_start|>``, ``<|im_end|>`` = eos) and Qwen's added, non-special
  markers (``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``,
  ``<think>``, ``</think>``), so that text splits the same at those markers whatever surrounds it;
- one of the chat templates of ``corral.engines.chat_templates``;
- random, seeded Qwen2 weights (hidden 64, 2 layers, tied embeddings; under 1 MB); with
  ``size="vllm"``, hidden 128 and 2 heads of dimension 64 instead, because vLLM's CPU attention
  needs a head dimension of 32 or more (the default model's is 16);
- with ``imprint=True`` (the default), a few seconds of next-token training on generated
  transcripts, loss on assistant tokens only, until greedy decoding follows the contract below
  on held-out transcripts with a safety margin on every token.

Contract after imprinting, greedy decoding from ``render(messages, add_generation_prompt=True,
tools=TOOLS)`` (``CITIES`` names the cities; system prompt present or not; 0-3 earlier turns):

- last message user ``What is the weather in {city}?`` -> ``<tool_call>\\n{"name":
  "get_weather", "arguments": {"city": "{city}"}}\\n</tool_call><|im_end|>``;
- user ``What is the weather in {c1} and {c2}?`` -> two such calls joined by ``\\n``, then
  ``<|im_end|>``;
- last message(s) tool results after those calls -> one plain sentence, ``I have checked the
  weather in {city}.`` (or ``... in {c1} and {c2}.``), then ``<|im_end|>``. The cities are copied
  from the calls; for two cities the copy is not reliable on every CPU (float results differ by
  CPU: 39 of 56 city pairs right on one machine), so tests should not depend on it;
- user ``Say hello.`` -> ``Hello!<|im_end|>`` (with or without tools).

The ``qwen3`` variant writes ``<think>\\n{a short thought}\\n</think>\\n\\n`` before each answer,
and its template drops those blocks from earlier turns, so later turns drift by design.

Everything is deterministic for a given ``seed`` on a given machine (same torch build and
thread count): the same seed gives bit-identical weights.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from corral.engines.chat_templates import CHAT_TEMPLATES, TemplateName

__all__ = [
    "CITIES",
    "CONDITIONS",
    "TOOLS",
    "BuildProgress",
    "BuildStats",
    "ModelSize",
    "build_tiny_model",
    "cached_tiny_model",
    "read_build_stats",
]

CITIES: Final = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome")
CONDITIONS: Final = ("sunny", "rainy", "cloudy", "windy", "snowy")

TOOLS: Final[list[dict[str, Any]]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]

SPECIAL_TOKENS: Final = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added but not special, as in Qwen's tokenizers: decoded with skip_special_tokens=True they stay.
MARKER_TOKENS: Final = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

_VOCAB_SIZE: Final = 1536
_MAX_POSITIONS: Final = 4096


@dataclass(frozen=True)
class _Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


# "tiny": the default (head dimension 16). "vllm": the smallest shape vLLM's CPU attention
# serves (it needs a head dimension of at least 32): 2 heads of 64, all of them key/value heads.
ModelSize = Literal["tiny", "vllm"]
_SHAPES: Final[dict[str, _Shape]] = {
    "tiny": _Shape(hidden=64, intermediate=256, layers=2, heads=4, kv_heads=2),
    "vllm": _Shape(hidden=128, intermediate=256, layers=2, heads=2, kv_heads=2),
}

_SYSTEM_PROMPTS: Final = (
    None,
    None,
    "You are a helpful assistant.",
    "You are a weather assistant. Use the tools.",
    "Answer briefly.",
    "You are Corral's tiny test model.",
)

_THOUGHTS: Final = {
    "weather1": "I should check the weather.",
    "weather2": "I should check the weather in both cities.",
    "answer1": "The tool has answered.",
    "answer2": "Both tools have answered.",
    "hello": "The user wants a greeting.",
}


@dataclass(frozen=True)
class BuildStats:
    """Numbers of the last ``build_tiny_model`` call in this process (for reports and logs)."""

    seconds: float
    imprint_seconds: float
    steps: int
    final_loss: float
    min_margin: float
    vocab_size: int
    parameters: int


BUILD_STATS_FILE: Final = "corral_build.json"

# How a build reports progress, for a caller's display (the library prints nothing): called
# with (phase, done, total) as each phase starts and moves on: "tokenizer" (0 then 1 of 1),
# "imprint" (steps done of all steps; absent with imprint=False), "save" (0 then 1 of 1).
BuildProgress = Callable[[str, int, int], None]


def _no_progress(phase: str, done: int, total: int) -> None:
    """The default BuildProgress: report nowhere."""


def read_build_stats(model_dir: Path) -> BuildStats:
    """The ``BuildStats`` a build wrote beside the model (``corral_build.json``)."""
    return BuildStats(**json.loads((Path(model_dir) / BUILD_STATS_FILE).read_text()))


def cached_tiny_model(
    template: Literal["qwen25", "qwen3"] = "qwen25",
    *,
    seed: int = 0,
    imprint: bool = True,
    cache_dir: Path | None = None,
    progress: BuildProgress | None = None,
    size: ModelSize = "tiny",
) -> Path:
    """The tiny model from a cache folder, built there first if absent.

    ``progress`` follows the build (see :data:`BuildProgress`); it is not called on a cache hit.

    The key covers the arguments and the source of this module and of the chat templates, so
    a change to either builds afresh. ``cache_dir`` defaults to ``~/.cache/corral/tiny``. The
    build goes to a temporary sibling folder renamed into place, so a crash or a concurrent
    build never leaves a half-written model under the key.
    """
    import hashlib
    import shutil
    import tempfile

    from corral.engines import chat_templates

    digest = hashlib.sha256()
    for source in (Path(__file__), Path(chat_templates.__file__)):
        digest.update(source.read_bytes())
    # The default size adds nothing to the key, which stays what it was before sizes existed.
    digest.update(f"{template}/{seed}/{imprint}{'' if size == 'tiny' else '/' + size}".encode())
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "corral" / "tiny"
    prefix = template if size == "tiny" else f"{template}-{size}"
    target = root / f"{prefix}-{digest.hexdigest()[:16]}"
    if (target / BUILD_STATS_FILE).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        build_tiny_model(
            scratch / "model",
            template=template,
            seed=seed,
            imprint=imprint,
            progress=progress,
            size=size,
        )
        try:
            (scratch / "model").rename(target)
        except OSError:
            if not (target / BUILD_STATS_FILE).exists():  # not a concurrent build's win
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def build_tiny_model(
    out: Path,
    *,
    template: Literal["qwen25", "qwen3"] = "qwen25",
    seed: int = 0,
    imprint: bool = True,
    progress: BuildProgress | None = None,
    size: ModelSize = "tiny",
) -> Path:
    """Build the tiny chat model into folder ``out`` (created, files overwritten) and return it.

    Offline and in seconds on a CPU. ``template`` picks the chat template and, when imprinting,
    whether answers start with a ``<think>`` block (``qwen3``). ``seed`` fixes the tokenizer
    corpus, the initial weights and the imprinting data. ``imprint=False`` leaves the weights
    random (a tokenizer-and-template-only model that babbles). ``progress`` hears of each
    phase and imprinting step (:data:`BuildProgress`). ``size`` picks the shape: ``"tiny"``
    (the default) or ``"vllm"`` (head dimension 64, which vLLM's CPU backend can serve).
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if template not in CHAT_TEMPLATES:
        raise ValueError(f"unknown template {template!r}; expected one of {sorted(CHAT_TEMPLATES)}")
    if size not in _SHAPES:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SHAPES)}")
    shape = _SHAPES[size]
    started = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    report = progress or _no_progress

    report("tokenizer", 0, 1)
    tokenizer = _build_tokenizer(template, rng)
    report("tokenizer", 1, 1)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=_MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        dtype="float32",
        initializer_range=_SCHEDULE.init_std,
    )
    # fork_rng: seed the initial weights without touching the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    imprint_started = time.perf_counter()
    steps, loss, margin = 0, float("nan"), float("nan")
    if imprint:
        # One thread: the same float results on every machine (reductions split the same way),
        # and on a busy 2-core box one thread is faster than two fighting for the cores.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            steps, loss, margin = _imprint(model, tokenizer, template, rng, progress)
        finally:
            torch.set_num_threads(threads)
    imprint_seconds = time.perf_counter() - imprint_started

    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
    )
    report("save", 0, 1)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stats = BuildStats(
        seconds=time.perf_counter() - started,
        imprint_seconds=imprint_seconds,
        steps=steps,
        final_loss=loss,
        min_margin=margin,
        vocab_size=len(tokenizer),
        parameters=sum(p.numel() for p in model.parameters()),
    )
    (out / BUILD_STATS_FILE).write_text(json.dumps(dataclasses.asdict(stats), indent=2))
    report("save", 1, 1)
    return out


# ---------------------------------------------------------------------------------------------
# Generated conversations


def _weather_result(rng: random.Random, city: str, condition: str) -> str:
    temp = rng.randint(-5, 35)
    return rng.choice(
        (
            json.dumps({"city": city, "weather": condition, "temp_c": temp}),
            f"{condition}, {temp} C",
            f"The weather in {city} is {condition}.",
            condition,
        )
    )


def _call(name: str, arguments: dict[str, Any], index: int) -> dict[str, Any]:
    # The shape an OpenAI client sends back, with arguments as a JSON string half of the time
    # would be just as valid; the gateway passes them on, so the dict form is what we train on.
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _exchange(rng: random.Random, kind: str, think: bool) -> list[dict[str, Any]]:
    """One user query and everything the assistant does about it."""

    def assistant(thought: str, **fields: Any) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "", **fields}
        if think:
            message["reasoning_content"] = _THOUGHTS[thought]
        return message

    if kind == "hello":
        return [{"role": "user", "content": "Say hello."}, assistant("hello", content="Hello!")]
    if kind == "weather1":
        city = rng.choice(CITIES)
        condition = rng.choice(CONDITIONS)
        return [
            {"role": "user", "content": f"What is the weather in {city}?"},
            assistant("weather1", tool_calls=[_call("get_weather", {"city": city}, 0)]),
            {
                "role": "tool",
                "tool_call_id": "call_0",
                "content": _weather_result(rng, city, condition),
            },
            assistant("answer1", content=f"I have checked the weather in {city}."),
        ]
    c1, c2 = rng.sample(CITIES, 2)
    w1, w2 = rng.choice(CONDITIONS), rng.choice(CONDITIONS)
    return [
        {"role": "user", "content": f"What is the weather in {c1} and {c2}?"},
        assistant(
            "weather2",
            tool_calls=[
                _call("get_weather", {"city": c1}, 0),
                _call("get_weather", {"city": c2}, 1),
            ],
        ),
        {"role": "tool", "tool_call_id": "call_0", "content": _weather_result(rng, c1, w1)},
        {"role": "tool", "tool_call_id": "call_1", "content": _weather_result(rng, c2, w2)},
        assistant("answer2", content=f"I have checked the weather in {c1} and {c2}."),
    ]


def _conversation(rng: random.Random, think: bool) -> tuple[list[dict[str, Any]], bool]:
    """A transcript (messages) and whether it is rendered with ``TOOLS``."""
    if rng.random() < _P_BARE:
        # Short transcripts without a system turn: attention learns to find the city (or the
        # condition) to copy far faster among 50 tokens than among 400, and what it learns there
        # carries over to the long transcripts.
        kinds: tuple[str, ...] = ("weather1", "weather2", "hello")
        messages: list[dict[str, Any]] = []
        for _ in range(rng.randint(1, 2)):
            messages += _exchange(rng, rng.choice(kinds), think)
        return messages, False
    with_tools = rng.random() < 0.85
    kinds = ("weather1", "weather1", "weather2", "weather2", "hello") if with_tools else ("hello",)
    system = rng.choice(_SYSTEM_PROMPTS)
    messages = [] if system is None else [{"role": "system", "content": system}]
    for _ in range(1 + min(rng.randint(0, 3), rng.randint(0, 3))):
        messages += _exchange(rng, rng.choice(kinds), think)
    return messages, with_tools


_P_BARE = 0.7


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any, gen: bool) -> str:
    text = tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=gen
    )
    assert isinstance(text, str)
    return text


def _segments(
    tokenizer: Any, messages: list[dict[str, Any]], tools: Any, think: bool
) -> list[tuple[str, bool]]:
    """Split a rendered transcript into (text, is_model_output) pieces, ending at the last reply.

    A model-output piece is exactly what greedy decoding must produce after the text before it,
    ``<|im_end|>`` included. Because the template is prefix-stable (tested), the prompt of the
    k-th assistant message is the render up to its k-th ``<|im_start|>assistant\\n``, so one
    render per transcript is enough. Only replies rendered as generated are trained on: all of
    them for qwen25, those after the last user query for qwen3 (earlier ones lose their think
    block, and training on them would teach the model to skip it).
    """
    full = _render(tokenizer, messages, tools, gen=False)
    header = "<|im_start|>assistant\n"
    starts = [m.end() for m in re.finditer(re.escape(header), full)]
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(starts) == len(assistant_at)
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for start, index in zip(starts, assistant_at, strict=True):
        if think and index < last_user:
            continue
        end = full.index("<|im_end|>", start) + len("<|im_end|>")
        pieces += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    return pieces


def _corpus_text(rng: random.Random, n: int) -> list[str]:
    """Plain text for the BPE trainer: conversations and the tools block, markers removed."""
    from jinja2 import Environment

    # The tokenizer does not exist yet, so render with a bare Jinja environment carrying the two
    # things the templates need from transformers' one (tojson, raise_exception).
    env = Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
    texts = []
    for name, source in CHAT_TEMPLATES.items():
        compiled = env.from_string(source)
        for _ in range(n):
            messages, with_tools = _conversation(rng, think=name == "qwen3")
            texts.append(compiled.render(messages=messages, tools=TOOLS if with_tools else None))
    # Some general text so that ordinary words and numbers get merges too.
    words = [
        "the", "a", "is", "in", "and", "of", "to", "you", "it", "what", "how", "please", "can",
        "weather", "today", "tomorrow", "city", "sum", "number", "answer", "question", "hello",
        "thanks", "sure", "I", "will", "check", "call", "tool", "result", "function", "error",
    ]  # fmt: skip
    for _ in range(n):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))
        texts.append(f"{sentence.capitalize()} {rng.randint(0, 999)}.")
    for marker in (*SPECIAL_TOKENS, *MARKER_TOKENS):
        texts = [t.replace(marker, "\n") for t in texts]
    return texts


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _build_tokenizer(template: TemplateName, rng: random.Random) -> Any:
    """Train the byte-level BPE and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so that any text round-trips whatever the corpus held.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus_text(rng, 300), trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATES[template],
        model_max_length=_MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


# ---------------------------------------------------------------------------------------------
# Imprinting


@dataclass
class _Example:
    ids: list[int]
    # targets[t] is the token to predict at position t (ids[t + 1]) or -100 where no loss.
    targets: list[int]


def _examples(tokenizer: Any, rng: random.Random, n: int, think: bool) -> list[_Example]:
    examples = []
    for _ in range(n):
        messages, with_tools = _conversation(rng, think)
        pieces = _segments(tokenizer, messages, TOOLS if with_tools else None, think)
        encoded = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
        ids: list[int] = []
        labels: list[int] = []
        for (_, trained), piece_ids in zip(pieces, encoded, strict=True):
            ids += piece_ids
            labels += piece_ids if trained else [-100] * len(piece_ids)
        examples.append(_Example(ids=ids, targets=[*labels[1:], -100]))
    return examples


def _batches(
    examples: list[_Example], size: int, rng: random.Random, by_length: bool
) -> list[list[_Example]]:
    # Batches of similar lengths waste little on padding; their order is shuffled.
    ordered = list(examples)
    rng.shuffle(ordered)
    if by_length:
        ordered.sort(key=lambda e: len(e.ids))
    batches = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    rng.shuffle(batches)
    return batches


def _tensors(batch: list[_Example], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(e.ids) for e in batch)
    # Right padding needs no attention mask: causal attention never looks at later positions.
    ids = torch.tensor([e.ids + [pad_id] * (width - len(e.ids)) for e in batch])
    targets = torch.tensor([e.targets + [-100] * (width - len(e.ids)) for e in batch])
    return ids, targets


def _logits_at_targets(model: Any, ids: Any, targets: Any) -> tuple[Any, Any]:
    """Logits at the positions that carry a loss, and their targets (the vocab projection is the
    costliest matmul of so small a model; computing it only where it counts halves a step)."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    where = targets != -100
    return model.lm_head(hidden[where]), targets[where]


def _check(model: Any, examples: list[_Example], pad_id: int) -> tuple[float, float]:
    """Teacher-forced check: (fraction of target tokens that are the argmax, smallest margin
    between the target's logit and the best other one). All tokens right means greedy decoding
    reproduces every reply exactly; the margin says how safely."""
    import torch

    correct, total, margin = 0, 0, float("inf")
    model.eval()
    with torch.no_grad():
        for start in range(0, len(examples), 32):
            ids, targets = _tensors(examples[start : start + 32], pad_id)
            logits, wanted = _logits_at_targets(model, ids, targets)
            target_logit = logits.gather(1, wanted[:, None])[:, 0]
            others = logits.scatter(1, wanted[:, None], float("-inf")).max(dim=1).values
            gap = target_logit - others
            correct += int((gap > 0).sum())
            total += int(gap.numel())
            margin = min(margin, float(gap.min()))
    model.train()
    return correct / max(total, 1), margin


@dataclass(frozen=True)
class _Schedule:
    # 768 examples and 600 steps at 3e-3 met the contract on some CPUs and not on others (the
    # float results differ by CPU): on one, 23% of fresh two-city transcripts had a wrong
    # token. Twice the examples and 900 steps at 2e-3 brought that to 5% there.
    train_examples: int = 1536
    held_out: int = 96
    batch_size: int = 16
    lr: float = 2e-3
    warmup: int = 30
    steps: int = 900
    # Initial weight scale. Far above Hugging Face's 0.02: at 0.02 attention starts almost uniform
    # over hundreds of positions and copying the city out of the question sits on a plateau for
    # thousands of steps; at 0.1-0.2 it is learnt within a few hundred (measured).
    init_std: float = 0.2
    sort_batches: bool = True


_SCHEDULE = _Schedule()


def _imprint(
    model: Any,
    tokenizer: Any,
    template: TemplateName,
    rng: random.Random,
    progress: BuildProgress | None = None,
) -> tuple[int, float, float]:
    """Train for a fixed number of steps (warmup, then cosine decay to zero, so the last steps
    settle every reply exactly); returns (steps, last loss, smallest margin on held-out replies,
    negative when some held-out token is not the greedy choice). ``progress`` hears of every
    step; without it a terminal gets a tqdm bar."""
    import math

    import torch
    from tqdm.auto import tqdm

    plan = _SCHEDULE
    think = template == "qwen3"
    pad_id = tokenizer.pad_token_id
    train = _examples(tokenizer, rng, plan.train_examples, think)
    held_out = _examples(tokenizer, rng, plan.held_out, think)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=plan.lr, weight_decay=0.0, betas=(0.9, 0.98)
    )

    def factor(step: int) -> float:
        if step < plan.warmup:
            return (step + 1) / plan.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - plan.warmup) / (plan.steps - plan.warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model.train()
    batches: list[list[_Example]] = []
    loss_value = float("nan")
    report = progress or _no_progress
    report("imprint", 0, plan.steps)
    # A caller's display replaces the bar (two bars over each other would garble both).
    quiet = progress is not None or not sys.stderr.isatty()
    with tqdm(total=plan.steps, desc="imprint", disable=quiet, leave=False) as bar:
        for step in range(1, plan.steps + 1):
            if not batches:
                batches = _batches(train, plan.batch_size, rng, plan.sort_batches)
            ids, targets = _tensors(batches.pop(), pad_id)
            logits, wanted = _logits_at_targets(model, ids, targets)
            loss = torch.nn.functional.cross_entropy(logits, wanted)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_value = float(loss.detach())
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}")
            report("imprint", step, plan.steps)
            if _DEBUG and step % 100 == 0:
                accuracy, margin = _check(model, held_out, pad_id)
                print(f"step {step} loss {loss_value:.4f} acc {accuracy:.4f} margin {margin:.2f}")
    accuracy, margin = _check(model, held_out, pad_id)
    model.eval()
    return plan.steps, loss_value, margin


_DEBUG = False
