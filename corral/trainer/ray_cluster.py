"""Ray placement for ``corral train --ray ADDRESS``: env servers, rollout workers and the trainer
as Ray actors and tasks, for a run that spans machines (one machine needs no Ray).

- :func:`connect` joins a Ray cluster (``"local"`` starts a private one, for one machine).
- :func:`start_env_servers` serves a bundle from ``n`` actors spread over the nodes
  (:class:`EnvServerHandle`: its ``url`` is reachable from the other nodes).
- :func:`start_rollout_workers` starts ``n`` actors that each hold a gateway admin client and a
  :class:`~corral.rollouts.player.Player` (:class:`RolloutWorkerHandle`).
- :class:`RayGroupDraw` is the ``draw`` of :func:`~corral.trainer.groups.fill_batch`, like
  :class:`~corral.trainer.rollouts.GroupDraw`, but playing its rows on the rollout workers.
- :func:`run_on_ray` runs a function (the trainer's entry point) as a Ray task placed with the
  CPUs and GPUs it asks for.

Every node runs the same corral (installed, same version): actors and tasks import it there.
Paths handed to actors (a bundle folder) must be readable on the node an actor lands on.
Ray is imported lazily: this module imports without it; using it without Ray raises an
``ImportError`` that says ``pip install 'corral[ray]'``.

What crosses the Ray boundary is plain picklable data: rows (:class:`~corral.rollouts.rows.Row`,
a pydantic model) go to the workers, :class:`PlayedGroup` tuples (a
:class:`~corral.trainer.groups.Group` and the player's
:class:`~corral.rollouts.player.Rollout` objects, sharing their samples) come back.

Nothing here waits forever on a dead or missing part: an actor that cannot be placed within
``start_timeout`` fails the start with the cluster's resources in the message; a rollout worker
that dies during a draw fails the draw with :class:`RolloutWorkerLost` naming it (Ray reports
a dead process at once, a lost node once its health checks time out);
:func:`run_on_ray` refuses resources that no node of the cluster has instead of queueing a task
that can never run.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from corral.envs.settings import ServeSettings
from corral.trainer.groups import Group

if TYPE_CHECKING:
    from types import ModuleType

    from corral.rollouts.player import Player, Rollout
    from corral.rollouts.rows import Row
    from corral.trainer.rollouts import RowSampler

INSTALL_HINT = "pip install 'corral[ray]'"
LOCAL = "local"


def _ray() -> ModuleType:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(f"Ray is not installed: {INSTALL_HINT}") from exc
    return ray


def node_ip() -> str:
    """This node's IP as Ray knows it: the address other nodes of the cluster reach it at."""
    return str(_ray().util.get_node_ip_address())


def connect(address: str, **init_options: Any) -> None:
    """Join the Ray cluster at ``address`` (``"auto"``, ``"ray://host:10001"``, ``host:6379``:
    anything ``ray.init(address=...)`` takes). ``"local"`` starts a private Ray on this machine
    (no dashboard): a one-machine run or a test, with the machine's CPUs unless
    ``init_options`` say otherwise (``num_cpus=2``). ``init_options`` go to ``ray.init``.

    A no-op when this process is connected already (a test that started Ray itself)."""
    ray = _ray()
    if ray.is_initialized():
        return
    if address == LOCAL:
        # address="local" starts a new instance even when RAY_ADDRESS names a cluster.
        ray.init(address=LOCAL, **{"include_dashboard": False, **init_options})
    else:
        ray.init(address=address, **init_options)


# --------------------------------------------------------------------------- placement helpers


def _describe_cluster(ray: ModuleType) -> str:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    parts = []
    for n in nodes:
        res = n.get("Resources", {})
        parts.append(
            f"{n.get('NodeManagerAddress')}: {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU"
        )
    return f"{len(nodes)} node(s) ({'; '.join(parts) or 'none'})"


def _wait_started(
    ray: ModuleType, refs: Sequence[Any], names: Sequence[str], what: str, timeout: float
) -> list[Any]:
    """The answers of the actors' first calls; RuntimeError naming the actor that failed to
    start or the ones the cluster did not place within ``timeout``."""
    _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    if pending:
        late = [names[i] for i, ref in enumerate(refs) if ref in pending]
        raise RuntimeError(
            f"{what} {', '.join(late)} did not start within {timeout:g} s: the Ray cluster has "
            f"no room for them? It has {_describe_cluster(ray)}"
        )
    answers = []
    for name, ref in zip(names, refs, strict=True):
        try:
            answers.append(ray.get(ref))
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"{what} {name} did not start: {_short(exc)}") from exc
    return answers


