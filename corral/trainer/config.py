"""The settings of a training run: one TOML file, every field optional.

``corral train [CONFIG.toml] [--set section.key=value ...]`` reads a :class:`TrainConfig`. With
no file the run uses the embedded defaults: the tiny model, the local engine and gateway in this
process, and the gridsim bundle served here with each episode in a ``local`` sandbox. A run is
pointed at existing services instead by ``[engine] url``/``gateway`` and ``[env] url``.

The resolved config is written into the run folder (``config.json``); a resumed run reads its
checkpoint, not the file, for everything that makes steps reproducible (the data order, group
numbering, RNG states), so changing e.g. ``steps`` in the file and resuming extends a run.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from corral.envs.settings import TOOL_TIMEOUT_S
from corral.trainer.losses import KL_ESTIMATORS, LossConfig
from corral.validation import validation_message


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Section):
    """The policy. ``path``: a Hugging Face folder (Qwen2/Qwen3/Llama family); unset means the
    tiny model, built offline and cached. ``dtype`` is the trainer's parameter dtype. Under
    torchrun: ``tensor_parallel`` ranks per replica, and ``collective_timeout_s`` for the
    training collectives (None: torch's and megatron's defaults, 10 and 30 minutes under NCCL;
    megatron's groups take it in whole minutes); ranks waiting for the leader's next command
    are not bound by it (``corral.trainer.megatron_runtime``)."""

    path: Path | None = None
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    tensor_parallel: int = Field(default=1, ge=1)
    collective_timeout_s: float | None = Field(default=None, gt=0)


class EnvSettings(_Section):
    """Where episodes run. ``url`` set: an env server already serving (its rows are read from
    it). Unset: ``bundle`` is served by this run, episodes in ``sandbox`` sandboxes: in this
    process, or with ``processes`` in a child process (``corral serve``) whose CPU work then
    runs beside the trainer's instead of sharing its interpreter."""

    # None: the gridsim bundle of corral's checkout (what `corral run` serves), found only when
    # this run serves it (:meth:`bundle_folder`): a run against [env] url needs none.
    bundle: Path | None = None
    url: str | None = None
    token_var: str | None = None
    sandbox: str | None = "local"
    train_split: str = "train"
    eval_split: str = "eval"
    max_turns: int = Field(default=4, ge=1)
    tool_timeout: float = Field(default=TOOL_TIMEOUT_S, gt=0)
    model_timeout: float = Field(default=600.0, gt=0)
    processes: bool = False

    @model_validator(mode="after")
    def _served_here_or_there(self) -> EnvSettings:
        if self.processes and self.url is not None:
            raise ValueError("[env] processes serves the bundle; it does not go with url")
        return self

    def bundle_folder(self) -> Path:
        """The bundle this run serves: ``bundle``, else the checkout's gridsim
        (:func:`corral.bundled.gridsim_bundle`, BundledMissing for an installed package)."""
        if self.bundle is not None:
            return self.bundle
        from corral.bundled import gridsim_bundle

        return gridsim_bundle()


class EngineSettings(_Section):
    """The inference side. Unset ``url``: the local engine and a gateway in this process (the
    weights go to it in memory), or with ``processes`` in two child processes (``corral
    engine``, ``corral gateway``: they get CPU cores of their own, which a few hundred
    rollouts in flight need; weights then go through disk as below). Set: an SGLang engine (or
    several, comma-separated) that the gateway at ``gateway`` fronts; weights go through
    ``update_weights_from_disk`` from ``<run>/weights`` (a path the engines must be able to
    read). ``api`` is the API the engines at ``url`` speak: ``"sglang"`` (SGLang, its router,
    corral's engine) or ``"vllm"`` (vLLM started with ``--enable-scale-out`` and
    ``VLLM_SERVER_DEV_MODE=1``, its gateway with ``--engine-api vllm``; weights are reloaded
    in place from the same folders, see ``corral.engines.vllm``)."""

    url: str | None = None
    gateway: str | None = None
    api: Literal["sglang", "vllm"] = "sglang"
    admin_token_var: str | None = None
    # The local engine's decode batch (requests beyond it wait for a free slot); a step plays
    # groups_per_step x rollouts_per_row rollouts, up to rollout.concurrency at once.
    max_batch_size: int = Field(default=64, ge=1)
    processes: bool = False

    @model_validator(mode="after")
    def _both_or_neither(self) -> EngineSettings:
        if (self.url is None) != (self.gateway is None):
            raise ValueError("[engine] url and gateway go together (or neither: the local engine)")
        if self.processes and self.url is not None:
            raise ValueError("[engine] processes starts the local engine; it does not go with url")
        if self.api != "sglang" and self.url is None:
            raise ValueError(
                f'[engine] api = "{self.api}" names the API of the engines at url; the local '
                "engine speaks SGLang's"
            )
        return self

    @property
    def weights_in_memory(self) -> bool:
        """Whether weights reach the engine in memory (the local engine in this process);
        otherwise through ``<run>/weights`` on disk."""
        return self.url is None and not self.processes


class RolloutSettings(_Section):
    """A step's data: ``groups_per_step`` rows kept after the group filter, each played
    ``rollouts_per_row`` times; failed groups are replaced by new draws, at most ``max_draws``
    draws per step."""

    groups_per_step: int = Field(default=4, ge=1)
    rollouts_per_row: int = Field(default=4, ge=1)
    concurrency: int = Field(default=8, ge=1)
    max_draws: int = Field(default=4, ge=1)
    drop_all_equal: bool = False
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    max_tokens: int = Field(default=256, ge=1)
    # Off-policy by one: the next step's rollouts are played while this step trains.
    overlap: bool = False

    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}


