"""Miles' custom generate function and dynamic sampling filter, backed by corral: the same
behaviour as :mod:`corral.adapters.slime` (read that module's docstring first) behind Miles' own
contracts, read from Miles' source (radixark/miles) at commit :data:`MILES_COMMIT`:

- ``miles/rollout/base_types.py``: a generate function is ``async def generate(input:
  GenerateFnInput) -> GenerateFnOutput``; ``GenerateFnInput`` holds ``state`` (Miles'
  ``GenerateState``: ``args``, ``tokenizer``, ``aborted``), ``sample``, ``sampling_params`` and
  ``evaluation`` (``input.args`` is ``state.args``); ``GenerateFnOutput.samples`` is a ``Sample``
  or a ``list[Sample]``.
- ``miles/rollout/inference_rollout/compatibility.py``: a function whose first of three or more
  parameters is not ``input`` is called slime-style; this one takes one parameter, so Miles
  passes ``GenerateFnInput``.
- ``miles/rollout/inference_rollout/inference_rollout_train.py``: with enough groups Miles sets
  ``state.aborted``, aborts every engine request and waits for the generates still running; a
  running generate here polls ``input.state.aborted`` and ends its rollout (episode closed).
- ``miles/rollout/filter_hub/base_types.py``: ``DynamicFilterOutput(keep, reason)``.
- ``miles/utils/types.py``: Miles' ``Sample`` has the fields this adapter fills (``rollout_id``
  an int shared by a rollout's samples, as ``miles/ray/rollout/rollout_data_conversion.py``
  requires) and the same ``Status`` values.

Flags: ``--custom-generate-function-path corral.adapters.miles.generate
--dynamic-sampling-filter-path corral.adapters.miles.keep_scored_groups`` (see docs/slime.md).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from corral.adapters.slime import group_verdict, normalize_group_rewards, play_sample, shutdown

__all__ = ["MILES_COMMIT", "generate", "keep_scored_groups", "normalize_group_rewards", "shutdown"]

logger = logging.getLogger(__name__)

MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"


@functools.cache
def _warn_chat_template(path: str) -> None:
    logger.warning(
        "corral: Miles' --chat-template-path %s is not what corral's gateway renders with; it "
        "renders the checkpoint's own chat template (prompt tokens come from the gateway)",
        path,
    )


async def generate(input: Any) -> Any:  # `input`: the name Miles documents
    """Miles' custom generate (``--custom-generate-function-path
    corral.adapters.miles.generate``): ``GenerateFnOutput(samples=[...])`` with the samples
    :func:`corral.adapters.slime.generate` would return, as Miles' ``Sample`` type (the input
    sample's). ``input.state.aborted`` set while the rollout runs: one ``ABORTED`` sample."""
    from miles.rollout.base_types import GenerateFnOutput

    state = input.state
    template = getattr(input.args, "chat_template_path", None)
    if template:
        _warn_chat_template(str(template))
    samples = await play_sample(
        input.args,
        input.sample,
        input.sampling_params,
        evaluation=bool(input.evaluation),
        aborted=lambda: bool(state.aborted),
        tokenizer=getattr(state, "tokenizer", None),
    )
    return GenerateFnOutput(samples=samples)


def keep_scored_groups(args: Any, samples: Any, **kwargs: Any) -> Any:
    """Miles' dynamic sampling filter (``--dynamic-sampling-filter-path
    corral.adapters.miles.keep_scored_groups``): leaves out a whole group when any of its
    rollouts is flagged, as :func:`corral.adapters.slime.keep_scored_groups` does."""
    from miles.rollout.filter_hub.base_types import DynamicFilterOutput

    keep, reason = group_verdict(samples)
    return DynamicFilterOutput(keep=keep, reason=reason)