def _short(exc: BaseException, limit: int = 2000) -> str:
    """``exc``'s message, cut to its last ``limit`` characters (a remote traceback ends with
    what went wrong)."""
    text = str(exc).strip()
    return text if len(text) <= limit else "[...] " + text[-limit:]


def _actor_options(num_cpus: float | None, spread: bool) -> dict[str, Any]:
    options: dict[str, Any] = {"max_restarts": 0}
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    if spread:
        options["scheduling_strategy"] = "SPREAD"
    return options


# --------------------------------------------------------------------------- env servers


# Addresses only this machine reaches: an env server bound to one may go without a token.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


class EnvServerActor:
    """Ray actor (made remote by :func:`start_env_servers`): serves ``settings`` (its bundle
    folder, with :func:`~corral.stack.env_server.env_server_in_thread`) through uvicorn in a
    thread of the actor's process, bound to ``host`` (every interface by default), until
    :meth:`stop`. Its URL names the node's IP (``ray.util.get_node_ip_address``), so other
    nodes reach it. ``token`` is handed over as is: the node's environment is its raylet's,
    not the driver's."""

    def __init__(
        self,
        settings: ServeSettings,
        *,
        token: str | None = None,
        host: str = "0.0.0.0",
        port: int | None = None,
    ) -> None:
        from corral.stack.env_server import env_server_in_thread

        self._stack = contextlib.ExitStack()
        bound = self._stack.enter_context(
            env_server_in_thread(settings, token=token, host=host, port=port)
        )
        self._port = int(bound.rsplit(":", 1)[1])
        self._ip = node_ip() if host in ("0.0.0.0", "::") else host

    def url(self) -> str:
        return f"http://{self._ip}:{self._port}"

    def node_ip(self) -> str:
        return self._ip

    def stop(self) -> None:
        """Shut the server down gracefully: its episodes and sandboxes are torn down (a
        ``ray.kill`` without it leaves sandboxes for the next server's sweep)."""
        self._stack.close()


@dataclass
class EnvServerHandle:
    """An env-server actor on the driver's side: ``url`` (reachable from every node), ``name``
    (for messages), ``node_ip``, and the Ray ``actor``."""

    actor: Any
    name: str
    url: str
    node_ip: str

    def stop(self, timeout: float = 30.0) -> None:
        """Stop serving (gracefully, within ``timeout``) and end the actor; a dead one is
        fine."""
        ray = _ray()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.actor.stop.remote(), timeout=timeout)
        ray.kill(self.actor)


def start_env_servers(
    bundle: str | Path,
    n: int,
    *,
    sandbox: str | None = None,
    token: str | None = None,
    host: str = "0.0.0.0",
    num_cpus: float | None = None,
    spread: bool = True,
    start_timeout: float = 120.0,
    name_prefix: str = "corral-env",
    **app_options: Any,
) -> list[EnvServerHandle]:
    """Start ``n`` env-server actors serving the bundle folder ``bundle`` (a path readable on
    every node; made absolute here), placed with Ray's ``SPREAD`` strategy unless ``spread`` is
    false. ``sandbox``: the backend name each episode runs in (``build_app``'s ``sandbox``);
    ``token``: the bearer token every route but ``/health`` requires (ValueError without one
    unless ``host`` is a loopback address); ``app_options``: more
    :class:`~corral.envs.settings.ServeSettings` fields, the ``build_app`` keywords of the same
    names (``max_concurrent_envs``, ``sandbox_image``, ``warm_sandboxes``, timeouts; a None one
    keeps the server's default; TypeError for another name). ``num_cpus``: each actor's CPUs
    (Ray's actor default: none held).

    Returns once every server listens. RuntimeError naming the server that failed to start
    (a bad bundle, a sandbox backend missing on its node), or the ones not placed within
    ``start_timeout``; the others are stopped then. The actors do not restart: a restarted
    server would listen on another port than the rows name."""
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    if token is None and host not in LOOPBACK_HOSTS:
        # Other nodes reach it by the node's address: without a token, anyone on the network
        # could play (and reset, and read the tasks of) the run's env servers.
        raise ValueError(
            f"env servers listening on {host} need a token: pass token=, or host='127.0.0.1'"
        )
    ray = _ray()
    settings = ServeSettings(bundle=Path(bundle).absolute(), sandbox=sandbox, **app_options)
    remote = ray.remote(EnvServerActor).options(**_actor_options(num_cpus, spread))
    names = [f"{name_prefix}-{i}" for i in range(n)]
    actors = [remote.remote(settings, token=token, host=host) for _ in names]
    try:
        urls = _wait_started(
            ray, [a.url.remote() for a in actors], names, "env server", start_timeout
        )
        ips = ray.get([a.node_ip.remote() for a in actors])
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return [
        EnvServerHandle(actor, name, url, ip)
        for actor, name, url, ip in zip(actors, names, urls, ips, strict=True)
    ]


