"""The services a training run talks to, started here or found where the config points.

:func:`run_services` yields the :class:`~corral.trainer.loop.Services` of a
:class:`~corral.trainer.config.TrainConfig`:

- the engine side: without ``[engine] url``, the local engine and a gateway in this process on
  127.0.0.1 (weights pushed in memory), or with ``[engine] processes`` in child processes
  (weights through disk, logs in ``<run>/logs``); with ``url``, the given gateway and SGLang
  engines (weights through ``<run>/weights`` and ``update_weights_from_disk``), or vLLM ones
  with ``[engine] api = "vllm"`` (the same folders, reloaded in place);
- the env side: without ``[env] url``, the bundle served in this process or, with
  ``[env] processes``, in a child process (episodes in ``[env] sandbox`` sandboxes); with it,
  that server. Either way the rows are written from the server's task API into ``<run>/rows``
  and read back per split. A server started here admits at least ``rollout.concurrency``
  episodes at once.
- with ``[agent]``: a server started here runs its episodes in ``[agent] sandbox`` sandboxes
  (else ``[env] sandbox``), is handed the agent CLIs (``[agent] clis``, else
  ``$CORRAL_AGENT_CLIS``), allows agents' traffic to this run's gateway and admits their
  budget (``[agent] timeout_s``).

Everything started here stops when the block exits.

The parts, each usable alone: :func:`start_engine_side` (:class:`EngineSide`),
:func:`start_env_side` (:class:`EnvSide`) and :func:`write_and_split_rows` (:class:`RunRows`).
Every server is started through :mod:`corral.stack` from typed settings (a child's argv is its
settings' ``to_argv()``, never flags spelled here). ``[env] bundle`` unset serves the gridsim
bundle of corral's checkout (:mod:`corral.bundled`), looked up only when this run serves it.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from corral.bundled import BundledMissing
from corral.env_secrets import SecretMissing, env_secret
from corral.envs.settings import AGENT_CLIS_VARIABLE, ServeSettings
from corral.rollouts.evals import task_groups
from corral.rollouts.rows import Row, RowSettings, read_rows, write_rows
from corral.trainer.config import AgentSettings, TrainConfig, model_path
from corral.trainer.weights import DiskWeightSync, InProcessWeightSync, WeightSync

__all__ = [
    "AGENT_CLIS_VARIABLE",
    "OWN_ENGINE_TOKEN_VAR",
    "OWN_ENV_TOKEN_VAR",
    "OWN_GATEWAY_TOKEN_VAR",
    "AgentServing",
    "EngineSide",
    "EnvSide",
    "RunRows",
    "ServicesError",
    "agent_serving",
    "env_serve_settings",
    "run_services",
    "start_engine_side",
    "start_env_side",
    "write_and_split_rows",
]

# The gateway a run starts for itself gets a fresh admin token (in this variable of its
# process): the agents a run plays reach the gateway through their sessions' URLs, and an open
# admin route would let one set its own reward.
OWN_GATEWAY_TOKEN_VAR = "CORRAL_RUN_GATEWAY_ADMIN"
# Likewise the engine child a run starts: its token (in this variable of the engine's and the
# gateway's processes) keeps other local processes from aborting its requests or swapping its
# weights; only the gateway and the weight sync hold it.
OWN_ENGINE_TOKEN_VAR = "CORRAL_RUN_ENGINE_TOKEN"
# On Ray the env servers listen on the node's address, so they always take a token: one the
# config names, else a fresh one in this variable of the run's process, which the rows name
# (this process's players and the rollout workers read it as they read a configured one).
OWN_ENV_TOKEN_VAR = "CORRAL_RUN_ENV_TOKEN"


@dataclass(frozen=True)
class Services:
    """What the loop talks to, already running: the gateway (and its admin token), the rows
    (from the env servers the rows name), and the way weights reach the engines.
    ``eval_groups``/``group_by``: each eval task's group, for per-group eval means."""

    gateway: str
    admin_token: str | None
    train_rows: list[Row]
    eval_rows: list[Row]
    weight_sync: WeightSync
    model_path: Path
    eval_groups: dict[str, str] | None = None
    group_by: str | None = None
    # On Ray: the rollout-worker actors that play the rollouts, and the env servers to spread
    # the rows over (corral.trainer.ray_cluster); without workers the loop plays them here.
    rollout_workers: Sequence[Any] = ()
    env_urls: Sequence[str] = ()