class OptimSettings(_Section):
    """AdamW and its learning-rate schedule over the run's updates (RL: ``schedule.steps``;
    SFT: ``epochs`` over the data): ``lr_warmup_steps`` rising linearly to ``lr``, then
    ``lr_decay_style`` from ``lr`` towards ``min_lr`` (``constant`` keeps ``lr``), as
    Megatron's ``--lr-decay-style`` / ``--lr-warmup-iters`` / ``--min-lr``. The rate is a
    function of the step and the run's total, so a resumed run with the same total continues
    the same schedule (raising ``steps`` or ``epochs`` on resume stretches what is left)."""

    lr: float = Field(default=1e-5, gt=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_warmup_steps: int = Field(default=0, ge=0)
    min_lr: float = Field(default=0.0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    max_grad_norm: float | None = Field(default=1.0, gt=0)
    max_tokens_per_micro_batch: int = Field(default=8192, ge=1)

    @model_validator(mode="after")
    def _valid(self) -> OptimSettings:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr:g}) must not exceed lr ({self.lr:g})")
        return self


class LossSettings(_Section):
    """See :class:`corral.trainer.losses.LossConfig`; ``normalize_std`` divides GRPO
    advantages by the group's reward std. ``kl_coef > 0`` keeps the starting model, frozen,
    as the KL's reference (a second copy of the weights on every trainer rank)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float | None = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    entropy_coef: float = 0.0
    normalize_std: bool = True

    @model_validator(mode="after")
    def _valid(self) -> LossSettings:
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}")
        self.loss_config()  # LossConfig's own range checks
        return self

    def loss_config(self) -> LossConfig:
        return LossConfig(
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            tis_cap=self.tis_cap,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,  # type: ignore[arg-type]
            entropy_coef=self.entropy_coef,
        )


class ScheduleSettings(_Section):
    """``eval_every``/``checkpoint_every`` in steps (0: never; evaluation also runs before the
    first step and after the last when it is on). ``eval_limit`` caps the eval rows used.
    ``time_limit`` (seconds, from when this process starts stepping): the run ends early, as
    it would after its last step (a checkpoint, an evaluation), once another step and an
    evaluation would not fit; running it again resumes towards ``steps``. ``rollouts_every``:
    every that many updates, the rollouts the update trained on (episodes, samples, traces)
    are kept under ``rollouts/update-NNNNNN/`` for ``corral view`` (0: never), the newest
    ``keep_rollouts`` of them (0: all; :mod:`corral.trainer.rollout_log`)."""

    steps: int = Field(default=10, ge=0)
    time_limit: float | None = Field(default=None, gt=0)
    eval_every: int = Field(default=5, ge=0)
    eval_limit: int | None = Field(default=None, ge=1)
    eval_temperature: float = Field(default=0.0, ge=0)
    checkpoint_every: int = Field(default=5, ge=0)
    keep_checkpoints: int = Field(default=2, ge=1)
    rollouts_every: int = Field(default=1, ge=0)
    keep_rollouts: int = Field(default=20, ge=0)


class RaySettings(_Section):
    """``address`` set (``"local"`` starts a Ray here): the run is placed on that cluster. The
    trainer runs as one Ray task (holding a GPU when ``model.device`` is cuda) with the local
    engine and gateway in it unless ``[engine] url``; ``env_servers`` env-server actors serve
    the bundle unless ``[env] url``; ``rollout_workers`` actors play the rollouts. Every node
    needs corral installed and the bundle at the same path."""

    address: str | None = None
    rollout_workers: int = Field(default=2, ge=1)
    env_servers: int = Field(default=1, ge=1)


class AgentSettings(_Section):
    """Rollouts played by a black-box agent inside each episode's sandbox (corral's harnesses:
    ``claude-code``, ``codex``, ``command``) instead of the episode player. ``agent_cmd`` and
    ``agent_dir``: the ``command`` harness's shell command and the folder of its files;
    ``settings``: the harness's own (``corral harness list``; Claude Code's ``max_turns``, the
    CLIs' ``max_retries``).
    ``timeout_s``: each agent's budget (past it the rollout fails). ``model``: the model name
    the agent asks its gateway session for. When this run serves the bundle, its env server
    runs episodes in ``sandbox`` sandboxes (None: ``[env] sandbox``), hands them the agent
    CLIs in ``clis`` (an npm install, ``scripts/agent_clis.sh DIR``; None: ``$CORRAL_AGENT_CLIS``
    when set) and bridges agents to this run's gateway. ``sandbox_gateway``: the gateway's
    origin as the env server reaches it (None: the gateway's own URL); needed when
    ``[env] url`` names a server on another machine."""

    harness: Literal["claude-code", "codex", "command"]
    agent_cmd: str | None = None
    agent_dir: Path | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float = Field(default=600.0, gt=0)
    model: str = Field(default="corral", min_length=1)
    sandbox: str | None = None
    clis: Path | None = None
    sandbox_gateway: str | None = None

    @model_validator(mode="after")
    def _command_options(self) -> AgentSettings:
        if self.harness == "command" and not (self.agent_cmd or "").strip():
            raise ValueError('[agent] harness = "command" needs agent_cmd')
        if self.harness != "command" and (self.agent_cmd is not None or self.agent_dir):
            raise ValueError(
                f'[agent] agent_cmd and agent_dir go with harness = "command", not "{self.harness}"'
            )
        from corral.harnesses import HARNESSES, settings_of

        known = set(settings_of(HARNESSES[self.harness])) - {"command", "agent_dir"}
        if unknown := sorted(set(self.settings) - known):
            raise ValueError(
                f"[agent] settings: {', '.join(unknown)} not among {self.harness}'s "
                f"({', '.join(sorted(known)) or 'none'})"
            )
        return self


class TrainConfig(_Section):
    """A whole run (module docstring). ``run_dir`` holds metrics, checkpoints and evals; a run
    whose folder has a checkpoint resumes from it."""

    run_dir: Path = Path("runs/train")
    seed: int = 0
    model: ModelSettings = ModelSettings()
    env: EnvSettings = EnvSettings()
    engine: EngineSettings = EngineSettings()
    rollout: RolloutSettings = RolloutSettings()
    optim: OptimSettings = OptimSettings()
    loss: LossSettings = LossSettings()
    schedule: ScheduleSettings = ScheduleSettings()
    tensorboard: bool = True
    ray: RaySettings = RaySettings()
    agent: AgentSettings | None = None

    @model_validator(mode="after")
    def _agents_here(self) -> TrainConfig:
        if self.agent is not None and self.ray.address is not None:
            # Ray's rollout workers play with the episode player only.
            raise ValueError("[agent] does not go with [ray] address (yet)")
        agent, env = self.agent, self.env
        unsandboxed = env.sandbox is None and agent is not None and agent.sandbox is None
        if unsandboxed and env.url is None:  # an env in this process runs no agents
            raise ValueError("[agent] needs a sandbox: set [agent] sandbox or [env] sandbox")
        return self


C = TypeVar("C", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the field."""


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """The RL config in ``path`` (TOML; ``None``: the defaults) with ``overrides`` applied, each
    ``section.key=value`` where value is read as TOML (``rollout.temperature=1.2``,
    ``env.url="http://..."``; a bare word that is not TOML is taken as a string).

    ConfigError for an unreadable or invalid file, a malformed override, an unknown field or
    an out-of-range value."""
    return _load(TrainConfig, path, overrides)


def load_sft_config(path: Path | None = None, overrides: list[str] | None = None) -> SftConfig:
    """:func:`load_config` for :class:`SftConfig`."""
    return _load(SftConfig, path, overrides)


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML file at ``path`` as a dict; ConfigError when it cannot be read or parsed."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``data`` (changed in place and returned) with each ``a.b.key=value`` override set; the
    value is read as TOML, a bare word that is not TOML as a string. ConfigError for an item
    that is not ``key=value`` or that descends into a value that is not a table."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not section.key=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
            node = child
        node[leaf] = _toml_value(raw.strip())
    return data


def _load(kind: type[C], path: Path | None, overrides: list[str] | None) -> C:
    data = apply_overrides(read_toml(path) if path is not None else {}, overrides or [])
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        problems = validation_message(exc, root="config")
        raise ConfigError(f"invalid training config: {problems}") from None


def _toml_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


class SftConfig(_Section):
    """``corral sft``: supervised fine-tuning on chat transcripts (``data``, JSONL in OpenAI's
    chat fine-tuning shape; see :mod:`corral.trainer.sft`), the warm start before RL. Each
    step trains on ``batch_size`` conversations; ``epochs`` passes over the data. The result
    is a Hugging Face folder, ``<run_dir>/model``, that ``[model] path`` of an RL run (or an
    engine) takes as it is."""

    data: Path
    eval_data: Path | None = None
    run_dir: Path = Path("runs/sft")
    seed: int = 0
    model: ModelSettings = ModelSettings()
    optim: OptimSettings = OptimSettings()
    batch_size: int = Field(default=16, ge=1)
    epochs: float = Field(default=1.0, gt=0)
    max_tokens: int | None = Field(default=None, ge=1)
    eval_every: int = Field(default=0, ge=0)
    checkpoint_every: int = Field(default=0, ge=0)
    keep_checkpoints: int = Field(default=2, ge=1)
    tensorboard: bool = True


def model_path(config: TrainConfig | SftConfig) -> Path:
    """The policy's Hugging Face folder: the configured one, or the cached tiny model."""
    if config.model.path is not None:
        return config.model.path
    from corral.engines.tiny_model import cached_tiny_model

    return cached_tiny_model()
