"""Supervised fine-tuning on CPU with the tiny model: the loss mask against the gateway's own
rendering and tool-call parser, the loss against a hand-computed cross entropy (whole batch and
split into micro-batches), a few steps that learn an example, and refused inputs."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("megatron.core", reason="pip install 'corral[train]'")

from corral.engines.chat_templates import CHAT_TEMPLATES  # noqa: E402
from corral.engines.tiny_model import TOOLS  # noqa: E402
from corral.gateway.openai_types import ChatMessage, ToolDef  # noqa: E402
from corral.gateway.parsers.tool_calls import ToolSpec, get_tool_call_parser  # noqa: E402
from corral.gateway.rendering import ChatRenderer, template_messages, template_tools  # noqa: E402
from corral.trainer import megatron_runtime  # noqa: E402
from corral.trainer.sft import (  # noqa: E402
    ChatExample,
    SftSample,
    SftSettings,
    read_chat_examples,
    sft_eval_loss,
    sft_update,
    tokenize_chat,
    tokenize_chats,
)


def _call(call_id: str, city: str, *, compact: bool = False) -> dict[str, Any]:
    arguments = json.dumps({"city": city}, separators=(",", ":") if compact else None)
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


# Two user turns, each answered with tool calls (one with text before it, one with two calls
# whose arguments come compact: the template re-serialises them) and then a plain answer.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather assistant. Use the tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": [_call("c0", "Paris")]},
    {"role": "tool", "tool_call_id": "c0", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "And in Tokyo and Lima?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("c1", "Tokyo", compact=True), _call("c2", "Lima", compact=True)],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "rainy, 12 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "windy, 8 C"},
    {"role": "assistant", "content": "It is rainy in Tokyo and windy in Lima."},
]

CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
# What the model writes for each assistant message (the qwen25 template's contract).
REPLIES = [
    "Let me check.\n" + CALL.format("Paris") + "<|im_end|>",
    "It is sunny in Paris.<|im_end|>",
    CALL.format("Tokyo") + "\n" + CALL.format("Lima") + "<|im_end|>",
    "It is rainy in Tokyo and windy in Lima.<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def runtime() -> Iterator[None]:
    megatron_runtime.setup("cpu")
    yield
    megatron_runtime.teardown()


@pytest.fixture
def model(tiny_model_dir: Path, runtime: None) -> Any:
    from corral.trainer.convert import load_hf_checkpoint

    model, _ = load_hf_checkpoint(tiny_model_dir, dtype=torch.float32)
    return model


def _runs(sample: SftSample) -> list[tuple[int, int]]:
    """(start, end) of every maximal run of mask-1 tokens."""
    runs: list[tuple[int, int]] = []
    for t, m in enumerate(sample.loss_mask):
        if m and runs and runs[-1][1] == t:
            runs[-1] = (runs[-1][0], t + 1)
        elif m:
            runs.append((t, t + 1))
    return runs


def _tokens(sample: SftSample, *, masked: bool) -> list[int]:
    """The sample's tokens with loss mask 1 (``masked``) or 0, in order."""
    return [t for t, m in zip(sample.tokens, sample.loss_mask, strict=True) if bool(m) == masked]


# --------------------------------------------------------------------------- the mask


def test_the_mask_is_exactly_the_assistant_replies_as_the_gateway_renders_and_parses_them(
    tokenizer: Any,
) -> None:
    example = ChatExample(messages=CONVERSATION, tools=TOOLS)
    sample = tokenize_chat(tokenizer, example)
    runs = _runs(sample)
    assert len(runs) == len(REPLIES)
    renderer = ChatRenderer(tokenizer)
    validated = [ChatMessage.model_validate(m) for m in CONVERSATION]
    tools = template_tools([ToolDef.model_validate(t) for t in TOOLS])
    specs = [ToolSpec.from_openai(t) for t in TOOLS]
    parser = get_tool_call_parser("qwen25")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assistant_at = [i for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"]
    for (start, end), i, reply in zip(runs, assistant_at, REPLIES, strict=True):
        # Everything before a reply is the prompt the gateway sends the engine for that turn,
        # generation prompt included (and unmasked).
        prompt = renderer.render(template_messages(validated[:i]), tools).token_ids
        assert sample.tokens[:start] == prompt
        assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
        assert tokenizer.decode(sample.tokens[start:end]) == reply
        assert sample.tokens[end - 1] == im_end
        # The gateway's tool-call parser reads the masked text back as the message it came from.
        text = tokenizer.decode(sample.tokens[start:end], skip_special_tokens=True)
        parsed = parser.parse(text, specs)
        assert not parsed.errors
        assert parsed.content == CONVERSATION[i]["content"]
        wanted = [c["function"] for c in CONVERSATION[i].get("tool_calls", [])]
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            (f["name"], json.loads(f["arguments"])) for f in wanted
        ]
    # No system, user or tool token is masked in: all of their text is in the unmasked part.
    unmasked = tokenizer.decode(_tokens(sample, masked=False))
    masked = tokenizer.decode(_tokens(sample, masked=True))
    assert masked == "".join(REPLIES)
    for message in CONVERSATION:
        if message["role"] != "assistant":
            assert message["content"] in unmasked
            assert message["content"] not in masked
    # The sample ends with the last trained token: the whole rendering, less its final "\n".
    whole = renderer.render_text(template_messages(validated), tools, add_generation_prompt=False)
    assert tokenizer.decode(sample.tokens) + "\n" == whole


