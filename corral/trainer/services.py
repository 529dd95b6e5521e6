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
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.env_secrets import SecretMissing, env_secret
from corral.rollouts.evals import task_groups
from corral.rollouts.rows import RowSettings, read_rows, write_rows
from corral.trainer.config import AgentSettings, SftConfig, TrainConfig
from corral.trainer.loop import Services
from corral.trainer.weights import DiskWeightSync, InProcessWeightSync, WeightSync

# The gateway a run starts for itself gets a fresh admin token (in this variable of its
# process): the agents a run plays reach the gateway through their sessions' URLs, and an open
# admin route would let one set its own reward.
OWN_GATEWAY_TOKEN_VAR = "CORRAL_RUN_GATEWAY_ADMIN"


class ServicesError(RuntimeError):
    """A service the config names cannot be used (unset token variable, no rows, ...)."""


def model_path(config: TrainConfig | SftConfig) -> Path:
    """The policy's Hugging Face folder: the configured one, or the cached tiny model."""
    if config.model.path is not None:
        return config.model.path
    from corral.engines.tiny_model import cached_tiny_model

    return cached_tiny_model()


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


# Where the agent CLIs are when [agent] clis is not set (what `corral serve` reads too).
AGENT_CLIS_VARIABLE = "CORRAL_AGENT_CLIS"


@dataclass(frozen=True)
class AgentServing:
    """What an env server started by this run needs for ``[agent]``: the sandbox backend,
    the agent CLIs folder (``None``: only ``command`` agents run), the gateway origin agents
    are bridged to and the longest budget a launch may ask for."""

    sandbox: str | None
    clis: Path | None
    gateway: str
    max_timeout_s: float

    def serve_flags(self) -> list[str]:
        """The same as ``corral serve`` flags."""
        flags = ["--agent-gateway", self.gateway, "--agent-max-timeout", str(self.max_timeout_s)]
        if self.clis is not None:
            flags += ["--agent-clis", str(self.clis)]
        return flags


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


