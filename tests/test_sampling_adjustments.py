"""``logit_bias`` and frequency / presence penalties: the local engine's arithmetic on logits,
and the whole path (OpenAI SDK -> gateway -> local engine) that makes them bite."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from corral.engines.local.engine import _adjust, _Seq
from corral.engines.protocol import SamplingParams
from tests.gateway_stack import Stack


def _seq(output_ids: list[int], **params: Any) -> _Seq:
    return _Seq(
        rid="r",
        prompt=[1],
        params=SamplingParams(**params),
        top_n=0,
        stop_ids=frozenset(),
        generator=torch.Generator(),
        event=asyncio.Event(),
        output_ids=list(output_ids),
    )


def test_bias_and_penalties_change_exactly_the_named_logits() -> None:
    logits = torch.zeros(3, 6)
    seqs = [
        _seq([], logit_bias={"2": 5.0, "4": -100.0}),
        _seq([1, 1, 3], frequency_penalty=0.5, presence_penalty=0.25),
        _seq([1, 1, 3]),  # neither: untouched
    ]
    _adjust(seqs, logits)
    assert logits[0].tolist() == [0, 0, 5, 0, -100, 0]
    assert logits[1].tolist() == pytest.approx([0, -1.25, 0, -0.75, 0, 0])
    assert logits[2].tolist() == [0] * 6


def test_logit_bias_decides_what_the_model_says(stack: Stack, tiny_model_dir: Path) -> None:
    s = stack.session()
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    hello = [{"role": "user", "content": "Say hello."}]
    plain = client.chat.completions.create(model="tiny", messages=hello, temperature=0)
    assert plain.choices[0].message.content == "Hello!"
    forced = stack.tokenizer.convert_tokens_to_ids("Ġcity")
    biased = client.chat.completions.create(
        model="tiny",
        messages=hello,
        temperature=0,
        max_tokens=3,
        logit_bias={str(forced): 100},
    )
    assert stack.engine.calls[-1].output_ids == [forced] * 3
    assert biased.choices[0].finish_reason == "length"
    # A penalty on what was generated makes a greedy model stop repeating the forced token.
    client.chat.completions.create(
        model="tiny",
        messages=hello,
        temperature=0,
        max_tokens=3,
        logit_bias={str(forced): 3},
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    out = stack.engine.calls[-1].output_ids
    assert out.count(forced) < 3
