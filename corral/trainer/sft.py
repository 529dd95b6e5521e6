"""Supervised fine-tuning on chat transcripts with the policy trainer: the warm start before RL.

Data. :func:`read_chat_examples` reads JSONL in OpenAI's chat fine-tuning shape, one
conversation per line::

    {"messages": [{"role": "system", ...}, {"role": "user", ...},
                  {"role": "assistant", "content": ..., "tool_calls": [...]},
                  {"role": "tool", "tool_call_id": ..., "content": ...}, ...],
     "tools": [{"type": "function", "function": {"name": ..., "parameters": {...}}}]}

Every message must be one the gateway accepts (``corral.gateway.openai_types.ChatMessage``);
besides, an assistant message may carry OpenAI's ``"weight": 0`` (its tokens are context, not
targets), and a tool call's ``arguments`` may be given as a JSON object instead of a JSON string.

Tokens. :func:`tokenize_chat` renders a conversation with the gateway's own renderer
(``corral.gateway.rendering``: the same message conversion, the same chat template call, the
same encoding), so the tokens trained on here are the tokens the gateway sends the engine and
records for RL, and the tool calls the model learns to write are the ones the gateway's
tool-call parser reads back. The loss mask is 1 on what the model itself would produce in a live
session: each trained assistant reply and its end-of-turn token; 0 on everything the gateway
renders (system, user and tool turns, the generation prompt ``<|im_start|>assistant\\n``, the
glue after the end-of-turn token), exactly the split of the RL samples the gateway records.

Training. :func:`sft_update` is one optimizer step: samples are packed into micro-batches up to
a token budget, the loss is the cross entropy averaged over every trained token of the step
(normalised by the step's count, so the summed micro-batch gradients are the full batch's
gradient however the samples were packed), gradients are clipped, the optimizer steps.
:func:`sft_eval_loss` computes the same loss without gradients. Both run on the megatron-core
model of :mod:`corral.trainer.model`, in a world of any layout that
:mod:`corral.trainer.parallel` handles (as the RL update does): every rank is given the same
samples, each data-parallel replica takes its share of the micro-batches, gradients and
metrics are reduced to the full step's.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from corral.gateway.openai_types import ChatMessage, ToolDef
from corral.gateway.rendering import ChatRenderer, template_messages, template_tools
from corral.validation import validation_message

__all__ = [
    "ChatExample",
    "SftSample",
    "SftSettings",
    "read_chat_examples",
    "sft_eval_loss",
    "sft_update",
    "tokenize_chat",
    "tokenize_chats",
]

_EXAMPLE_KEYS = frozenset({"messages", "tools"})


# ---------------------------------------------------------------------------------------------
# Examples


@dataclass(frozen=True)
class ChatExample:
    """One conversation to train on: OpenAI chat ``messages`` and optional OpenAI ``tools``.

    Validated on construction (``ValueError`` naming the message and what is wrong):

    - every message is one the gateway accepts (a known ``role``, ``content`` where the role
      needs it, ``tool_call_id`` on tool messages, ``tool_calls`` only on assistant messages);
    - every tool call's ``arguments`` is a JSON object (as a JSON string, or as an object),
      since the gateway's parser refuses anything else as a call;
    - tool calls name one of ``tools``, and there are no tool calls without ``tools``: the
      gateway parses calls only for requests that offer tools, and only of those tools;
    - an assistant message's optional ``weight`` (OpenAI's fine-tuning field) is 0 or 1;
    - at least one assistant message is trained on (weight 1, the default).

    The dicts are kept as given (not copied): treat them as read-only.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        _conversation(self)


def read_chat_examples(path: str | Path) -> list[ChatExample]:
    """Every conversation in the JSONL file ``path``, in file order; blank lines are skipped.

    Each line is a JSON object with ``messages`` and optionally ``tools`` (see
    :class:`ChatExample`); other keys are refused rather than silently dropped. Raises
    ``ValueError`` for the first bad line, naming the file, the line number and what is wrong;
    ``FileNotFoundError`` when there is no file.
    """
    path = Path(path)
    examples = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{where}: expected a JSON object with 'messages', got {_json_type(obj)}"
                )
            if "messages" not in obj:
                raise ValueError(f"{where}: the object has no 'messages'")
            unknown = sorted(set(obj) - _EXAMPLE_KEYS)
            if unknown:
                raise ValueError(
                    f"{where}: unknown keys {unknown}; a line holds only 'messages' and 'tools'"
                )
            try:
                examples.append(ChatExample(messages=obj["messages"], tools=obj.get("tools")))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
    return examples


