"""The services a training run talks to, started here or found where the config points.

:func:`run_services` yields the :class:`~corral.trainer.loop.Services` of a
:class:`~corral.trainer.config.TrainConfig`:

- the engine side: without ``[engine] url``, the local engine and a gateway in this process on
  127.0.0.1 (weights pushed in memory); with it, the given gateway and SGLang engines (weights
  through ``<run>/weights`` and ``update_weights_from_disk``);
- the env side: without ``[env] url``, the bundle served in this process (episodes in
  ``[env] sandbox`` sandboxes); with it, that server. Either way the rows are written from the
  server's task API into ``<run>/rows`` and read back per split.

Everything started here stops when the block exits.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from corral.adapters.evals import task_groups
from corral.adapters.rows import RowSettings, read_rows, write_rows
from corral.trainer.config import SftConfig, TrainConfig
from corral.trainer.loop import Services
from corral.trainer.weights import DiskWeightSync, InProcessWeightSync, WeightSync


class ServicesError(RuntimeError):
    """A service the config names cannot be used (unset token variable, no rows, ...)."""


def model_path(config: TrainConfig | SftConfig) -> Path:
    """The policy's Hugging Face folder: the configured one, or the cached tiny model."""
    if config.model.path is not None:
        return config.model.path
    from corral.engines.tiny_model import cached_tiny_model

    return cached_tiny_model()


def _token(var: str | None, what: str) -> str | None:
    if var is None:
        return None
    value = os.environ.get(var)
    if not value:
        raise ServicesError(f"{what}: environment variable {var} is not set")
    return value


@contextmanager
def run_services(config: TrainConfig) -> Iterator[Services]:
    """Start or find the run's services (module docstring). ServicesError for a missing token
    or a split without rows; the env server's and the engines' own errors propagate."""
    from corral.serving import serve_in_thread
    from corral.stack import local_stack

    path = model_path(config)
    on_ray = config.ray.address is not None
    with ExitStack() as stack:
        weight_sync: WeightSync
        if config.engine.url is None:
            # On Ray the rollout workers may run on other nodes: the gateway listens on this
            # node's address, not on loopback.
            if on_ray:
                from corral.trainer.ray_cluster import node_ip

                host = node_ip()
            else:
                host = "127.0.0.1"
            urls = stack.enter_context(
                local_stack(
                    path,
                    device=config.model.device,
                    gateway_host=host,
                    max_batch_size=config.engine.max_batch_size,
                )
            )
            assert urls.local_engine is not None
            gateway, admin_token = urls.gateway, None
            weight_sync = InProcessWeightSync(urls.local_engine)
        else:
            assert config.engine.gateway is not None  # the config checks both or neither
            gateway = config.engine.gateway
            admin_token = _token(config.engine.admin_token_var, "[engine] admin_token_var")
            engines = [u.strip() for u in config.engine.url.split(",") if u.strip()]
            weight_sync = DiskWeightSync(engines, config.run_dir / "weights", tokenizer_from=path)

        env = config.env
        env_token = _token(env.token_var, "[env] token_var")
        env_urls: list[str] = []
        if env.url is not None:
            env_url = env.url
        elif on_ray:
            from corral.trainer.ray_cluster import start_env_servers

            servers = start_env_servers(
                env.bundle,
                config.ray.env_servers,
                sandbox=env.sandbox,
                token=env_token,
                tool_timeout=env.tool_timeout,
            )
            for server in servers:
                stack.callback(server.stop)
            env_urls = [server.url for server in servers]
            env_url = env_urls[0]
        else:
            from corral.envs.server import build_app

            app = build_app(
                env.bundle, token=env_token, tool_timeout=env.tool_timeout, sandbox=env.sandbox
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
