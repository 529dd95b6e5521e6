"""slime's ``Sample`` shape (THUDM/slime ``slime/utils/types.py`` at commit
624b824a898ab0ec1fcb4d373004c7f3852bf515: the same field names, types, order and defaults;
``torch.Tensor`` fields typed ``Any``), for running corral's slime path where slime itself is
not installed: ``corral run`` plays episodes through :func:`corral.adapters.slime.generate`
with these, and the tests' stand-in of slime registers them under slime's module names. The
adapter takes the sample class (and its ``Status``) from the sample it is given, so with slime
installed slime's own class is used and this module is not imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class _Status(Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class _SpecInfo:
    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0


@dataclass
class _PrefixCacheInfo:
    cached_tokens: int = 0
    total_prompt_tokens: int = 0


@dataclass
class Sample:
    """slime's ``Sample`` (fields in slime's order)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | Any | None = None
    rollout_top_p_token_offsets: list[int] | Any | None = None
    rollout_routed_experts: list[list[int]] | Any | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    Status = _Status
    status: _Status = _Status.PENDING

    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    SpecInfo = _SpecInfo
    spec_info: _SpecInfo = field(default_factory=_SpecInfo)
    PrefixCacheInfo = _PrefixCacheInfo
    prefix_cache_info: _PrefixCacheInfo = field(default_factory=_PrefixCacheInfo)

    def get_reward_value(self, args: Any) -> Any:
        return self.reward if not args.reward_key else self.reward[args.reward_key]  # type: ignore[index]