@dataclass(frozen=True)
class _Conversation:
    """A validated example in the form the gateway's renderer takes."""

    messages: list[dict[str, Any]]  # as corral.gateway.rendering.template_messages makes them
    tools: list[dict[str, Any]] | None  # as template_tools makes them
    trained: list[int]  # indices of the assistant messages whose tokens are targets


def _conversation(example: ChatExample) -> _Conversation:
    """Validate ``example`` (see :class:`ChatExample`) and convert it as the gateway does."""
    raw_messages, raw_tools = example.messages, example.tools
    tools: list[ToolDef] | None = None
    if raw_tools is not None:
        if not isinstance(raw_tools, list):
            raise ValueError(f"'tools' must be a list, got {_json_type(raw_tools)}")
        tools = []
        for k, tool in enumerate(raw_tools):
            try:
                tools.append(ToolDef.model_validate(tool))
            except ValidationError as exc:
                raise ValueError(f"tool {k}: {validation_message(exc)}") from None
    tool_names = {t.function.name for t in tools or ()}
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ValueError("'messages' must be a non-empty list of messages")
    messages: list[ChatMessage] = []
    trained: list[int] = []
    for i, raw in enumerate(raw_messages):
        message, weight = _message(i, raw)
        for k, call in enumerate(message.tool_calls or ()):
            where = f"message {i}, tool call {k} ({call.function.name!r})"
            if not tool_names:
                raise ValueError(
                    f"{where}: the example offers no tools; the gateway parses tool calls only "
                    "when the request has 'tools'"
                )
            if call.function.name not in tool_names:
                raise ValueError(
                    f"{where}: not one of the example's tools {sorted(tool_names)}; the "
                    "gateway's parser would not read it back as a call"
                )
        messages.append(message)
        if message.role == "assistant" and weight:
            trained.append(i)
    if not trained:
        raise ValueError("no assistant message to train on (none, or all have weight 0)")
    return _Conversation(
        messages=template_messages(messages), tools=template_tools(tools), trained=trained
    )