# --------------------------------------------------------------------------- rollout workers


class PlayedGroup(NamedTuple):
    """One row's outcome from a rollout worker: its :class:`~corral.trainer.groups.Group` and
    the player's rollouts it was built from (timings, turns, messages: the loop's metrics)."""

    group: Group
    rollouts: list[Rollout]


class RolloutWorkerActor:
    """Ray actor (made remote by :func:`start_rollout_workers`): plays rows with a
    :class:`~corral.rollouts.player.Player` on a
    :class:`~corral.gateway.client.GatewayAdmin` of the gateway at ``gateway_url``,
    at most ``concurrency`` rollouts at once over all its calls. ``env``: token variables for
    the rows' env servers, looked up before the worker's own environment (a Ray worker's
    environment is its raylet's, not the driver's)."""

    def __init__(
        self,
        gateway_url: str,
        *,
        name: str,
        admin_token: str | None = None,
        sampling: dict[str, Any] | None = None,
        concurrency: int = 8,
        env: dict[str, str] | None = None,
        model: str = "corral",
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.name = name
        self._gateway_url = gateway_url
        self._admin_token = admin_token
        self._sampling = dict(sampling or {})
        self._concurrency = concurrency
        self._env = {**os.environ, **(env or {})}
        self._model = model
        # Made on the first call, in the actor's event loop (httpx clients and semaphores
        # belong to a loop).
        self._player: Player | None = None
        self._room: asyncio.Semaphore | None = None

    async def ready(self) -> tuple[str, str]:
        """The node's IP and the actor's id (answers once the actor is up)."""
        import ray

        context = ray.get_runtime_context()
        return node_ip(), str(context.get_actor_id())

    def _started(self) -> tuple[Player, asyncio.Semaphore]:
        from corral.gateway.client import GatewayAdmin
        from corral.rollouts.player import Player

        if self._player is None or self._room is None:
            admin = GatewayAdmin(self._gateway_url, self._admin_token)
            self._player = Player(admin, sampling=self._sampling, env=self._env, model=self._model)
            self._room = asyncio.Semaphore(self._concurrency)
        return self._player, self._room

    async def play_groups(
        self,
        rows: list[Row | dict[str, Any]],
        group_indices: list[int],
        rollouts_per_row: int,
        metadata: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> list[PlayedGroup]:
        """Play each row ``rollouts_per_row`` times (rollout ``k`` of row ``i`` with
        ``group_index=group_indices[i]``, ``index=k``, and, with ``seed``, the sampling seed
        :func:`~corral.trainer.rollouts.rollout_seed` gives it), as
        :class:`~corral.trainer.rollouts.GroupDraw` does: one :class:`PlayedGroup` per row, in
        order; every sample's metadata names the worker (``rollout_worker``). Failed rollouts
        come back flagged; a row that cannot be played at all
        (:class:`~corral.rollouts.player.PlayerError`) stops the call, cancelling the rest,
        and that error is raised (the first, if several)."""
        from corral.trainer.rollouts import rollout_seed

        if len(rows) != len(group_indices):
            raise ValueError(f"{len(rows)} rows but {len(group_indices)} group indices")
        player, room = self._started()
        tags = {**(metadata or {}), "rollout_worker": self.name}

        async def one(row: Row | dict[str, Any], group_index: int, index: int) -> Rollout:
            extra: dict[str, Any] = {}
            if seed is not None:
                extra["sampling"] = {"seed": rollout_seed(seed, group_index, index)}
            async with room:
                return await player.play(
                    row, group_index=group_index, index=index, metadata=tags, **extra
                )

        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    [tg.create_task(one(row, g, k)) for k in range(rollouts_per_row)]
                    for row, g in zip(rows, group_indices, strict=True)
                ]
        except BaseExceptionGroup as group:
            first = group.exceptions[0]
            if len(group.exceptions) > 1:
                first.add_note(f"({len(group.exceptions) - 1} more rollouts failed likewise)")
            raise first from None
        played = [[t.result() for t in row_tasks] for row_tasks in tasks]
        return [PlayedGroup(Group.from_player(rollouts), rollouts) for rollouts in played]

    async def close(self) -> None:
        """Close the HTTP clients (the actor stays up)."""
        if self._player is not None:
            await self._player.aclose()
            await self._player.gateway.aclose()
            self._player = self._room = None


@dataclass
class RolloutWorkerHandle:
    """A rollout-worker actor on the driver's side: ``name``, ``node_ip`` and ``actor_id`` (for
    messages) and the Ray ``actor``."""

    actor: Any
    name: str
    node_ip: str
    actor_id: str

    def describe(self) -> str:
        return f"rollout worker {self.name} (Ray actor {self.actor_id}, node {self.node_ip})"

    def stop(self, timeout: float = 30.0) -> None:
        """Close its clients (within ``timeout``) and end the actor; a dead one is fine."""
        ray = _ray()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.actor.close.remote(), timeout=timeout)
        ray.kill(self.actor)


