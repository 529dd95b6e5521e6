"""Builders for the records that tests make by hand: a gateway's recorded ``Sample``, the
training groups made of them, a ``Row`` whose env server is never reached, and an engine's
``GenerateRequest`` for a chat prompt.

Each builder fills what a test does not care about with small fixed values (documented on the
builder) and takes what it does care about as arguments, so a test states only what it checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from corral.engines.protocol import GenerateRequest, SamplingParams
from corral.rollouts.rows import EnvRef, Row, RowMetadata
from corral.samples import Sample, SampleStatus
from corral.trainer.groups import Group, TrainRollout

# The ids of a sample's prompt and response when the test does not name them.
PROMPT = (1, 2)
RESPONSE = (3, 4)


def make_sample(
    rollout_id: str,
    group_index: int | None,
    reward: float | None = 1.0,
    *,
    prompt: Sequence[int] = PROMPT,
    response: Sequence[int] = RESPONSE,
    loss_mask: Sequence[int] | None = None,
    log_probs: Sequence[float] | None = None,
    status: SampleStatus = "completed",
    failure: str | None = None,
    remove: bool = False,
) -> Sample:
    """A recorded sample of ``prompt + response`` in rollout ``rollout_id`` of group
    ``group_index``. The loss mask defaults to every response token, the rollout log-probs to
    -0.1, -0.2, ... (one per response token); ``failure`` is set as the player sets it
    (``metadata["failure"]``) and ``remove`` as ``remove_sample``."""
    return Sample(
        tokens=[*prompt, *response],
        response_length=len(response),
        loss_mask=[1] * len(response) if loss_mask is None else list(loss_mask),
        rollout_log_probs=(
            [-0.1 * (i + 1) for i in range(len(response))] if log_probs is None else list(log_probs)
        ),
        reward=reward,
        status=status,
        metadata={} if failure is None else {"failure": failure},
        group_index=group_index,
        rollout_id=rollout_id,
        remove_sample=remove,
    )


def make_group(index: int, *rewards: float | None, fail_first: bool = False) -> Group:
    """Group ``index`` with one single-sample rollout per reward, named ``g{index}r{i}``;
    ``fail_first`` gives the first rollout the failure ``env: it died`` (so the group is
    flagged ``DROP_FAILED``)."""
    rollouts = []
    for i, reward in enumerate(rewards):
        failure = "env: it died" if fail_first and i == 0 else None
        sample = make_sample(f"g{index}r{i}", index, reward, failure=failure)
        rollouts.append(TrainRollout.from_samples([sample]))
    return Group(index, tuple(rollouts))


def make_row(
    url: str = "http://127.0.0.1:9",
    *,
    prompt: str = "hi",
    split: str = "eval",
    index: int = 0,
    task_id: str = "t0",
    max_turns: int = 1,
    timeout_s: float = 5.0,
) -> Row:
    """A row of one user message ``prompt`` for an env server at ``url`` (by default a port
    nothing listens on), with no tools and no token; ``timeout_s`` bounds each tool call,
    reset and model call alike."""
    env = EnvRef(
        url=url,
        token_var=None,
        max_turns=max_turns,
        tool_timeout=timeout_s,
        reset_timeout=timeout_s,
        model_timeout=timeout_s,
    )
    meta = RowMetadata(split=split, index=index, task_id=task_id, tools=[], env=env)
    return Row(messages=[{"role": "user", "content": prompt}], metadata=meta)


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    """The token ids of one user message ``content`` in ``tokenizer``'s chat template, with the
    generation prompt (what an engine is asked to continue)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def generate_request(
    input_ids: list[int],
    *,
    top_logprobs_num: int = 0,
    stream: bool = False,
    rid: str | None = None,
    **sampling: Any,
) -> GenerateRequest:
    """``POST /generate``'s body for ``input_ids``: ``sampling`` are the ``SamplingParams``
    fields, the rest the request's own (the protocol's defaults where not given)."""
    return GenerateRequest(
        input_ids=input_ids,
        sampling_params=SamplingParams(**sampling),
        top_logprobs_num=top_logprobs_num,
        stream=stream,
        rid=rid,
    )
