"""Constrained decoding: the local engine's ``json_schema`` / ``regex`` / ``ebnf`` and the
gateway's constraint builders (``corral.gateway.constraints``).

Outputs are sampled at temperature 1 with several seeds from the tiny model and from random
weights for its architecture (a model that prefers nothing in particular): the constraint must
hold whatever the model prefers. Every output that ended (``stop``) is checked independently
of the grammar library: JSON with ``jsonschema``, regexes with Python's ``re``, tool calls with
corral's own parser and ``jsonschema``. Some checks also require enough outputs to end, so that
the guarantee is not checked on nothing.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from corral.engines.local import grammar as grammar_module
from corral.engines.local.engine import InvalidRequestError, LocalEngine
from corral.engines.local.grammar import Grammars
from corral.engines.local.server import build_engine_app
from corral.engines.protocol import FinishReason, GenerateResponse
from corral.engines.tiny_model import TOOLS
from corral.gateway import constraints
from corral.gateway.constraints import EngineConstraint, UnsupportedConstraint
from corral.gateway.parsers.tool_calls import ToolSpec, get_tool_call_parser
from tests.factories import chat_ids, generate_request
from tests.servers import serve

SEEDS = range(8)

# A tool whose arguments end quickly under any model (enums, numbers, short arrays) next to the
# tiny model's own tools (free strings), so that every format is exercised to its end.
BOOK = ToolSpec(
    "book",
    {
        "type": "object",
        "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "nights": {"type": "integer"},
            "late": {"type": "boolean"},
            "rooms": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "note": {"type": ["integer", "null"]},
        },
        "required": ["unit", "nights"],
    },
)
TOOL_SPECS = [*(ToolSpec.from_openai(t) for t in TOOLS), BOOK]

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "who": {"type": "string", "maxLength": 12},
        "size": {"enum": ["s", "m", "l"]},
        "extras": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
        "gift": {"anyOf": [{"type": "null"}, {"type": "number"}]},
    },
    "required": ["id", "who", "size"],
    "additionalProperties": False,
}
OBJECT = {"type": "object"}  # SGLang's json_object

# ---------------------------------------------------------------------------------------------
# fixtures and helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_weights_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random, seeded weights for the tiny model's architecture (no tokenizer: it is shared)."""
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config).eval()
    out = tmp_path_factory.mktemp("random-weights")
    model.save_pretrained(str(out))
    return out


@asynccontextmanager
async def running(model: Path, tokenizer: Path) -> AsyncIterator[LocalEngine]:
    eng = LocalEngine(model, tokenizer_path=tokenizer, max_batch_size=32)
    await eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture
def models(tiny_model_dir: Path, random_weights_dir: Path) -> dict[str, Path]:
    """The imprinted tiny model ("tiny") and random weights ("babbler"), by name."""
    return {"tiny": tiny_model_dir, "babbler": random_weights_dir}


@pytest.fixture
async def babbler(random_weights_dir: Path, tiny_model_dir: Path) -> AsyncIterator[LocalEngine]:
    async with running(random_weights_dir, tiny_model_dir) as eng:
        yield eng


@pytest.fixture
async def tiny(tiny_model_dir: Path) -> AsyncIterator[LocalEngine]:
    async with running(tiny_model_dir, tiny_model_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[str]:
    with serve(build_engine_app(LocalEngine(tiny_model_dir))) as url:
        yield url


async def sample(
    engine: LocalEngine,
    content: str,
    max_new_tokens: int = 300,
    seeds: range = SEEDS,
    **constraint: str,
) -> list[GenerateResponse]:
    """One constrained sample per seed, all in one batch, at temperature 1."""
    ids = chat_ids(engine.tokenizer, content)
    reqs = [
        generate_request(
            ids, max_new_tokens=max_new_tokens, temperature=1.0, sampling_seed=s, **constraint
        )
        for s in seeds
    ]
    return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))


def finish(o: GenerateResponse) -> FinishReason:
    assert o.meta_info.finish_reason is not None
    return o.meta_info.finish_reason