class ServicesError(RuntimeError):
    """A service the config names cannot be used (unset token variable, no rows, ...)."""


def _gateway_host(on_ray: bool) -> str:
    """On Ray the rollout workers may run on other nodes: the gateway listens on this node's
    address, not on loopback."""
    if not on_ray:
        return "127.0.0.1"
    from corral.trainer.ray_cluster import node_ip

    return node_ip()


def _token(var: str | None, what: str) -> str | None:
    try:
        return env_secret(var, what)
    except SecretMissing as exc:
        raise ServicesError(str(exc)) from None


@dataclass(frozen=True)
class AgentServing:
    """What an env server started by this run needs for ``[agent]``: the sandbox backend,
    the agent CLIs folder (``None``: only ``command`` agents run), the gateway origin agents
    are bridged to and the longest budget a launch may ask for."""

    sandbox: str | None
    clis: Path | None
    gateway: str
    max_timeout_s: float


def agent_serving(agent: AgentSettings, sandbox: str | None, gateway: str) -> AgentServing:
    """:class:`AgentServing` for ``[agent]`` with ``[env] sandbox`` ``sandbox`` and this
    run's ``gateway`` URL (``[agent] sandbox_gateway`` when set: the origin the env server
    reaches it at). ServicesError for a CLIs folder that does not exist."""
    from corral.envs.agent_bridge import AgentPolicy
    from corral.rollouts.harness_play import origin

    clis_text = agent.clis or os.environ.get(AGENT_CLIS_VARIABLE) or None
    clis = Path(clis_text) if clis_text is not None else None
    if clis is not None and not clis.is_dir():
        raise ServicesError(f"[agent] clis: {clis} is not a folder (scripts/agent_clis.sh DIR)")
    if clis is None and agent.harness != "command":
        raise ServicesError(
            f"[agent] harness {agent.harness!r} needs the agent CLIs: set [agent] clis or "
            f"${AGENT_CLIS_VARIABLE} (bash scripts/agent_clis.sh DIR installs them)"
        )
    return AgentServing(
        sandbox=agent.sandbox or sandbox,
        clis=clis,
        gateway=origin(agent.sandbox_gateway or gateway),
        # The server's cap must admit the budget this run's launches ask for.
        max_timeout_s=max(AgentPolicy().max_timeout_s, agent.timeout_s),
    )


# --------------------------------------------------------------------------- the engine side


@dataclass(frozen=True)
class EngineSide:
    """The run's gateway (and its admin token) and how weights reach the engines behind it."""

    gateway: str
    admin_token: str | None
    weight_sync: WeightSync


def start_engine_side(config: TrainConfig, stack: ExitStack, model: Path) -> EngineSide:
    """The engine side of ``config`` for the policy folder ``model``: the local engine and a
    gateway as child processes (``[engine] processes``) or in this process, or the gateway
    and engines at ``[engine] gateway``/``url``. What it starts stops when ``stack`` closes."""
    if config.engine.url is not None:
        return _engines_at_url(config, model)
    if config.engine.processes:
        return _engine_children(config, stack, model)
    return _engine_in_thread(config, stack, model)


def _engine_children(config: TrainConfig, stack: ExitStack, model: Path) -> EngineSide:
    """``corral engine`` and ``corral gateway`` as children (logs in ``<run>/logs``); weights
    through disk."""
    from corral.engines.local.settings import EngineSettings
    from corral.gateway.launch import GatewayLaunch
    from corral.stack.engine import engine_in_process
    from corral.stack.gateway import gateway_in_process

    logs = config.run_dir / "logs"
    engine = EngineSettings(
        model=model,
        device=config.model.device,
        max_batch_size=config.engine.max_batch_size,
        token_var=OWN_ENGINE_TOKEN_VAR,
    )
    engine_token = secrets.token_urlsafe(32)
    engine_url = stack.enter_context(
        engine_in_process(engine, log=logs / "engine.log", token=engine_token)
    )
    admin_token = secrets.token_urlsafe(32)
    launch = GatewayLaunch(
        engine_url=engine_url,
        model=model,
        admin_token_var=OWN_GATEWAY_TOKEN_VAR,
        engine_token_var=OWN_ENGINE_TOKEN_VAR,
    )
    gateway = stack.enter_context(
        gateway_in_process(
            launch,
            log=logs / "gateway.log",
            admin_token=admin_token,
            engine_token=engine_token,
            host=_gateway_host(config.ray.address is not None),
        )
    )
    weight_sync = DiskWeightSync(
        [engine_url], config.run_dir / "weights", tokenizer_from=model, api_key=engine_token
    )
    return EngineSide(gateway, admin_token, weight_sync)


