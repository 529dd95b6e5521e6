"""The example's settings: ``settings.toml`` read, overridden and checked.

:func:`load_settings` reads a TOML file, applies its ``[smoke]`` table when asked (a deep
merge: a key there replaces the same key of the file; tables merge key by key, lists are
replaced whole), then ``KEY=VALUE`` overrides (dotted keys, values read as TOML), and validates
the result into :class:`Settings`: unknown keys and out-of-range values raise
:class:`SettingsError` naming them. The ``[sft]`` and ``[rl]`` tables are corral's own
:class:`~corral.trainer.config.SftConfig` and :class:`~corral.trainer.config.TrainConfig`
fields; :meth:`Settings.sft_config` and :meth:`Settings.train_config` fill in what the pipeline
owns (data files, run folders, the model a stage starts from, the device) and validate them
with corral's own models, so a typo there fails before any stage runs.
"""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from corral.trainer.config import (
    ConfigError,
    SftConfig,
    TrainConfig,
    apply_overrides,
    read_toml,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_SETTINGS = HERE / "settings.toml"
BUNDLE = ROOT / "bundles" / "gridsim"
# Keys run.py sets in the trainer configs; the settings file may not.
_SFT_OWNED = ("data", "eval_data", "run_dir", "epochs")
_RL_OWNED = ("run_dir",)


class SettingsError(ValueError):
    """Settings that cannot be used; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DaysSettings(_Section):
    """The warm-start days (see settings.toml)."""

    train_days: int = Field(ge=0, le=2000)
    synthetic: int = Field(ge=0)
    seed: int
    last_date: dt.date
    held_out: int = Field(ge=0)
    # The share of days whose transcript submits a random feasible edit of the rule's schedule
    # (teacher.py); 0: the greedy rule on every day.
    edit_share: float = Field(default=0.0, ge=0.0, le=1.0)


class TokenizerSettings(_Section):
    vocab_size: int = Field(ge=512)
    corpus_days: int = Field(ge=1)
    # "qwen25": corral's template (system prompt and tool schemas rendered); "qwen25-compact":
    # the same turns without the system turn (build.COMPACT_TEMPLATE).
    template: Literal["qwen25", "qwen25-compact"] = "qwen25"


class ModelSettings(_Section):
    """The model's shape (transformers ``Qwen3Config`` field names; head_dim is
    hidden_size / num_attention_heads)."""

    hidden_size: int = Field(ge=8)
    intermediate_size: int = Field(ge=8)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    max_position_embeddings: int = Field(ge=256)
    rope_theta: float = 10000.0
    init_std: float = Field(default=0.02, gt=0)
    seed: int = 0


class SftPhase(_Section):
    """One ``run_sft`` run: ``epochs`` over the data at a constant ``lr``."""

    epochs: float = Field(gt=0)
    lr: float = Field(gt=0)


class Settings(_Section):
    device: Literal["cpu", "cuda"]
    allow_tf32: bool = False
    days: DaysSettings
    tokenizer: TokenizerSettings
    model: ModelSettings
    sft: dict[str, Any]
    rl: dict[str, Any]

    def sft_phases(self) -> list[SftPhase]:
        phases = [SftPhase.model_validate(p) for p in self.sft.get("phases", [])]
        if not phases:
            raise SettingsError("[sft] needs at least one [[sft.phases]] entry")
        return phases

    def sft_config(
        self, phase: SftPhase, *, data: Path, eval_data: Path | None, run_dir: Path, model: Path
    ) -> SftConfig:
        """The :class:`SftConfig` of one phase: ``[sft]`` with the phase's epochs and lr, the
        data, the run folder, the starting model and the device filled in."""
        values = copy.deepcopy({k: v for k, v in self.sft.items() if k != "phases"})
        values.update(data=str(data), run_dir=str(run_dir), epochs=phase.epochs)
        if eval_data is not None:
            values["eval_data"] = str(eval_data)
        values.setdefault("model", {}).update(path=str(model), device=self.device)
        values.setdefault("optim", {})["lr"] = phase.lr
        return _validate(SftConfig, values, "[sft]")

    def train_config(self, *, run_dir: Path, model: Path) -> TrainConfig:
        """The RL :class:`TrainConfig`: ``[rl]`` with the run folder, the SFT model, the device
        and the bundle filled in; ``env.sandbox = "none"`` becomes ``None`` (in process)."""
        values = copy.deepcopy(self.rl)
        values["run_dir"] = str(run_dir)
        values.setdefault("model", {}).update(path=str(model), device=self.device)
        env = values.setdefault("env", {})
        env["bundle"] = str(BUNDLE)
        if env.get("sandbox") == "none":
            env["sandbox"] = None
        return _validate(TrainConfig, values, "[rl]")


def _validate(kind: Any, values: dict[str, Any], where: str) -> Any:
    try:
        return kind.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise SettingsError(f"{where}: {problems}") from None


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` merged in (tables recursively; anything else replaced)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_settings(
    path: Path = DEFAULT_SETTINGS, *, smoke: bool = False, overrides: list[str] | None = None
) -> Settings:
    """The settings of ``path`` (module docstring); SettingsError for anything unusable."""
    try:
        data = read_toml(path)
        smoke_table = data.pop("smoke", {})
        if smoke:
            data = merge(data, smoke_table)
        apply_overrides(data, overrides or [])
    except ConfigError as exc:
        raise SettingsError(str(exc)) from None
    for where, owned in (("sft", _SFT_OWNED), ("rl", _RL_OWNED)):
        taken = [k for k in owned if k in data.get(where, {})]
        if taken:
            raise SettingsError(f"[{where}] {taken} are set by run.py, not the settings file")
    if "lr" in data.get("sft", {}).get("optim", {}):
        raise SettingsError("[sft.optim] lr is set per phase: [[sft.phases]] lr = ...")
    settings = _validate(Settings, data, str(path))
    # The trainer configs are checked now, not when their stage comes.
    settings.sft_phases()
    placeholder = Path("/nonexistent")
    settings.sft_config(
        settings.sft_phases()[0], data=placeholder, eval_data=None, run_dir=placeholder,
        model=placeholder,
    )  # fmt: skip
    settings.train_config(run_dir=placeholder, model=placeholder)
    return settings