def ended(outs: list[GenerateResponse], engine: LocalEngine) -> list[GenerateResponse]:
    """The outputs that ended on their own (the others ran out of ``max_new_tokens``); each
    ended on an EOS token."""
    assert all(finish(o).type in ("stop", "length") for o in outs)
    done = [o for o in outs if finish(o).type == "stop"]
    for o in done:
        assert finish(o).matched in engine.eos_token_ids
        assert o.output_ids[-1] in engine.eos_token_ids
    return done


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def assert_dumps_layout(text: str) -> None:
    """No whitespace outside strings but json.dumps's separators (", " and ": ")."""
    skeleton = _JSON_STRING.sub('""', text)
    assert not re.search(r"\s", skeleton.replace(", ", ",").replace(": ", ":")), text


def check_calls(text: str, parser: str, tools: list[ToolSpec]) -> list[Any]:
    """``text`` parses into calls only, each of an offered tool with valid arguments."""
    parsed = get_tool_call_parser(parser).parse(text, tools)
    assert parsed.errors == [], (text, parsed.errors)
    assert parsed.content is None, (text, parsed.content)
    assert parsed.tool_calls, text
    by_name = {t.name: t for t in tools}
    for call in parsed.tool_calls:
        jsonschema.validate(json.loads(call.arguments), by_name[call.name].parameters)
    return parsed.tool_calls


# ---------------------------------------------------------------------------------------------
# json_schema, regex, ebnf: outputs are in the language, whatever the model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", [ORDER, OBJECT], ids=["order", "json_object"])
@pytest.mark.parametrize("which", ["tiny", "babbler"])
async def test_json_schema_outputs_validate(
    which: str, schema: dict[str, Any], models: dict[str, Path], tiny_model_dir: Path
) -> None:
    async with running(models[which], tiny_model_dir) as engine:
        outs = await sample(engine, "Say hello.", json_schema=json.dumps(schema))
        done = ended(outs, engine)
    assert len(done) >= len(outs) // 2, [o.meta_info.completion_tokens for o in outs]
    for o in done:
        jsonschema.validate(json.loads(o.text), schema)
        assert_dumps_layout(o.text)


async def test_regex_outputs_match(babbler: LocalEngine) -> None:
    pattern = r"[a-z]{2,5}-[0-9]{1,3}( [A-Z][a-z]{0,6})?"
    outs = await sample(babbler, "Give me a code.", regex=pattern)
    assert len(ended(outs, babbler)) == len(outs)  # bounded: every sample ends
    for o in outs:
        assert re.fullmatch(pattern, o.text), o.text
    assert len({o.text for o in outs}) > 1  # the samples differ: the model did choose


async def test_grammar_ends_the_request_despite_ignore_eos(babbler: LocalEngine) -> None:
    ids = chat_ids(babbler.tokenizer, "Yes or no?")
    r = await babbler.generate(
        generate_request(
            ids, max_new_tokens=50, temperature=1.0, ignore_eos=True, regex="(yes|no)!"
        )
    )
    assert r.text in ("yes!", "no!")
    assert finish(r).type == "stop"
    assert r.output_ids[-1] in babbler.eos_token_ids


@pytest.mark.parametrize(
    ("grammar", "language"),
    [
        # GBNF (llama.cpp / xgrammar's EBNF), as SGLang's default backend takes it.
        ('root ::= answer " " num\nanswer ::= "yes" | "no"\nnum ::= [0-9]+', r"(yes|no) [0-9]+"),
        # llguidance's Lark, with a JSON schema inlined (its layout set by "x-guidance"; an
        # inline schema without one gets llguidance's default, any whitespace).
        (
            'start: "v=" item\nitem: %json {"type": "array", "items": {"type": "integer"}, '
            '"maxItems": 3, "x-guidance": {"whitespace_flexible": false}}',
            r"v=\[(-?[0-9]+(,-?[0-9]+){0,2})?\]",
        ),
    ],
    ids=["gbnf", "lark"],
)
async def test_ebnf_outputs_are_in_the_language(
    babbler: LocalEngine, grammar: str, language: str
) -> None:
    outs = await sample(babbler, "Answer.", max_new_tokens=60, ebnf=grammar)
    done = ended(outs, babbler)
    assert len(done) >= len(outs) // 2
    for o in done:
        assert re.fullmatch(language, o.text), o.text