def _engine_in_thread(config: TrainConfig, stack: ExitStack, model: Path) -> EngineSide:
    """The local engine and a gateway in this process; weights in memory."""
    from corral.stack import local_stack

    admin_token = secrets.token_urlsafe(32)
    urls = stack.enter_context(
        local_stack(
            model,
            device=config.model.device,
            admin_token=admin_token,
            gateway_host=_gateway_host(config.ray.address is not None),
            max_batch_size=config.engine.max_batch_size,
        )
    )
    assert urls.local_engine is not None
    return EngineSide(urls.gateway, admin_token, InProcessWeightSync(urls.local_engine))


def _engines_at_url(config: TrainConfig, model: Path) -> EngineSide:
    """The gateway and engines the config names; weights through ``<run>/weights``."""
    from corral.engines.client import engine_urls

    assert config.engine.gateway is not None  # the config checks both or neither
    admin_token = _token(config.engine.admin_token_var, "[engine] admin_token_var")
    # Every engine behind the gateway gets the weights (the gateway's own list, or the
    # workers behind its router).
    weight_sync = DiskWeightSync(
        engine_urls(config.engine.url or ""),
        config.run_dir / "weights",
        tokenizer_from=model,
        api=config.engine.api,
    )
    return EngineSide(config.engine.gateway, admin_token, weight_sync)


# --------------------------------------------------------------------------- the env side


@dataclass(frozen=True)
class EnvSide:
    """The env server the rows are read from (``url``), every env server to spread the rows
    over on Ray (``urls``; empty otherwise) and the token they require."""

    url: str
    token: str | None
    urls: list[str] = field(default_factory=list)
    # The variable the rows name for the token (None: ``[env] token_var``).
    token_var: str | None = None


def env_serve_settings(config: TrainConfig, agents: AgentServing | None = None) -> ServeSettings:
    """The env server this run serves: ``[env]``'s bundle, sandbox and timeouts, and with
    ``agents`` (:func:`agent_serving`) the agents' sandbox, CLIs, gateway and budget. It
    admits at least the server's default episodes at once, more with more rollouts in flight
    (an episode holds its slot while the model thinks, so a smaller cap throttles the whole
    step). ServicesError for a bundle that cannot be found."""
    from corral.envs.episodes import DEFAULT_MAX_CONCURRENT_ENVS

    env = config.env
    try:
        bundle = env.bundle_folder()
    except BundledMissing as exc:
        raise ServicesError(str(exc)) from None
    settings = ServeSettings(
        bundle=bundle,
        token_var=env.token_var,
        max_concurrent_envs=max(DEFAULT_MAX_CONCURRENT_ENVS, config.rollout.concurrency),
        tool_timeout=env.tool_timeout,
        sandbox=env.sandbox,
    )
    if agents is None:
        return settings
    return replace(
        settings,
        sandbox=agents.sandbox,
        agent_clis=agents.clis,
        agent_gateways=(agents.gateway,),
        agent_max_timeout_s=agents.max_timeout_s,
    )