def test_weight_zero_replies_are_context_and_arguments_may_be_objects(tokenizer: Any) -> None:
    messages = copy.deepcopy(CONVERSATION)
    messages[4]["weight"] = 0
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    sample = tokenize_chat(tokenizer, ChatExample(messages=messages, tools=TOOLS))
    masked = tokenizer.decode(_tokens(sample, masked=True))
    assert masked == "".join(REPLIES[i] for i in (0, 2, 3))
    assert sample.tokens == tokenize_chat(tokenizer, ChatExample(CONVERSATION, TOOLS)).tokens


def test_a_template_that_rewrites_history_is_refused(tiny_model_dir: Path) -> None:
    # The Qwen3 template renders the latest reply with a <think> block, which disappears from
    # it once a tool result follows: the gateway would start a new sample there.
    think = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    think.chat_template = CHAT_TEMPLATES["qwen3"]
    with pytest.raises(ValueError, match="not prefix-stable at assistant message 2"):
        tokenize_chat(think, ChatExample(messages=CONVERSATION, tools=TOOLS))
    # One reply after the last query, with its reasoning, is stable.
    single = [*CONVERSATION[:2], {**CONVERSATION[2], "reasoning_content": "Check it."}]
    sample = tokenize_chat(think, ChatExample(messages=single, tools=TOOLS))
    masked = think.decode(_tokens(sample, masked=True))
    assert masked == "<think>\nCheck it.\n</think>\n\n" + REPLIES[0]


def test_too_long_examples_are_refused_not_truncated(tokenizer: Any) -> None:
    example = ChatExample(messages=CONVERSATION, tools=TOOLS)
    length = tokenize_chat(tokenizer, example).num_tokens
    assert tokenize_chat(tokenizer, example, max_tokens=length).num_tokens == length
    with pytest.raises(ValueError, match=f"{length} tokens.*max_tokens={length - 1}"):
        tokenize_chat(tokenizer, example, max_tokens=length - 1)


# --------------------------------------------------------------------------- bad input


def _bad_call(arguments: str) -> dict[str, Any]:
    call = _call("c0", "Paris")
    call["function"]["arguments"] = arguments
    return {"role": "assistant", "content": None, "tool_calls": [call]}


USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('{"messages": [', r"line 2: not valid JSON"),
        ("[1, 2]", r"line 2: expected a JSON object with 'messages', got an array"),
        ('{"tools": []}', r"line 2: the object has no 'messages'"),
        (json.dumps({"messages": [USER], "id": 3}), r"line 2: unknown keys \['id'\]"),
        (json.dumps({"messages": [USER, {"content": "Hi"}]}), r"line 2: message 1 has no 'role'"),
        (
            json.dumps({"messages": [USER, {"role": "robot", "content": "Hi"}]}),
            r"line 2: message 1 \('robot'\): role: Input should be",
        ),
        (
            json.dumps({"messages": [USER, _bad_call("{'city': 'Paris'}")], "tools": TOOLS}),
            r"line 2: message 1, tool call 0 \('get_weather'\): arguments are not JSON",
        ),
        (
            json.dumps({"messages": [USER, _bad_call('["Paris"]')], "tools": TOOLS}),
            r"line 2: message 1, tool call 0 .*must be a JSON object, got an array",
        ),
        (
            json.dumps({"messages": [USER, _bad_call('{"city": "Paris"}')]}),
            r"line 2: message 1, tool call 0 .*offers no tools",
        ),
        (
            json.dumps({"messages": [USER, _bad_call("{}")], "tools": TOOLS[1:]}),
            r"line 2: .*not one of the example's tools \['add'\]",
        ),
        (json.dumps({"messages": [USER]}), r"line 2: no assistant message to train on"),
    ],
)
def test_bad_lines_are_refused_naming_file_line_and_problem(
    tmp_path: Path, line: str, error: str
) -> None:
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": CONVERSATION, "tools": TOOLS})
    path.write_text(good + "\n" + line + "\n\n")
    with pytest.raises(ValueError, match=f"chats.jsonl, {error}"):
        read_chat_examples(path)