def _message(index: int, raw: Any) -> tuple[ChatMessage, int]:
    """Message ``index`` validated as the gateway validates requests, and its weight."""
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {_json_type(raw)}")
    if "role" not in raw:
        raise ValueError(f"{where} has no 'role'")
    fields = dict(raw)  # the caller's dict is left as it was
    weight = fields.pop("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise ValueError(f"{where}: 'weight' must be 0 or 1, got {weight!r}")
    if "weight" in raw and raw["role"] != "assistant":
        raise ValueError(f"{where}: only assistant messages may carry 'weight'")
    calls = fields.get("tool_calls")
    if isinstance(calls, list):
        fields["tool_calls"] = [_tool_call(index, k, c) for k, c in enumerate(calls)]
    try:
        message = ChatMessage.model_validate(fields)
    except ValidationError as exc:
        raise ValueError(f"{where} ({raw['role']!r}): {validation_message(exc)}") from None
    return message, int(weight)


def _tool_call(index: int, k: int, raw: Any) -> Any:
    """Tool call ``k`` of message ``index`` with its arguments checked to be a JSON object and
    written as a JSON string (what ``ChatMessage`` takes); other defects are left for the
    model's validation to report."""
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        return raw
    function = dict(raw["function"])
    where = f"message {index}, tool call {k} ({function.get('name')!r})"
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{where}: arguments are not JSON ({exc.msg} at column {exc.colno}): "
                f"{_shorten(arguments)}"
            ) from None
    elif isinstance(arguments, dict):
        decoded = arguments
        function["arguments"] = json.dumps(arguments, ensure_ascii=False)
    else:
        raise ValueError(
            f"{where}: arguments must be a JSON object or a JSON string holding one, got "
            f"{_json_type(arguments)}"
        )
    if not isinstance(decoded, dict):
        raise ValueError(
            f"{where}: arguments must be a JSON object, got {_json_type(decoded)}: "
            f"{_shorten(arguments if isinstance(arguments, str) else str(arguments))}"
        )
    return {**raw, "function": function}


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def _shorten(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ---------------------------------------------------------------------------------------------
# Tokens


@dataclass(frozen=True, eq=False)
class SftSample:
    """One tokenized conversation: ``tokens`` and, per token, ``loss_mask`` (1 where the token
    is a target: the model is trained to predict it from the tokens before it).

    ValueError on construction when the lengths differ, the mask holds anything but 0 and 1,
    or the first token is masked (no logit predicts it).
    """

    tokens: list[int]
    loss_mask: list[int]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.loss_mask):
            raise ValueError(
                f"{len(self.tokens)} tokens but {len(self.loss_mask)} loss-mask entries"
            )
        if not set(self.loss_mask) <= {0, 1}:
            raise ValueError("loss_mask may hold only 0 and 1")
        if self.loss_mask and self.loss_mask[0]:
            raise ValueError("the first token cannot be a target: no logit predicts it")

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_trained(self) -> int:
        """Tokens with loss mask 1."""
        return sum(self.loss_mask)


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase,
    example: ChatExample,
    *,
    max_tokens: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    end_of_turn_ids: Collection[int] | None = None,
) -> SftSample:
    """``example`` as tokens with a loss mask, rendered exactly as the gateway renders it.

    The tokens are the whole conversation rendered by the tokenizer's chat template through
    ``corral.gateway.rendering.ChatRenderer`` (``chat_template_kwargs`` as the gateway's
    ``GatewaySettings.chat_template_kwargs``), cut after the last trained token (later tokens
    are never targets and, attention being causal, change no logit before them).

    The mask of each trained assistant message (index ``i``) is found by rendering twice:
    ``messages[:i]`` with the generation prompt (the prompt the gateway would send the engine
    for that turn) and ``messages[:i + 1]`` (the turn written into history). Both must be
    token prefixes of the whole conversation, else ``ValueError`` saying the template is not
    prefix-stable there: the gateway would start a new sample at that turn, so train on the
    conversation cut there instead (e.g. Qwen3's template, which writes a ``<think>`` block
    into the latest reply and drops it, or an empty one, once the conversation goes on past a
    reply without ``reasoning_content`` or past a new user query). The reply is the difference
    between the two, up to and including its last end-of-turn token; what follows that token
    (a template's ``\\n``) is glue the gateway renders into the next prompt, not model output.

    ``end_of_turn_ids`` defaults to the tokenizer's ``eos_token_id`` and its special added
    tokens (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3); a reply whose rendering
    holds none of them raises ``ValueError`` (the model would never learn to stop).

    ``max_tokens``: a longer sample raises ``ValueError``. It is refused, not truncated: a cut
    reply would teach the model to end its turn where the cut fell (or never to end it).

    Raises ``ValueError`` (``corral.gateway.rendering.TemplateError`` included) when the
    template fails.
    """
    conversation = _conversation(example)
    renderer = ChatRenderer(tokenizer, chat_template_kwargs)
    messages, tools = conversation.messages, conversation.tools
    ends = _end_of_turn_ids(tokenizer) if end_of_turn_ids is None else frozenset(end_of_turn_ids)
    full = renderer.encode(renderer.render_text(messages, tools, add_generation_prompt=False))
    mask = [0] * len(full)
    last = 0
    for i in conversation.trained:
        prompt = renderer.encode(renderer.render_text(messages[:i], tools))
        turn = renderer.encode(
            renderer.render_text(messages[: i + 1], tools, add_generation_prompt=False)
        )
        for name, part in (("the prompt before it", prompt), ("the history through it", turn)):
            if full[: len(part)] != part:
                raise ValueError(
                    f"the chat template is not prefix-stable at assistant message {i}: "
                    f"{name} is not a token prefix of the whole conversation "
                    f"({_divergence(tokenizer, part, full)}); the gateway would start a new "
                    "sample here, so train on the conversation split at this message"
                )
        stops = [t for t in range(len(prompt), len(turn)) if full[t] in ends]
        if not stops:
            raise ValueError(
                f"assistant message {i} renders with no end-of-turn token (looked for ids "
                f"{sorted(ends)}); pass end_of_turn_ids"
            )
        # The first reply token is predicted from the prompt, so position 0 is never a target.
        mask[len(prompt) : stops[-1] + 1] = [1] * (stops[-1] + 1 - len(prompt))
        last = stops[-1] + 1
    if max_tokens is not None and last > max_tokens:
        raise ValueError(
            f"the conversation has {last} tokens (through its last trained token), more than "
            f"max_tokens={max_tokens}; examples are refused, not truncated"
        )
    return SftSample(tokens=full[:last], loss_mask=mask[:last])