async def test_masks_apply_on_the_torch_path_too(
    random_weights_dir: Path, tiny_model_dir: Path
) -> None:
    """bfloat16 logits take the masking path that GPUs take (torch, not numpy)."""
    engine = LocalEngine(random_weights_dir, tokenizer_path=tiny_model_dir, dtype=torch.bfloat16)
    await engine.start()
    try:
        outs = await sample(engine, "Order.", json_schema=json.dumps(ORDER))
        done = ended(outs, engine)
    finally:
        await engine.stop()
    assert len(done) >= len(outs) // 2
    for o in done:
        jsonschema.validate(json.loads(o.text), ORDER)


async def test_streamed_constrained_output_is_valid(babbler: LocalEngine) -> None:
    ids = chat_ids(babbler.tokenizer, "Order.")
    stream = babbler.stream(
        generate_request(
            ids,
            stream=True,
            max_new_tokens=300,
            temperature=1.0,
            sampling_seed=3,
            json_schema=json.dumps(ORDER),
        )
    )
    chunks = [c async for c in stream]
    assert len(chunks) > 1
    last = chunks[-1]
    assert finish(last).type == "stop"
    jsonschema.validate(json.loads(last.text), ORDER)


# ---------------------------------------------------------------------------------------------
# batches, logprobs, cost, failure
# ---------------------------------------------------------------------------------------------


async def test_mixed_batch_leaves_unconstrained_rows_untouched(babbler: LocalEngine) -> None:
    ids = chat_ids(babbler.tokenizer, "Tell me something.")
    plain = generate_request(
        ids,
        top_logprobs_num=2,
        max_new_tokens=40,
        temperature=1.0,
        sampling_seed=5,
        ignore_eos=True,
    )
    alone = await babbler.generate(plain)
    before = babbler.steps
    constrained = [
        generate_request(
            ids, max_new_tokens=40, temperature=1.0, sampling_seed=s, json_schema=json.dumps(ORDER)
        )
        for s in SEEDS
    ]
    # stream() enqueues at once (generate() compiles a grammar in a thread first, so the rows
    # could reach the scheduler apart): all of them are waiting before its next step.
    streams = [babbler.stream(r) for r in (plain, *constrained)]
    together = [[c async for c in st][-1] for st in streams]
    assert babbler.steps - before <= 41  # one batch: the rows shared their steps
    assert together[0].output_ids == alone.output_ids
    mixed = together[0].meta_info
    lps = [lp for lp, _, _ in mixed.output_token_logprobs]
    assert lps == pytest.approx(
        [lp for lp, _, _ in alone.meta_info.output_token_logprobs], abs=1e-4
    )
    # Unmasked rows keep every alternative: as many as asked for, at every position.
    assert all(top is not None and len(top) == 2 for top in mixed.output_top_logprobs)
    for o in ended(list(together[1:]), babbler):
        jsonschema.validate(json.loads(o.text), ORDER)


def _replay_masks(engine: LocalEngine, kind: str, value: str, out: list[int]) -> torch.Tensor:
    """The allowed set before each output token, replayed with an independent matcher
    (an ending token is allowed where the grammar may end, as the engine does)."""
    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    matcher = grammars.compile(kind, value)  # type: ignore[arg-type]
    assert grammars.eos is not None
    masks = []
    for token in out:
        allowed = torch.from_numpy(grammars.allowed([matcher])[0].copy())
        if allowed[grammars.eos]:
            allowed[list(engine.eos_token_ids)] = True
        masks.append(allowed)
        if token not in engine.eos_token_ids:
            assert matcher.consume(token)
    return torch.stack(masks)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