def start_rollout_workers(
    gateway_url: str,
    n: int,
    *,
    admin_token: str | None = None,
    sampling: dict[str, Any] | None = None,
    concurrency: int = 8,
    env: Mapping[str, str] | None = None,
    model: str = "corral",
    num_cpus: float | None = None,
    spread: bool = True,
    start_timeout: float = 120.0,
    name_prefix: str = "corral-rollout",
) -> list[RolloutWorkerHandle]:
    """Start ``n`` rollout-worker actors (:class:`RolloutWorkerActor`) for the gateway at
    ``gateway_url`` (reachable from every node), placed with ``SPREAD`` unless ``spread`` is
    false. ``sampling`` overrides every session's sampling; ``concurrency`` bounds each
    worker's rollouts in flight; ``env`` carries the rows' token variables to the workers
    (:func:`token_env` collects them from the driver's environment).

    Returns once every worker answers; RuntimeError as :func:`start_env_servers`."""
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    ray = _ray()
    remote = ray.remote(RolloutWorkerActor).options(**_actor_options(num_cpus, spread))
    names = [f"{name_prefix}-{i}" for i in range(n)]
    actors = [
        remote.remote(
            gateway_url,
            name=name,
            admin_token=admin_token,
            sampling=dict(sampling or {}),
            concurrency=concurrency,
            env=dict(env or {}),
            model=model,
        )
        for name in names
    ]
    try:
        started = _wait_started(
            ray, [a.ready.remote() for a in actors], names, "rollout worker", start_timeout
        )
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return [
        RolloutWorkerHandle(actor, name, ip, actor_id)
        for actor, name, (ip, actor_id) in zip(actors, names, started, strict=True)
    ]