def test_worker_processes_tokenize_as_one_process_does(tiny_model_dir: Path) -> None:
    examples = [ChatExample(CONVERSATION, TOOLS), ChatExample(CONVERSATION[:5], TOOLS)] * 3
    alone = tokenize_chats(tiny_model_dir, examples, workers=1)
    spread = tokenize_chats(tiny_model_dir, examples, workers=2)
    assert [(s.tokens, s.loss_mask) for s in spread] == [(s.tokens, s.loss_mask) for s in alone]
    short = min(s.num_tokens for s in alone)
    with pytest.raises(ValueError, match=r"^conversation 0: the conversation has \d+ tokens"):
        tokenize_chats(tiny_model_dir, examples, max_tokens=short, workers=2)


def test_good_lines_are_read(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    hello = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hi!"}]
    lines = [{"messages": CONVERSATION, "tools": TOOLS}, {"messages": hello}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    examples = read_chat_examples(path)
    assert [e.messages for e in examples] == [CONVERSATION, hello]
    assert [e.tools for e in examples] == [TOOLS, None]


# --------------------------------------------------------------------------- the loss


def _samples(tokenizer: Any) -> list[SftSample]:
    hello = [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]
    one_call = CONVERSATION[1:5]
    return [
        tokenize_chat(tokenizer, ChatExample(messages=CONVERSATION, tools=TOOLS)),
        tokenize_chat(tokenizer, ChatExample(messages=hello)),
        tokenize_chat(tokenizer, ChatExample(messages=one_call, tools=TOOLS)),
    ]


def _hand_loss(model: Any, samples: list[SftSample]) -> tuple[Any, float]:
    """Cross entropy over every target token of the batch, each sample forwarded alone."""
    from corral.trainer.model import forward_logits

    total, correct, count = torch.zeros(()), 0, 0
    for s in samples:
        tokens = torch.tensor([s.tokens])
        logits = forward_logits(model, tokens)[0, :-1]
        where = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
        targets = tokens[0, 1:][where]
        total = total + torch.nn.functional.cross_entropy(logits[where], targets, reduction="sum")
        correct += int((logits[where].argmax(-1) == targets).sum())
        count += int(where.sum())
    return total / count, correct / count


def test_loss_and_gradients_match_a_hand_computed_cross_entropy_however_batched(
    tokenizer: Any, model: Any
) -> None:
    samples = _samples(tokenizer)
    model.train()
    model.zero_grad(set_to_none=True)
    expected, accuracy = _hand_loss(model, samples)
    expected_value = float(expected.detach())
    expected.backward()
    hand = {n: p.grad.clone() for n, p in model.named_parameters()}
    trained = sum(s.num_trained for s in samples)

    evaluated = sft_eval_loss(model, samples)
    assert evaluated["loss"] == pytest.approx(expected_value, abs=1e-5)
    assert evaluated["accuracy"] == pytest.approx(accuracy)
    assert evaluated["trained_tokens"] == trained and evaluated["micro_batches"] == 1

    # lr 0: the step leaves the weights as they were and the gradients in place.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    for budget, micro_batches in ((100_000, 1), (1, 3)):
        settings = SftSettings(max_tokens_per_micro_batch=budget, max_grad_norm=None)
        metrics = sft_update(model, optimizer, samples, settings)
        assert metrics["micro_batches"] == micro_batches
        assert metrics["loss"] == pytest.approx(expected_value, abs=1e-5)
        assert metrics["accuracy"] == pytest.approx(accuracy)
        assert metrics["samples"] == 3 and metrics["trained_tokens"] == trained
        assert metrics["tokens"] == sum(s.num_tokens for s in samples)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, hand[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_few_steps_learn_an_example(tokenizer: Any, model: Any) -> None:
    messages = [
        {"role": "user", "content": "Say goodbye."},
        {"role": "assistant", "content": "Goodbye, and see you tomorrow!"},
    ]
    samples = [tokenize_chat(tokenizer, ChatExample(messages=messages))]
    start = sft_eval_loss(model, samples)
    before = start["loss"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(10):
        metrics = sft_update(model, optimizer, samples)
        assert metrics["grad_norm"] > 0
    after = sft_eval_loss(model, samples)
    assert after["loss"] < 0.5 * before, (before, after)
    assert after["accuracy"] > start["accuracy"]