async def test_logprobs_are_of_the_masked_renormalised_distribution(
    babbler: LocalEngine, random_weights_dir: Path, temperature: float
) -> None:
    schema = json.dumps(ORDER)
    ids = chat_ids(babbler.tokenizer, "Order.")
    r = await babbler.generate(
        generate_request(
            ids,
            top_logprobs_num=5,
            max_new_tokens=120,
            temperature=temperature,
            sampling_seed=11,
            json_schema=schema,
        )
    )
    out = r.output_ids
    model = AutoModelForCausalLM.from_pretrained(str(random_weights_dir), dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].float()
    scaled = logits / temperature if temperature > 0 else logits
    allowed = _replay_masks(babbler, "json_schema", schema, out)
    masked = torch.log_softmax(scaled.masked_fill(~allowed, float("-inf")), -1)
    unmasked = torch.log_softmax(scaled, -1)
    got = torch.tensor([lp for lp, _, _ in r.meta_info.output_token_logprobs])
    at = torch.arange(len(out)), torch.tensor(out)
    assert torch.allclose(got, masked[at], atol=1e-4), (got - masked[at]).abs().max()
    assert bool((got >= unmasked[at] - 1e-5).all())  # renormalised over fewer tokens
    forced = allowed.sum(-1) == 1
    assert bool(forced.any()) and bool((got[forced] == 0).all())  # a forced token: logprob 0
    assert bool((~forced).any()) and bool((got[~forced] < 0).any())
    if temperature == 0:
        assert out == masked.argmax(-1).tolist()  # greedy picks the best allowed token
    for pos, top in enumerate(r.meta_info.output_top_logprobs):
        assert top is not None and 1 <= len(top) <= 5
        assert all(allowed[pos, t] and lp > float("-inf") for lp, t, _ in top)
        assert len(top) == min(5, int(allowed[pos].sum()))


async def test_unconstrained_requests_never_build_the_grammar_backend(babbler: LocalEngine) -> None:
    await sample(babbler, "Hi.", max_new_tokens=8)
    assert babbler._grammars._ll_tokenizer is None  # llguidance was never set up
    await sample(babbler, "Hi.", max_new_tokens=8, seeds=range(1), regex="[a-z]+")
    assert babbler._grammars._ll_tokenizer is not None