# Examples per task handed to a tokenizing worker process, and the fewest examples worth
# starting workers for by default (a spawned worker imports torch and transformers: seconds).
_CHUNK = 256
_PARALLEL_FROM = 2048


def tokenize_chats(
    tokenizer_path: str | Path,
    examples: Sequence[ChatExample],
    *,
    max_tokens: int | None = None,
    workers: int | None = None,
) -> list[SftSample]:
    """:func:`tokenize_chat` of every example, in order, with the tokenizer of the folder
    ``tokenizer_path``, in ``workers`` processes. Rendering and encoding a conversation costs
    milliseconds of CPU (several chat-template renders and encodes of the whole text), so tens
    of thousands of them take minutes in one process. ``workers`` None: the CPUs this process
    may use (at most 16) for 2,048 examples or more, else none; 1: in this process. Workers
    are spawned (never forked: the caller may hold threads or a CUDA context). The first
    example that cannot be tokenized raises its ``ValueError``, prefixed with its index."""
    import os

    if workers is None:
        many = len(examples) >= _PARALLEL_FROM
        workers = min(len(os.sched_getaffinity(0)), 16) if many else 1
    if workers <= 1:
        return _tokenize_range(str(tokenizer_path), examples, 0, max_tokens)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    starts = range(0, len(examples), _CHUNK)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = pool.map(
            _tokenize_range,
            [str(tokenizer_path)] * len(starts),
            [examples[i : i + _CHUNK] for i in starts],
            starts,
            [max_tokens] * len(starts),
        )
        return [sample for part in parts for sample in part]


_WORKER_TOKENIZERS: dict[str, PreTrainedTokenizerBase] = {}


def _tokenize_range(
    path: str, examples: Sequence[ChatExample], first: int, max_tokens: int | None
) -> list[SftSample]:
    tokenizer = _WORKER_TOKENIZERS.get(path)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = _WORKER_TOKENIZERS[path] = AutoTokenizer.from_pretrained(path)
    out = []
    for k, example in enumerate(examples):
        try:
            out.append(tokenize_chat(tokenizer, example, max_tokens=max_tokens))
        except ValueError as exc:
            raise ValueError(f"conversation {first + k}: {exc}") from None
    return out


def _end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(i for i in ids if isinstance(i, int))


def _divergence(tokenizer: PreTrainedTokenizerBase, part: list[int], full: list[int]) -> str:
    at = next((t for t, (a, b) in enumerate(zip(part, full, strict=False)) if a != b), None)
    if at is None:
        return f"it has {len(part)} tokens, the conversation {len(full)}"
    return (
        f"first difference at token {at}: {tokenizer.decode(part[at : at + 8])!r} "
        f"instead of {tokenizer.decode(full[at : at + 8])!r}"
    )


# ---------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class SftSettings:
    """How :func:`sft_update` and :func:`sft_eval_loss` batch and clip.

    ``max_tokens_per_micro_batch`` bounds the real tokens of one forward pass (a longer sample
    goes alone into its own micro-batch); ``max_grad_norm`` None means no clipping; ``pad_id``
    fills the right padding (any id: padding is masked out of attention and of the loss).
    """

    max_tokens_per_micro_batch: int = 8192
    max_grad_norm: float | None = 1.0
    pad_id: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 1, not {self.max_tokens_per_micro_batch}"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, not {self.max_grad_norm}")