def token_env(rows: Iterable[Row], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values, in ``environ`` (default: this process's environment), of the token
    variables ``rows`` name: what :func:`start_rollout_workers` needs as ``env``. A variable
    that is not set is left out (the worker's player then refuses the row, saying which)."""
    environ = os.environ if environ is None else environ
    names = sorted({r.metadata.env.token_var for r in rows if r.metadata.env.token_var})
    return {name: environ[name] for name in names if name in environ}


# --------------------------------------------------------------------------- the draw


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed a draw: it died (:class:`RolloutWorkerLost`), did not answer
    within the draw's ``timeout``, or Ray lost its answer. ``worker`` names it. The draw does
    not return a partial batch: what the other workers played is here, ``groups`` and
    ``played`` (the caller may use or drop it), and ``unplayed`` holds the rows of the failed
    workers (the row sampler has moved past them)."""

    def __init__(
        self,
        message: str,
        *,
        worker: str,
        groups: list[Group],
        played: list[Rollout],
        unplayed: list[Row],
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.groups = groups
        self.played = played
        self.unplayed = unplayed


class RolloutWorkerLost(RolloutWorkerError):
    """A rollout worker's actor died (its process or node is gone); the draw removed it from
    its workers."""


@dataclass
class _Call:
    worker: RolloutWorkerHandle
    positions: list[int]
    ref: Any
    result: list[PlayedGroup] | None = None
    error: BaseException | None = None


class RayGroupDraw:
    """``draw(n)`` for :func:`~corral.trainer.groups.fill_batch`, the Ray counterpart of
    :class:`~corral.trainer.rollouts.GroupDraw`: the same rows (``rows``, the driver's sampler,
    so a resumed run restores it), the same group numbering (``next_group_index``: the next
    group's index, a plain int the loop saves and restores), the same per-rollout seeds with
    ``seed``, the same ``played``/:meth:`take_played` for metrics, and groups in row order.

    The ``n`` rows of a draw are dealt round-robin over ``workers`` (continuing where the last
    draw stopped), one ``play_groups`` call per worker, all awaited concurrently. ``env_urls``:
    env servers to spread the rows over (row of group ``g`` plays on ``env_urls[g % len]``,
    whatever server its row names; all must serve the same bundle).

    Failures: a worker whose actor dies fails the draw with :class:`RolloutWorkerLost` naming
    it, after every other worker's call has finished; their groups ride on the error, not in
    ``played``, and the dead worker leaves ``workers`` (a caller that catches it can go on
    with the rest; with none left, a draw raises :class:`RolloutWorkerError`). A worker that
    does not answer within ``timeout`` seconds (``None``: no limit; the player's own deadlines
    still apply) has its call cancelled and fails the draw the same way, staying in
    ``workers``. An error raised by the play itself (a row that cannot be played:
    :class:`~corral.rollouts.player.PlayerError`) is re-raised as that error type with a note
    naming the worker (and one per worker that failed in the same draw; a dead one still
    leaves ``workers``), and the other workers' groups are dropped, as ``GroupDraw`` drops a
    failing row's siblings: it is a configuration problem that stops the run. A cancelled
    draw cancels its calls."""

    def __init__(
        self,
        workers: Sequence[RolloutWorkerHandle],
        rows: RowSampler,
        *,
        rollouts_per_row: int,
        metadata: dict[str, Any] | None = None,
        seed: int | None = None,
        next_group_index: int = 0,
        timeout: float | None = None,
        env_urls: Sequence[str] = (),
    ) -> None:
        if rollouts_per_row < 1:
            raise ValueError("rollouts_per_row must be at least 1")
        if not workers:
            raise ValueError("a RayGroupDraw needs at least one rollout worker")
        self.workers = list(workers)
        self.rows = rows
        self.rollouts_per_row = rollouts_per_row
        self.metadata = dict(metadata or {})
        self.seed = seed
        self.next_group_index = next_group_index
        self.timeout = timeout
        self.env_urls = list(env_urls)
        self.played: list[Rollout] = []  # every rollout since the last take_played()
        self._next_worker = 0

    def take_played(self) -> list[Rollout]:
        """The rollouts played since the last call (for a step's metrics), and forget them."""
        played, self.played = self.played, []
        return played

    def _row_for(self, row: Row, group_index: int) -> Row:
        if not self.env_urls:
            return row
        url = self.env_urls[group_index % len(self.env_urls)]
        env = row.metadata.env.model_copy(update={"url": url})
        return row.model_copy(update={"metadata": row.metadata.model_copy(update={"env": env})})

    async def __call__(self, n: int) -> list[Group]:
        ray = _ray()
        if not self.workers:
            raise RolloutWorkerError(
                "no rollout worker is left to play rows", worker="", groups=[], played=[],
                unplayed=[],
            )  # fmt: skip
        rows = self.rows.take(n)
        if not rows:
            return []
        first = self.next_group_index
        indices = list(range(first, first + len(rows)))
        self.next_group_index += len(rows)
        dealt: dict[int, list[int]] = {}
        for i in range(len(rows)):
            dealt.setdefault((self._next_worker + i) % len(self.workers), []).append(i)
        self._next_worker = (self._next_worker + len(rows)) % len(self.workers)
        calls = [
            _Call(
                self.workers[w],
                positions,
                self.workers[w].actor.play_groups.remote(
                    [self._row_for(rows[i], indices[i]) for i in positions],
                    [indices[i] for i in positions],
                    self.rollouts_per_row,
                    self.metadata,
                    self.seed,
                ),
            )
            for w, positions in dealt.items()
        ]
        try:
            await asyncio.gather(*(self._settle(ray, call) for call in calls))
        except BaseException:  # cancelled: nothing more is waited for
            for call in calls:
                with contextlib.suppress(Exception):
                    ray.cancel(call.ref)
            raise
        return self._collect(ray, rows, calls)

    async def _settle(self, ray: ModuleType, call: _Call) -> None:
        """Wait for ``call``; its outcome is its groups or the exception (never raised here)."""

        async def answer() -> list[PlayedGroup]:
            result: list[PlayedGroup] = await call.ref
            return result

        try:
            call.result = await asyncio.wait_for(answer(), self.timeout)
        except TimeoutError as exc:
            with contextlib.suppress(Exception):
                ray.cancel(call.ref)
            call.error = exc
        except Exception as exc:
            call.error = exc

    def _collect(self, ray: ModuleType, rows: list[Row], calls: list[_Call]) -> list[Group]:
        by_position: dict[int, PlayedGroup] = {}
        for call in calls:
            if call.result is not None:
                by_position.update(zip(call.positions, call.result, strict=True))
        failed = [call for call in calls if call.result is None]
        if not failed:
            done = [by_position[i] for i in range(len(rows))]
            self.played.extend(r for played in done for r in played.rollouts)
            return [played.group for played in done]

        # Workers that died, hung or lost their answer: named, and the dead ones dropped.
        lines: list[str] = []
        lost = False
        play_errors: list[tuple[_Call, BaseException]] = []
        for call in failed:
            exc = call.error
            assert exc is not None
            if isinstance(exc, ray.exceptions.RayTaskError):  # the play raised: handled below
                play_errors.append((call, exc))
            elif isinstance(exc, ray.exceptions.ActorDiedError):
                lost = True
                with contextlib.suppress(ValueError):
                    self.workers.remove(call.worker)
                lines.append(f"{call.worker.describe()} died: {_short(exc, 600)}")
            elif isinstance(exc, TimeoutError):
                lines.append(
                    f"{call.worker.describe()} did not answer within {self.timeout:g} s "
                    "(its call was cancelled)"
                )
            else:
                lines.append(
                    f"{call.worker.describe()} failed: {type(exc).__name__}: {_short(exc, 600)}"
                )
        if play_errors:
            # Ray raises it as an instance of the play's own type (a PlayerError stays one).
            call, exc = play_errors[0]
            exc.add_note(f"raised on {call.worker.describe()}")
            for line in lines:
                exc.add_note(f"in the same draw, {line}")
            raise exc
        kept = [by_position[i] for i in sorted(by_position)]
        groups = [p.group for p in kept]
        played = [r for p in kept for r in p.rollouts]
        unplayed = [rows[i] for call in failed for i in call.positions]
        names = ", ".join(call.worker.name for call in failed)
        message = (
            f"the draw of {len(rows)} rows failed on {names}: " + "; ".join(lines)
            + f". {len(groups)} groups played by the other workers are on this error (.groups); "
            f"{len(unplayed)} rows were not played (.unplayed)"
        )  # fmt: skip
        kind = RolloutWorkerLost if lost else RolloutWorkerError
        raise kind(message, worker=names, groups=groups, played=played, unplayed=unplayed)


# --------------------------------------------------------------------------- the trainer


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        return asyncio.run(_awaited(result))
    return result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _check_placeable(ray: ModuleType, num_cpus: float, num_gpus: float) -> None:
    for node in ray.nodes():
        res = node.get("Resources", {})
        if node.get("Alive") and res.get("CPU", 0) >= num_cpus and res.get("GPU", 0) >= num_gpus:
            return
    raise RuntimeError(
        f"no node of the Ray cluster has {num_cpus:g} CPU and {num_gpus:g} GPU for the task; "
        f"it has {_describe_cluster(ray)}"
    )


def run_on_ray(
    fn: Callable[..., Any], *args: Any, num_gpus: float = 0, num_cpus: float = 1, **kwargs: Any
) -> Any:
    """Run ``fn(*args, **kwargs)`` as a Ray task holding ``num_cpus`` CPUs and ``num_gpus`` GPUs
    of one node (the trainer's entry point, on a GPU node), wait for it and return its value
    (``fn`` may be a coroutine function: it is run in an event loop of its own there).

    ``fn`` and its arguments are pickled (cloudpickle): a module-level function of an installed
    module travels by name; actor handles (workers, env servers) may be passed. The task is not
    retried. ``fn``'s exception is raised here, as an instance of its own type (Ray's
    ``RayTaskError`` subclass of it) carrying the remote traceback. RuntimeError at once, not a
    task queued forever, when no live node has that many CPUs and GPUs (on an autoscaling
    cluster, start the node first). Blocks the calling thread."""
    ray = _ray()
    _check_placeable(ray, num_cpus, num_gpus)
    task = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_retries=0)(_call)
    return ray.get(task.remote(fn, args, kwargs))