async def test_a_failing_matcher_aborts_instead_of_sampling_freely(
    babbler: LocalEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = grammar_module.Matcher.consume
    calls = 0

    def flaky(self: grammar_module.Matcher, token: int) -> bool:
        nonlocal calls
        calls += 1
        return real(self, token) if calls < 4 else False

    monkeypatch.setattr(grammar_module.Matcher, "consume", flaky)
    [r] = await sample(babbler, "Order.", seeds=range(1), json_schema=json.dumps(ORDER))
    assert finish(r).type == "abort"
    assert "constraint failed" in (finish(r).message or "")
    assert len(r.output_ids) == 4  # it stopped at the refused token


async def test_invalid_constraints_are_invalid_requests(babbler: LocalEngine) -> None:
    ids = chat_ids(babbler.tokenizer, "Hi.")
    for field, value, words in [
        ("json_schema", '{"type": "objectx"}', "objectx"),
        ("json_schema", "not json", "json_schema"),
        (
            "json_schema",
            '{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}',
            "no output",
        ),
        ("regex", "a(b", "unclosed group"),
        ("regex", "(?=a)b", "look-around"),
        ("ebnf", 'root ::= "a" (', "Expected ')'"),
        ("ebnf", "root ::= undefined", "'undefined' not found"),
        ("ebnf", "start: missing_rule", "missing_rule"),
    ]:
        bad = generate_request(ids, **{field: value})
        with pytest.raises(InvalidRequestError, match=re.escape(words)):
            await babbler.generate(bad)
        with pytest.raises(InvalidRequestError):
            babbler.stream(bad)  # refused before anything is enqueued
    assert babbler.num_active == 0


# ---------------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------------


def test_http_invalid_constraints_are_400_never_500(server: str) -> None:
    bodies = [
        {"json_schema": '{"type": "objectx"}'},
        {"json_schema": "{"},
        {"regex": "a(b"},
        {"ebnf": 'root ::= "a" ('},
        {"json_schema": '{"type": "object"}', "regex": "a"},  # at most one
    ]
    with httpx.Client(base_url=server, timeout=60) as client:
        for sp in bodies:
            r = client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": sp})
            assert r.status_code == 400, (sp, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["message"]
        r = client.post(
            "/generate",
            json={"input_ids": [5], "sampling_params": {"json_schema": "{}", "ebnf": "x"}},
        )
        assert "Only one of regex, json_schema, or ebnf can be set" in r.json()["error"]["message"]
        # A valid constraint is served, streaming too.
        ok = client.post(
            "/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": {"regex": "(ab|cd)e"}},
        )
        assert ok.status_code == 200 and ok.json()["text"] in ("abe", "cde")
        with client.stream(
            "POST",
            "/generate",
            json={"input_ids": [5, 6], "sampling_params": {"regex": "xyz"}, "stream": True},
        ) as resp:
            lines = [ln for ln in resp.iter_lines() if ln.startswith("data: {")]
        assert json.loads(lines[-1][6:])["text"] == "xyz"


def test_http_huge_constraints_answer_promptly(server: str) -> None:
    """Limits, not hangs: a regex that unrolls to a million states and a grammar that is
    exponentially ambiguous are either refused or served, within seconds."""
    with httpx.Client(base_url=server, timeout=60) as client:
        for sp in (
            {"regex": "(a{1000}){1000}", "max_new_tokens": 4},
            {"ebnf": 'start: x\nx: x x | "a"', "max_new_tokens": 8},
            {"json_schema": json.dumps({"type": "array", "minItems": 100000}), "max_new_tokens": 4},
        ):
            t = time.monotonic()
            r = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": sp})
            assert r.status_code in (200, 400), r.text
            assert time.monotonic() - t < 20


# ---------------------------------------------------------------------------------------------
# tool calls: the gateway's constraints, generated by the engine, parsed by corral's parsers
# ---------------------------------------------------------------------------------------------

FORMATS = ["qwen25", "qwen3_coder", "llama3"]


@pytest.mark.parametrize("parser", FORMATS)
@pytest.mark.parametrize("which", ["tiny", "babbler"])
async def test_required_tool_calls_parse_into_valid_calls(
    parser: str, which: str, models: dict[str, Path], tiny_model_dir: Path
) -> None:
    # qwen3_coder writes string values raw, ended only by an exact "\n</parameter>": offer the
    # tool without free strings there, so that its samples end.
    tools = [BOOK] if parser == "qwen3_coder" else TOOL_SPECS
    c = constraints.required_tool_calls(parser, tools)
    async with running(models[which], tiny_model_dir) as engine:
        outs = await sample(engine, "What is the weather in Paris?", **c.sampling_params())
        done = ended(outs, engine)
    assert len(done) >= len(outs) // 2, [o.meta_info.completion_tokens for o in outs]
    for o in done:
        check_calls(o.text, parser, tools)


@pytest.mark.parametrize("parser", FORMATS)
async def test_named_tool_call_is_exactly_that_call(parser: str, babbler: LocalEngine) -> None:
    c = constraints.named_tool_call(parser, TOOL_SPECS, "book")
    outs = await sample(babbler, "What is the weather in Paris?", **c.sampling_params())
    done = ended(outs, babbler)
    assert len(done) >= len(outs) // 2
    for o in done:
        [call] = check_calls(o.text, parser, TOOL_SPECS)
        assert call.name == "book"


async def test_named_tool_choice_without_prefill_makes_valid_calls(tiny: LocalEngine) -> None:
    """The known failure: a forced prefix ending on a lone space token made 0 valid calls in
    10; constrained from the first token with no prefill, every call is valid, and the tiny
    model still writes what it was imprinted with."""
    c = constraints.named_tool_call("qwen25", TOOL_SPECS, "get_weather")
    outs = await sample(
        tiny, "What is the weather in Paris?", seeds=range(10), **c.sampling_params()
    )
    assert len(ended(outs, tiny)) == 10
    for o in outs:
        [call] = check_calls(o.text, "qwen25", TOOL_SPECS)
        assert call.name == "get_weather"
    assert (
        sum(json.loads(o.text.split("\n")[1])["arguments"] == {"city": "Paris"} for o in outs) >= 8
    )


async def test_reasoning_block_then_calls(tiny_think_model_dir: Path) -> None:
    """The Qwen 3-style tiny model thinks before it answers: ``reasoning="optional"`` lets it,
    then forces the calls."""
    c = constraints.required_tool_calls("qwen25", TOOL_SPECS, reasoning="optional")
    async with running(tiny_think_model_dir, tiny_think_model_dir) as engine:
        outs = await sample(engine, "What is the weather in Oslo?", **c.sampling_params())
        done = ended(outs, engine)
    assert len(done) >= len(outs) // 2
    thought = 0
    for o in done:
        text = o.text
        if text.startswith("<think>"):
            thought += 1
            text = text.partition("</think>")[2].lstrip()
        check_calls(text, "qwen25", TOOL_SPECS)
    assert thought >= len(done) // 2  # the model's own habit survives the constraint


def _closing_walk(
    grammars: Grammars, c: EngineConstraint, tokenizer: Any, rng: random.Random
) -> str | None:
    """A random walk through the grammar, biased to end: often by tokens that close something
    (quotes, brackets, tags, newlines), sometimes by a whole closing text when the grammar
    takes it (free text only ends on an exact close tag); the text, or None if it did not end.
    """
    matcher = grammars.compile(c.kind, c.value)
    closers = [any(ch in tokenizer.decode([t]) for ch in '"}]<>/\n') for t in range(len(tokenizer))]
    endings = [tokenizer.encode(e) for e in ("\n</parameter>\n", '"', "]", "}", "\n</tool_call>")]
    ids: list[int] = []
    assert grammars.eos is not None
    for _ in range(600):
        allowed = grammars.allowed([matcher])[0].copy()
        assert matcher.error == ""
        may_end = bool(allowed[grammars.eos])
        allowed[grammars.eos] = False
        choices = np.flatnonzero(allowed).tolist()
        assert choices or may_end, "a dead end"
        if may_end and (not choices or rng.random() < 0.3):
            return str(tokenizer.decode(ids))
        if rng.random() < 0.2:
            fits = [e for e in endings if matcher._ll.validate_tokens(e) == len(e)]
            if fits:
                ending = rng.choice(fits)
                for token in ending:
                    assert matcher.consume(token)
                ids += ending
                continue
        weights = [100 if closers[t] else 1 for t in choices]
        token = rng.choices(choices, weights)[0]
        assert matcher.consume(token)
        ids.append(token)
    return None


@pytest.mark.parametrize("parser", FORMATS)
def test_tool_call_grammars_round_trip_under_random_walks(
    parser: str, tiny_model_dir: Path
) -> None:
    """Straight through the grammar, no model: adversarial text (markers, quotes, brackets) in
    every free value, raw qwen3_coder strings included; every walk that ends parses."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    grammars = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    notes = ToolSpec(
        "notes",
        {
            "type": "object",
            "properties": {
                "text": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "meta": {"type": "object"},
                "n": {"type": ["integer", "null"]},
            },
            "required": ["text"],
        },
    )
    tools = [*TOOL_SPECS, notes]
    ok = 0
    for i, c in enumerate(
        [
            constraints.required_tool_calls(parser, tools),
            constraints.named_tool_call(parser, tools, "notes"),
        ]
    ):
        for seed in range(12):
            text = _closing_walk(grammars, c, tokenizer, random.Random(seed))
            if text is None:
                continue
            calls = check_calls(text, parser, tools)
            if i == 1:
                assert [call.name for call in calls] == ["notes"]
            ok += 1
    assert ok >= 6


# ---------------------------------------------------------------------------------------------
# the builders themselves
# ---------------------------------------------------------------------------------------------


def test_json_object_and_schema_match_sglang() -> None:
    assert constraints.json_object() == EngineConstraint("json_schema", '{"type": "object"}')
    assert (
        constraints.response_format_constraint({"type": "json_object"}) == constraints.json_object()
    )
    assert constraints.response_format_constraint({"type": "text"}) is None
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}
    loose = constraints.response_format_constraint(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    )
    assert loose is not None and json.loads(loose.value) == schema
    strict = constraints.json_schema(schema, strict=True)
    assert json.loads(strict.value) == {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {}, "additionalProperties": False}},
        "additionalProperties": False,
    }
    assert strict.sampling_params() == {"json_schema": strict.value}
    with pytest.raises(UnsupportedConstraint):
        constraints.response_format_constraint({"type": "json_schema", "json_schema": {}})


def test_tool_call_builders_refuse_what_they_cannot_guarantee() -> None:
    string = ToolSpec("s", {"type": "object", "properties": {"x": {"type": "string"}}})
    cases: list[tuple[Any, str]] = [
        (lambda: constraints.required_tool_calls("mistral", TOOL_SPECS), "mistral"),
        (lambda: constraints.required_tool_calls("qwen25", []), "at least one"),
        (lambda: constraints.named_tool_call("qwen25", TOOL_SPECS, "nope"), "nope"),
        (
            lambda: constraints.required_tool_calls("qwen25", [ToolSpec("t", {"type": "array"})]),
            "object schema",
        ),
        (
            lambda: constraints.required_tool_calls(
                "qwen3_coder",
                [ToolSpec("t", {"properties": {"x": {"type": "string", "pattern": "a+"}}})],
            ),
            "pattern",
        ),
        (
            lambda: constraints.required_tool_calls(
                "qwen25", [ToolSpec("t", {"properties": {"x": {"enum": ["<tool_call>"]}}})]
            ),
            "<tool_call>",
        ),
        (lambda: constraints.required_tool_calls("qwen25", [string, string]), "distinct"),
    ]
    for build, words in cases:
        with pytest.raises(UnsupportedConstraint, match=re.escape(words)):
            build()
    # llama3's single call is a plain json_schema (every SGLang backend takes it).
    assert constraints.named_tool_call("llama3", TOOL_SPECS, "add").kind == "json_schema"
    assert constraints.required_tool_calls("llama3", TOOL_SPECS).kind == "ebnf"
    assert constraints.required_tool_calls("hermes", TOOL_SPECS).value.startswith("%llguidance")


def test_marker_free_pattern_is_exact() -> None:
    """The pattern the strings of a call get matches exactly the texts without a marker (on
    texts made of markers, their prefixes and suffixes, and the characters they share)."""
    markers = ("</parameter>", "<parameter=", "</function>", "<tool_call>", "</tool_call>")
    pattern = re.compile(constraints._pattern_without(markers))
    rng = random.Random(0)

    def piece() -> str:
        marker = rng.choice(markers)
        cut = rng.randrange(1, len(marker))
        return rng.choice([marker, marker[:cut], marker[cut:], rng.choice("<>/=_a\n")])

    seen = {True: 0, False: 0}
    for _ in range(5000):
        text = "".join(piece() for _ in range(rng.randint(0, 5)))
        free = not any(m in text for m in markers)
        assert bool(pattern.fullmatch(text)) == free, text
        seen[free] += 1
    assert min(seen.values()) > 1000  # both kinds of text were tried, often


def test_reasoning_modes_accept_exactly_their_texts(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    grammars = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    thought = "<think>\nI add.\n</think>\n\n"

    def accepts(reasoning: constraints.Reasoning, text: str) -> bool:
        c = constraints.required_tool_calls("qwen25", TOOL_SPECS, reasoning=reasoning)
        matcher = grammars.compile(c.kind, c.value)
        if not all(matcher.consume(t) for t in tokenizer.encode(text)):
            return False
        assert grammars.eos is not None
        return bool(grammars.allowed([matcher])[0][grammars.eos])  # and it may end there

    assert accepts("none", call) and not accepts("none", thought + call)
    assert accepts("optional", call) and accepts("optional", thought + call)
    assert accepts("open", thought.removeprefix("<think>") + call)
    assert not accepts("open", call)
    assert not accepts("optional", "<think>\nI add.\n</think>\n</think>\n" + call)
    assert not accepts("none", call + "\n")  # nothing after the calls
