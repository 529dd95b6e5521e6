"""A STAND-IN for the parts of slime (and Miles) that corral's adapters touch; neither can be
installed from the package registry here. Not slime's code: the same names, fields, field types
and defaults, written from reading slime's source at THUDM/slime commit
624b824a898ab0ec1fcb4d373004c7f3852bf515 and Miles' at radixark/miles commit
31f1ca961a94cb860cec3b2dea34ec332bfa8f76:

- slime ``slime/utils/types.py``: ``Sample`` (with ``Sample.Status``, ``SpecInfo``,
  ``PrefixCacheInfo``; ``torch.Tensor`` fields typed ``Any`` here);
- slime ``slime/rollout/filter_hub/base_types.py``: ``DynamicFilterOutput``;
- slime ``slime/rollout/sglang_rollout.py``: ``GenerateState`` as a ``SingletonMeta`` singleton
  with an ``aborted`` flag (the only part the adapter reads);
- Miles ``miles/utils/types.py`` ``Sample``, ``miles/rollout/base_types.py``
  ``GenerateFnInput`` / ``GenerateFnOutput``, ``miles/rollout/filter_hub/base_types.py``
  ``DynamicFilterOutput``.

:func:`install` registers these under slime's and Miles' module names in ``sys.modules`` (through
a ``MonkeyPatch``), which is where the adapters look them up.
"""

from __future__ import annotations

import sys
import types
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

import pytest

from corral.adapters.slime_shapes import Sample, _PrefixCacheInfo, _SpecInfo, _Status

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
MILES_COMMIT = "31f1ca961a94cb860cec3b2dea34ec332bfa8f76"


@dataclass
class DynamicFilterOutput:
    """slime's dynamic sampling filter result."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False


class SingletonMeta(type):
    """slime's singleton metaclass: one instance per class, in ``_instances``."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]


class GenerateState(metaclass=SingletonMeta):
    """slime's rollout state; only ``aborted`` matters to the adapter."""

    def __init__(self, args: Namespace) -> None:
        self.args = args
        self.aborted = False


# --------------------------------------------------------------------------- Miles


@dataclass
class MilesSample:
    """Miles' ``Sample`` (fields in Miles' order; numpy arrays typed ``Any``)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_routed_experts: Any | None = None
    rollout_indexer_topk: Any | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None
    opd_reverse_kl: list[float] | None = None

    Status = _Status
    status: _Status = _Status.PENDING

    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict | None = None
    adapter: Any | None = None
    reward_spec: Any | None = None
    routing_key: str | None = None
    non_generation_time: float = 0.0

    spec_info: _SpecInfo = field(default_factory=_SpecInfo)
    prefix_cache_info: _PrefixCacheInfo = field(default_factory=_PrefixCacheInfo)


@dataclass
class MilesDynamicFilterOutput:
    """Miles' dynamic sampling filter result (no ``keep_when_insufficient`` there)."""

    keep: bool
    reason: str | None = None


@dataclass
class MilesGenerateState:
    """The parts of Miles' ``GenerateState`` a generate function reads."""

    args: Namespace
    tokenizer: Any = None
    aborted: bool = False


@dataclass(frozen=True)
class GenerateFnInput:
    state: MilesGenerateState
    sample: MilesSample
    sampling_params: dict[str, Any]
    evaluation: bool

    @property
    def args(self) -> Namespace:
        return self.state.args


@dataclass(frozen=True)
class GenerateFnOutput:
    samples: MilesSample | list[MilesSample]


# --------------------------------------------------------------------------- registration

_MODULES: dict[str, dict[str, Any]] = {
    "slime": {},
    "slime.utils": {},
    "slime.utils.types": {"Sample": Sample},
    "slime.rollout": {},
    "slime.rollout.filter_hub": {},
    "slime.rollout.filter_hub.base_types": {"DynamicFilterOutput": DynamicFilterOutput},
    "slime.rollout.sglang_rollout": {"GenerateState": GenerateState},
    "miles": {},
    "miles.utils": {},
    "miles.utils.types": {"Sample": MilesSample},
    "miles.rollout": {},
    "miles.rollout.base_types": {
        "GenerateFnInput": GenerateFnInput,
        "GenerateFnOutput": GenerateFnOutput,
    },
    "miles.rollout.filter_hub": {},
    "miles.rollout.filter_hub.base_types": {"DynamicFilterOutput": MilesDynamicFilterOutput},
}


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register the stand-in under slime's and Miles' module names (undone with the patch);
    refuses to shadow a real slime or Miles already imported."""
    for name in ("slime", "miles"):
        module = sys.modules.get(name)
        if module is not None and not getattr(module, "__standin__", False):
            raise RuntimeError(f"the real {name} is imported; the stand-in would shadow it")
    for name, attributes in _MODULES.items():
        module = types.ModuleType(name, f"stand-in for {name} (tests/slime_standin.py)")
        module.__dict__.update(attributes, __standin__=True)
        if not name.endswith(("types", "base_types", "sglang_rollout")):
            module.__path__ = []  # a package, so submodule imports resolve
        monkeypatch.setitem(sys.modules, name, module)
    SingletonMeta._instances.clear()