def sft_update(
    model: Any,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[SftSample],
    settings: SftSettings | None = None,
) -> dict[str, float]:
    """Train ``model`` (a megatron-core ``GPTModel``) one optimizer step on ``samples``.

    The loss is the mean cross entropy over every target token (mask 1) of the step; each
    micro-batch's loss is divided by the step's total count before ``backward``, so the
    accumulated gradient is exactly the full batch's, however the samples were packed.
    Gradients are clipped to ``settings.max_grad_norm``, then the optimizer steps.

    Returns ``loss``, ``accuracy`` (share of target tokens whose argmax logit is the target),
    ``grad_norm`` (before clipping), ``samples``, ``tokens``, ``trained_tokens`` and
    ``micro_batches``. ValueError for no samples or no target token among them.
    """
    from corral.trainer import parallel

    settings = settings or SftSettings()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    metrics = _run(model, samples, settings, backward=True)
    parallel.finish_gradients(model)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = settings.max_grad_norm if settings.max_grad_norm is not None else float("inf")
    grad_norm = parallel.clip_grad_norm(params, max_norm)
    optimizer.step()
    metrics["grad_norm"] = float(grad_norm)
    return metrics


def sft_eval_loss(
    model: Any, samples: Sequence[SftSample], settings: SftSettings | None = None
) -> dict[str, float]:
    """:func:`sft_update`'s ``loss`` and ``accuracy`` (and counts) without a gradient or a
    step. The model is put in eval mode for the call and left in the mode it was in."""
    settings = settings or SftSettings()
    was_training = bool(model.training)
    model.eval()
    try:
        with torch.no_grad():
            return _run(model, samples, settings, backward=False)
    finally:
        model.train(was_training)


def _run(
    model: Any, samples: Sequence[SftSample], settings: SftSettings, *, backward: bool
) -> dict[str, float]:
    """Forward this replica's micro-batches; with ``backward``, accumulate the step loss's
    gradients. The metrics are the whole step's (summed over the data-parallel replicas)."""
    from corral.trainer import parallel
    from corral.trainer.model import forward_logits

    if not samples:
        raise ValueError("no samples")
    # Targets are tokens 1..L-1 (nothing predicts token 0, and SftSample keeps its mask 0).
    trained = sum(s.num_trained for s in samples)
    if trained == 0:
        raise ValueError("the samples have no target token (every loss mask is 0)")
    device = next(model.parameters()).device
    batches = _pack([s.num_tokens for s in samples], settings.max_tokens_per_micro_batch)
    share = parallel.data_parallel_share(
        [sum(samples[i].num_tokens for i in indices) for indices in batches]
    )
    loss_sum = 0.0
    correct = 0
    for indices in (batches[b] for b in share):
        tokens, attention, mask = _padded([samples[i] for i in indices], settings.pad_id)
        tokens, attention, mask = tokens.to(device), attention.to(device), mask.to(device)
        logits = forward_logits(model, tokens, attention_mask=attention)
        # Logits at position t predict token t + 1: the mask applies to the target tokens.
        where = mask[:, 1:]
        targets = tokens[:, 1:][where]
        # Only the target rows reach log-softmax ([n, V] is the big tensor); low-precision
        # logits are scored in float32.
        rows = logits[:, :-1][where]
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        ce = torch.nn.functional.cross_entropy(rows, targets, reduction="sum")
        if backward:
            (ce / trained).backward()
        loss_sum += float(ce.detach())
        correct += int((rows.detach().argmax(dim=-1) == targets).sum())
    summed = parallel.sum_over_data_parallel({"loss": loss_sum, "correct": float(correct)})
    return {
        "loss": summed["loss"] / trained,
        "accuracy": summed["correct"] / trained,
        "samples": float(len(samples)),
        "tokens": float(sum(s.num_tokens for s in samples)),
        "trained_tokens": float(trained),
        "micro_batches": float(len(batches)),
    }


def _pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` packed into bins of at most ``budget`` tokens, first-fit
    decreasing (as ``corral.trainer.batches.pack_micro_batches``, which takes RL samples);
    a sample over the budget goes alone. Deterministic; indices ascend within a bin."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max(budget - lengths[i], 0))
    return [sorted(b) for b in bins]


def _padded(
    samples: Sequence[SftSample], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens, attention_mask, loss_mask)``, each ``[B, longest]``, right-padded; the
    attention mask is True on real tokens, the loss mask False on padding."""
    width = max(s.num_tokens for s in samples)
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.bool)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for b, s in enumerate(samples):
        n = s.num_tokens
        tokens[b, :n] = torch.tensor(s.tokens, dtype=torch.long)
        attention[b, :n] = True
        mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
    return tokens, attention, mask
