"""Turn merging and drift explanation, on a character-level stand-in for a tokenizer.

Each character is one token (its code point), so prompts and outputs read as text in the
assertions. ``render`` plays the chat template: ``<role>content|`` per message, then the
generation prompt ``<assistant>``. A model answer ends with ``|``, so a faithful re-render of
the history reproduces the held tokens exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from corral.gateway.recording import (
    TrajectoryMerger,
    TurnRecord,
    common_prefix_length,
)
from corral.samples import Sample, status_for_finish


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def dec(ids: Sequence[int]) -> str:
    return "".join(chr(i) for i in ids)


def render(messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    starts: list[int] = []
    for m in messages:
        starts.append(len(ids))
        ids += enc(f"<{m['role']}>{m['content']}|")
    ids += enc("<assistant>")
    return ids, starts


def logprob(i: int) -> float:
    # Exactly representable in float32, so recorded values compare equal.
    return -((i % 8) + 1) / 8


def make_turn(
    messages: list[dict[str, Any]],
    output: str,
    *,
    finish: str = "stop",
    weight_version: str = "v1",
    choice_group: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> TurnRecord:
    prompt, starts = render(messages)
    out = enc(output)
    return TurnRecord(
        prompt_ids=prompt,
        output_ids=out,
        output_logprobs=[logprob(i) for i in range(len(out))],
        finish_reason=finish,  # type: ignore[arg-type]
        weight_version=weight_version,
        messages=[dict(m) for m in messages],
        message_starts=starts,
        response={"role": "assistant", "content": output.removesuffix("|")},
        choice_group=choice_group,
        metadata=metadata or {},
    )


def msg(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


def sample_of(merger: TrajectoryMerger, index: int) -> Sample:
    t = merger.trajectories[index]
    return Sample(
        tokens=t.tokens.tolist(),
        response_length=t.response_length,
        loss_mask=t.loss_mask.tolist(),
        rollout_log_probs=t.log_probs.tolist(),
        rollout_id="r",
    )


def three_turn_session(merger: TrajectoryMerger) -> list[TurnRecord]:
    history = [msg("system", "be brief"), msg("user", "add 2 and 3")]
    turns = []
    answers = ["call add(2,3)|", "it is 5|", "done|"]
    observations = [msg("tool", "5"), msg("user", "thanks")]
    for k, answer in enumerate(answers):
        t = make_turn(history, answer, weight_version=f"v{k}")
        turns.append(t)
        d = merger.add(t)
        assert d.action == ("start" if k == 0 else "append")
        history = [*history, msg("assistant", answer.removesuffix("|"))]
        if k < len(observations):
            history.append(observations[k])
    return turns


def test_clean_session_merges_into_one_sample() -> None:
    merger = TrajectoryMerger(dec)
    turns = three_turn_session(merger)
    assert len(merger.trajectories) == 1
    counts = merger.counts()
    assert (counts.turns, counts.merges, counts.forks) == (3, 2, 0)
    assert counts.by_reason == {"first_turn": 1, "extends": 2}

    s = sample_of(merger, 0)
    last = turns[-1]
    assert s.tokens == list(last.prompt_ids) + list(last.output_ids)
    prompt_length = len(turns[0].prompt_ids)
    assert s.prompt_length == prompt_length
    expected_mask = [0] * s.response_length
    expected_lp = [0.0] * s.response_length
    for t in turns:
        start = len(t.prompt_ids) - prompt_length
        for j, lp in enumerate(t.output_logprobs):
            expected_mask[start + j] = 1
            expected_lp[start + j] = lp
    assert s.loss_mask == expected_mask
    assert s.rollout_log_probs == expected_lp
    # The masked positions really are the model's text.
    model_text = dec(
        [tok for tok, m in zip(s.tokens[prompt_length:], s.loss_mask, strict=True) if m]
    )
    assert model_text == "call add(2,3)|it is 5|done|"
    assert merger.trajectories[0].weight_versions == ["v0", "v1", "v2"]


def test_merged_turns_keep_only_new_messages() -> None:
    merger = TrajectoryMerger(dec)
    three_turn_session(merger)
    entries = merger.turns
    assert [e.message_offset for e in entries] == [0, 2, 4]
    assert entries[0].messages == [msg("system", "be brief"), msg("user", "add 2 and 3")]
    assert entries[1].messages == [msg("assistant", "call add(2,3)"), msg("tool", "5")]
    assert entries[2].observation_tokens == len(enc("<user>thanks|<assistant>"))
    # Entries hold no token ids: those live only in the trajectory.
    assert not any(isinstance(v, list) and v and isinstance(v[0], int) for v in vars_of(entries[2]))


def vars_of(entry: object) -> list[object]:
    return [getattr(entry, name) for name in entry.__slots__]  # type: ignore[attr-defined]


def test_fork_explains_rerendered_reasoning() -> None:
    merger = TrajectoryMerger(dec, snippet_tokens=8)
    history = [msg("system", "s"), msg("user", "q")]
    first = make_turn(history, "<think>hm</think>A|")
    merger.add(first)
    # The client sends back only the visible answer: the template drops the reasoning.
    history2 = [*history, msg("assistant", "A"), msg("user", "more")]
    second = make_turn(history2, "B|")
    d = merger.add(second)

    assert d.action == "start" and d.reason == "diverged" and d.trajectory == 1
    drift = d.drift
    assert drift is not None
    position = len(first.prompt_ids)  # right where the model's output began
    assert drift.position == position
    assert drift.compared_trajectory == 0
    assert drift.held_token == ord("<") and drift.new_token == ord("A")
    assert (drift.message_index, drift.message_role) == (2, "assistant")
    assert drift.in_model_output
    assert drift.held_text == "<think>h"
    assert drift.new_text == "A|<user>"
    assert drift.context == "sistant>"  # the shared text just before the divergence
    assert "generated inside message 2 (assistant)" in drift.explanation
    assert "'<think>h'" in drift.explanation and "'A|<user>'" in drift.explanation
    assert merger.counts().forks == 1
    assert merger.counts().by_reason == {"first_turn": 1, "diverged": 1}
    assert merger.drift_events() == [drift]
    # A fork keeps its full messages and holds its full prompt.
    assert merger.turns[1].messages == history2
    fork = sample_of(merger, 1)
    assert fork.tokens == list(second.prompt_ids) + list(second.output_ids)
    assert fork.loss_mask == [1] * len(second.output_ids)


def test_prompt_side_divergence_and_truncation_hint() -> None:
    merger = TrajectoryMerger(dec)
    merger.add(make_turn([msg("system", "one"), msg("user", "q")], "A|"))
    d = merger.add(make_turn([msg("system", "two"), msg("user", "q")], "B|"))
    assert d.drift is not None
    assert d.drift.position == len("<system>")
    assert (d.drift.message_index, d.drift.message_role) == (0, "system")
    assert not d.drift.in_model_output
    assert d.drift.explanation.startswith("a new conversation: its system message differs")
    # Past the system message, the same divergence is the template's (or the client's) drift.
    merger = TrajectoryMerger(dec)
    merger.add(make_turn([msg("system", "s"), msg("user", "one")], "A|"))
    d = merger.add(make_turn([msg("system", "s"), msg("user", "two")], "B|"))
    assert d.drift is not None and (d.drift.message_index, d.drift.message_role) == (1, "user")
    assert "re-rendered prompt differs from the held prompt tokens" in d.drift.explanation

    merger = TrajectoryMerger(dec)
    merger.add(make_turn([msg("user", "q")], "cut sho", finish="length"))
    d = merger.add(make_turn([msg("user", "q"), msg("assistant", "cut shx")], "x|"))
    assert d.drift is not None and d.drift.in_model_output
    assert "finish_reason='length'" in d.drift.explanation


def test_unrelated_prompt_diverges_at_zero() -> None:
    merger = TrajectoryMerger(dec)
    merger.add(make_turn([msg("user", "q")], "A|"))
    other = make_turn([msg("system", "other agent")], "B|")
    other = TurnRecord(**{**as_kwargs(other), "prompt_ids": enc("[other template]")})
    d = merger.add(other)
    assert d.drift is not None and d.drift.position == 0
    assert "shares no tokens" in d.drift.explanation


def test_prompt_shorter_than_held() -> None:
    merger = TrajectoryMerger(dec)
    turns = three_turn_session(merger)
    retry = turns[1]  # the client resends the second turn's request
    d = merger.add(retry)
    assert d.action == "start" and d.reason == "prompt_shorter"
    assert d.drift is not None
    assert d.drift.position == len(retry.prompt_ids)
    assert d.drift.new_token is None
    assert d.drift.message_index is None
    assert "shorter than the held tokens" in d.drift.explanation


def test_longest_matching_trajectory_wins() -> None:
    merger = TrajectoryMerger(dec)
    base = [msg("user", "q")]
    merger.add(make_turn(base, "A|"))
    merger.add(make_turn([msg("user", "other")], "B|"))  # trajectory 1
    merger.add(make_turn([*base, msg("assistant", "A"), msg("user", "r")], "C|"))
    # Extends trajectory 0 (now two turns long), not the unrelated trajectory 1.
    d = merger.add(
        make_turn(
            [
                *base,
                msg("assistant", "A"),
                msg("user", "r"),
                msg("assistant", "C"),
                msg("user", "s"),
            ],
            "D|",
        )
    )
    assert d.action == "append" and d.trajectory == 0
    # A continuation of the fork goes to the fork.
    d = merger.add(make_turn([msg("user", "other"), msg("assistant", "B"), msg("user", "t")], "E|"))
    assert d.action == "append" and d.trajectory == 1


def test_sibling_choices_start_their_own_trajectories() -> None:
    merger = TrajectoryMerger(dec)
    history = [msg("user", "q")]
    merger.add(make_turn(history, "A|"))
    history2 = [*history, msg("assistant", "A"), msg("user", "again")]
    d1 = merger.add(make_turn(history2, "X|", choice_group="req-1"))
    d2 = merger.add(make_turn(history2, "Y|", choice_group="req-1"))
    d3 = merger.add(make_turn(history2, "Z|", choice_group="req-1"))
    assert (d1.action, d1.reason, d1.trajectory) == ("append", "extends", 0)
    assert (d2.action, d2.reason, d2.trajectory) == ("start", "sibling_choice", 1)
    assert (d3.action, d3.reason, d3.trajectory) == ("start", "sibling_choice", 2)
    assert d2.drift is not None and d2.drift.compared_trajectory == 0
    prompt2, _ = render(history2)
    assert d2.drift.position == len(prompt2)
    assert (d2.drift.held_token, d2.drift.new_token) == (ord("X"), ord("Y"))
    assert "sibling choice" in d2.drift.explanation

    sibling = sample_of(merger, 1)
    # The whole prompt is prompt (no loss); the response is the sibling's own output.
    assert sibling.prompt_length == len(prompt2)
    assert sibling.tokens[sibling.prompt_length :] == enc("Y|")
    assert sibling.loss_mask == [1, 1]

    # The agent continues with the first choice: that goes to trajectory 0.
    d4 = merger.add(make_turn([*history2, msg("assistant", "X"), msg("user", "ok")], "W|"))
    assert (d4.action, d4.trajectory) == ("append", 0)
    assert merger.counts().by_reason == {"first_turn": 1, "extends": 2, "sibling_choice": 2}


def test_first_turn_siblings() -> None:
    merger = TrajectoryMerger(dec)
    a = merger.add(make_turn([msg("user", "q")], "A|", choice_group="g"))
    b = merger.add(make_turn([msg("user", "q")], "B|", choice_group="g"))
    assert (a.reason, b.reason) == ("first_turn", "sibling_choice")
    assert len(merger.trajectories) == 2


@pytest.mark.parametrize(
    ("finish", "status"),
    [("stop", "completed"), ("length", "truncated"), ("abort", "aborted")],
)
def test_status_for_finish(finish: str, status: str) -> None:
    assert status_for_finish(finish) == status


def test_turn_record_contract() -> None:
    ok = make_turn([msg("user", "q")], "A|")
    with pytest.raises(ValueError, match="logprobs"):
        TurnRecord(**{**as_kwargs(ok), "output_logprobs": [0.0]})
    with pytest.raises(ValueError, match="message starts"):
        TurnRecord(**{**as_kwargs(ok), "message_starts": []})
    with pytest.raises(ValueError, match="non-decreasing"):
        TurnRecord(**{**as_kwargs(ok), "message_starts": [999]})
    with pytest.raises(ValueError, match="at least one prompt token"):
        TurnRecord(**{**as_kwargs(ok), "prompt_ids": []})


def as_kwargs(turn: TurnRecord) -> dict[str, Any]:
    return {name: getattr(turn, name) for name in TurnRecord.__slots__}


def test_sample_lengths_are_validated() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1], rollout_log_probs=[0.0, 0.0],
               rollout_id="r")  # fmt: skip
    with pytest.raises(ValueError, match="rollout_log_probs"):
        Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 0], rollout_log_probs=[0.0],
               rollout_id="r")  # fmt: skip
    with pytest.raises(ValueError, match="exceeds"):
        Sample(tokens=[1], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0],
               rollout_id="r")  # fmt: skip
    with pytest.raises(ValueError, match="only 0 and 1"):
        Sample(tokens=[1, 2], response_length=1, loss_mask=[2], rollout_log_probs=[0.0],
               rollout_id="r")  # fmt: skip


def test_decode_failure_does_not_fail_the_turn() -> None:
    def broken(ids: Sequence[int]) -> str:
        raise RuntimeError("no tokenizer")

    merger = TrajectoryMerger(broken)
    merger.add(make_turn([msg("user", "q")], "A|"))
    d = merger.add(make_turn([msg("user", "r")], "B|"))
    assert d.drift is not None and "decode failed" in d.drift.held_text


def test_default_decode_shows_ids() -> None:
    merger = TrajectoryMerger(snippet_tokens=2)
    merger.add(make_turn([msg("user", "q")], "A|"))
    d = merger.add(make_turn([msg("user", "r")], "B|"))
    assert d.drift is not None and d.drift.held_text == f"[{ord('q')} {ord('|')}]"


def test_common_prefix_length_across_blocks() -> None:
    from array import array

    a = array("i", range(10_000))
    b = array("i", range(10_000))
    assert common_prefix_length(a, b) == 10_000
    b[9_001] = -1
    assert common_prefix_length(a, b) == 9_001
    assert common_prefix_length(a, b[:50]) == 50


def test_long_session_holds_each_token_once() -> None:
    merger = TrajectoryMerger(dec)
    history = [msg("system", "sys"), msg("user", "go")]
    outputs = 0
    last: TurnRecord | None = None
    for k in range(200):
        answer = f"a{k}|"
        last = make_turn(history, answer)
        d = merger.add(last)
        assert d.action == ("start" if k == 0 else "append")
        outputs += len(answer)
        history = [*history, msg("assistant", answer[:-1]), msg("tool", f"r{k}")]
    assert last is not None
    total = len(last.prompt_ids) + len(last.output_ids)
    (t,) = merger.trajectories
    # Every token once: the held arrays are exactly the final sequence, nothing more.
    assert merger.held_tokens == total == len(t.tokens)
    assert len(t.loss_mask) == len(t.log_probs) == total - t.prompt_length
    assert t.loss_mask.count(1) == outputs
    assert (t.tokens.itemsize, t.loss_mask.itemsize, t.log_probs.itemsize) == (4, 1, 4)
    # Per turn only the new messages are kept (assistant answer + tool result).
    assert max(len(e.messages) for e in merger.turns[1:]) == 2
    assert sum(len(e.messages) for e in merger.turns) == len(last.messages)