@contextmanager
def run_services(config: TrainConfig) -> Iterator[Services]:
    """Start or find the run's services (module docstring). ServicesError for a missing token
    or a split without rows; the env server's and the engines' own errors propagate."""
    from corral.engines.client import engine_urls
    from corral.envs.server import DEFAULT_MAX_CONCURRENT_ENVS, build_app
    from corral.processes import serve_in_process
    from corral.serving import serve_in_thread
    from corral.stack import local_stack

    path = model_path(config)
    on_ray = config.ray.address is not None
    logs = config.run_dir / "logs"
    with ExitStack() as stack:
        weight_sync: WeightSync
        if config.engine.url is None and config.engine.processes:
            host = _gateway_host(on_ray)
            engine_url = stack.enter_context(
                serve_in_process(
                    [
                        "engine",
                        "--model",
                        str(path),
                        "--device",
                        config.model.device,
                        "--max-batch-size",
                        str(config.engine.max_batch_size),
                    ],
                    log=logs / "engine.log",
                )
            )
            own_token = secrets.token_urlsafe(32)
            admin_token: str | None = own_token
            gateway = stack.enter_context(
                serve_in_process(
                    [
                        *("gateway", "--engine-url", engine_url, "--model", str(path)),
                        *("--admin-token-var", OWN_GATEWAY_TOKEN_VAR),
                    ],
                    host=host,
                    log=logs / "gateway.log",
                    env={OWN_GATEWAY_TOKEN_VAR: own_token},
                )
            )
            weight_sync = DiskWeightSync(
                [engine_url], config.run_dir / "weights", tokenizer_from=path
            )
        elif config.engine.url is None:
            admin_token = secrets.token_urlsafe(32)
            urls = stack.enter_context(
                local_stack(
                    path,
                    device=config.model.device,
                    admin_token=admin_token,
                    gateway_host=_gateway_host(on_ray),
                    max_batch_size=config.engine.max_batch_size,
                )
            )
            assert urls.local_engine is not None
            gateway = urls.gateway
            weight_sync = InProcessWeightSync(urls.local_engine)
        else:
            assert config.engine.gateway is not None  # the config checks both or neither
            gateway = config.engine.gateway
            admin_token = _token(config.engine.admin_token_var, "[engine] admin_token_var")
            # Every engine behind the gateway gets the weights (the gateway's own list, or the
            # workers behind its router).
            weight_sync = DiskWeightSync(
                engine_urls(config.engine.url),
                config.run_dir / "weights",
                tokenizer_from=path,
                api=config.engine.api,
            )

        env = config.env
        env_token = _token(env.token_var, "[env] token_var")
        agents = None if config.agent is None else agent_serving(config.agent, env.sandbox, gateway)
        sandbox = env.sandbox if agents is None else agents.sandbox
        env_urls: list[str] = []
        # At least the server's default; more with more rollouts in flight (an episode holds
        # its slot while the model thinks, so a smaller cap throttles the whole step).
        capacity = max(DEFAULT_MAX_CONCURRENT_ENVS, config.rollout.concurrency)
        if env.url is not None:
            env_url = env.url
        elif env.processes:
            argv = ["serve", str(env.bundle), "--tool-timeout", str(env.tool_timeout)]
            argv += ["--max-concurrent-envs", str(capacity)]
            if sandbox is not None:
                argv += ["--sandbox", sandbox]
            if env.token_var is not None:
                argv += ["--token-var", env.token_var]
            if agents is not None:
                argv += agents.serve_flags()
            env_url = stack.enter_context(serve_in_process(argv, log=logs / "env.log"))
        elif on_ray:
            # [agent] does not go with [ray] (the config refuses it): these serve no agents.
            from corral.trainer.ray_cluster import start_env_servers

            servers = start_env_servers(
                env.bundle,
                config.ray.env_servers,
                sandbox=env.sandbox,
                token=env_token,
                tool_timeout=env.tool_timeout,
                max_concurrent_envs=capacity,
            )
            for server in servers:
                stack.callback(server.stop)
            env_urls = [server.url for server in servers]
            env_url = env_urls[0]
        else:
            agent_options: dict[str, Any] = (
                {}
                if agents is None
                else {
                    "agent_clis": agents.clis,
                    "agent_gateways": [agents.gateway],
                    "agent_max_timeout_s": agents.max_timeout_s,
                }
            )
            app = build_app(
                env.bundle,
                token=env_token,
                tool_timeout=env.tool_timeout,
                sandbox=sandbox,
                max_concurrent_envs=capacity,
                **agent_options,
            )
            env_url = stack.enter_context(serve_in_thread(app))
        rows_dir = config.run_dir / "rows"
        settings = RowSettings(
            max_turns=env.max_turns,
            tool_timeout=env.tool_timeout,
            model_timeout=env.model_timeout,
            token_var=env.token_var,
        )
        write_rows(env_url, rows_dir, settings, token=env_token)
        rows = read_rows(rows_dir / "all.jsonl")
        train = [r for r in rows if r.metadata.split == env.train_split]
        evals = [r for r in rows if r.metadata.split == env.eval_split]
        if not train:
            raise ServicesError(f"the env server at {env_url} has no {env.train_split!r} rows")
        group_by, groups = task_groups(evals, env_token) if evals else (None, {})
        workers: list[object] = []
        if on_ray:
            from corral.trainer.ray_cluster import start_rollout_workers, token_env

            handles = start_rollout_workers(
                gateway,
                config.ray.rollout_workers,
                admin_token=admin_token,
                sampling=config.rollout.sampling(),
                concurrency=config.rollout.concurrency,
                env=token_env(train),
            )
            for handle in handles:
                stack.callback(handle.stop)
            workers = list(handles)
        yield Services(
            gateway=gateway,
            admin_token=admin_token,
            train_rows=train,
            eval_rows=evals,
            weight_sync=weight_sync,
            model_path=path,
            eval_groups=groups,
            group_by=group_by,
            rollout_workers=workers,
            env_urls=env_urls,
        )