def start_env_side(config: TrainConfig, stack: ExitStack, gateway: str) -> EnvSide:
    """The env side of ``config`` (``gateway``: the run's, which agents are bridged to): the
    server at ``[env] url``, or the bundle served as a child process (``[env] processes``,
    its log in ``<run>/logs``), as Ray actors (``[ray]``) or in this process. What it starts
    stops when ``stack`` closes. ServicesError for an unset token variable, a missing bundle
    or an ``[agent]`` that cannot run."""
    env = config.env
    token = _token(env.token_var, "[env] token_var")
    agents = None if config.agent is None else agent_serving(config.agent, env.sandbox, gateway)
    if env.url is not None:
        return EnvSide(env.url, token)
    settings = env_serve_settings(config, agents)
    if env.processes:
        from corral.stack.env_server import env_server_in_process

        log = config.run_dir / "logs" / "env.log"
        return EnvSide(stack.enter_context(env_server_in_process(settings, log=log)), token)
    if config.ray.address is not None:
        # [agent] does not go with [ray] (the config refuses it): these serve no agents.
        from corral.trainer.ray_cluster import start_env_servers

        token_var = env.token_var
        if token is None:
            token, token_var = secrets.token_urlsafe(32), OWN_ENV_TOKEN_VAR
            os.environ[OWN_ENV_TOKEN_VAR] = token
        servers = start_env_servers(
            settings.bundle,
            config.ray.env_servers,
            sandbox=settings.sandbox,
            token=token,
            tool_timeout=settings.tool_timeout,
            max_concurrent_envs=settings.max_concurrent_envs,
        )
        for server in servers:
            stack.callback(server.stop)
        urls = [server.url for server in servers]
        return EnvSide(urls[0], token, urls, token_var)
    from corral.stack.env_server import env_server_in_thread

    return EnvSide(stack.enter_context(env_server_in_thread(settings, token=token)), token)


# --------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class RunRows:
    """The run's rows per split, and each eval task's group (``eval_groups``, named by
    ``group_by``) for per-group eval means."""

    train: list[Row]
    evals: list[Row]
    eval_groups: dict[str, str]
    group_by: str | None


def write_and_split_rows(config: TrainConfig, env: EnvSide) -> RunRows:
    """Write the rows of the env server at ``env.url`` from its task API into ``<run>/rows``
    and read them back per split (``[env] train_split``/``eval_split``). ServicesError when
    the train split has none; the row writer's own errors propagate."""
    settings = config.env
    rows_dir = config.run_dir / "rows"
    row_settings = RowSettings(
        max_turns=settings.max_turns,
        tool_timeout=settings.tool_timeout,
        model_timeout=settings.model_timeout,
        token_var=env.token_var if env.token_var is not None else settings.token_var,
    )
    write_rows(env.url, rows_dir, row_settings, token=env.token)
    rows = read_rows(rows_dir / "all.jsonl")
    train = [r for r in rows if r.metadata.split == settings.train_split]
    evals = [r for r in rows if r.metadata.split == settings.eval_split]
    if not train:
        raise ServicesError(f"the env server at {env.url} has no {settings.train_split!r} rows")
    group_by, groups = task_groups(evals, env.token) if evals else (None, {})
    return RunRows(train, evals, groups, group_by)


def _start_rollout_workers(
    config: TrainConfig, stack: ExitStack, engine: EngineSide, train: list[Row]
) -> list[object]:
    """On Ray, the rollout-worker actors that play the rows (stopped when ``stack`` closes)."""
    from corral.trainer.ray_cluster import start_rollout_workers, token_env

    handles = start_rollout_workers(
        engine.gateway,
        config.ray.rollout_workers,
        admin_token=engine.admin_token,
        sampling=config.rollout.sampling(),
        concurrency=config.rollout.concurrency,
        env=token_env(train),
    )
    for handle in handles:
        stack.callback(handle.stop)
    return list(handles)


@contextmanager
def run_services(config: TrainConfig) -> Iterator[Services]:
    """Start or find the run's services (module docstring). ServicesError for a missing token,
    bundle or a split without rows; the env server's and the engines' own errors propagate."""
    path = model_path(config)
    with ExitStack() as stack:
        engine = start_engine_side(config, stack, path)
        env = start_env_side(config, stack, engine.gateway)
        rows = write_and_split_rows(config, env)
        workers = (
            _start_rollout_workers(config, stack, engine, rows.train)
            if config.ray.address is not None
            else []
        )
        yield Services(
            gateway=engine.gateway,
            admin_token=engine.admin_token,
            train_rows=rows.train,
            eval_rows=rows.evals,
            weight_sync=engine.weight_sync,
            model_path=path,
            eval_groups=rows.eval_groups,
            group_by=rows.group_by,
            rollout_workers=workers,
            env_urls=env.urls,
        )
