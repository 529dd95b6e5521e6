"""Where a bundle's env code runs: in the server's process, or in a sandbox per episode.

An :class:`EnvHost` starts one :class:`EnvHandle` per episode; the server talks to every env
through that handle, the same way wherever the env runs. :func:`env_host` picks the host a
bundle is served with.

- :class:`InProcessHost`: the env object lives in the server process and its methods run in
  worker threads. No isolation; a call past its deadline is abandoned but its thread runs on.
- :class:`SandboxHost`: each episode gets a sandbox from a provider (bwrap, docker,
  kubernetes, e2b, or local for development), and inside it a runner process
  (:mod:`corral.envs.runner`) that holds the env and answers the server over stdin/stdout.
  Closing the handle kills the runner and removes the sandbox, so a call past its deadline
  really stops. The verifier never runs there: the server grades the state the env reports,
  in its own process, where the model's actions cannot reach it.

What goes into a sandbox (the *payload*, :func:`build_payload`): only the bundle's env side
(:meth:`Bundle.payload_files`: the declared ``[env] modules``, or the env module and the bundle
modules it imports) under ``bundle/``, and the standard-library modules the runner needs
(:data:`RUNNER_MODULES`) under an otherwise empty ``corral`` package. No verifier, solver,
baselines, generator or task file enters, so a model command in the sandbox finds no code that
computes an answer. The payload's folders and files are owner-only (0700 / 0600): where model
commands run under another uid than the runner, they cannot read even the env's code. Backends
that mount host folders (bwrap, docker) get it as a read-only bind at :data:`CODE_ROOT`; the
others (kubernetes, e2b) get it uploaded into :data:`UPLOAD_ROOT` of each sandbox, where the
sandbox's own processes could change it.

What the env sees of a task: :meth:`Bundle.env_task` (the ``[env] task_data`` view, computed
in the server's process), never the task's own ``data`` when the bundle declares a view. The
handles apply it in their ``reset``, the one place every episode's task passes through on its
way to the env, in-process or sandboxed alike.

The runner's environment carries ``CORRAL_MODEL_JAIL`` (:mod:`corral.envs.model_actions`): the
provider's prefix for the commands an env runs on the model's behalf.

Black-box agents (:meth:`EnvHandle.run_agent`, :mod:`corral.envs.agent_bridge`) run only in a
sandbox: the in-process handle refuses them (:class:`AgentUnsupported`). A
:class:`SandboxHost` given the operator's agent CLIs (an npm install, :mod:`corral.envs.agent_clis`)
binds that folder read-only at :data:`~corral.envs.agent_bridge.AGENT_CLIS_ROOT` and a folder
of links (``claude``, ``codex``) at :data:`~corral.envs.agent_bridge.AGENT_BIN_ROOT`, first on
the agent's ``PATH``, in every sandbox of a backend that mounts host folders (bwrap, docker);
under ``local`` (no isolation) the links point at the host's paths and their folder goes on
``PATH`` as it is; kubernetes and e2b get neither (only ``command`` agents, which bring their
own files, run there).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from corral.envs.agent_bridge import (
    AGENT_BIN_ROOT,
    AGENT_CLIS_ROOT,
    AgentPolicy,
    run_agent,
)
from corral.envs.agent_clis import find_agent_clis, write_links
from corral.envs.bundle import Bundle, TaskDataError
from corral.envs.episode import END_TURN_TOOL, Env, Task, ToolOutcome
from corral.envs.model_actions import JAIL_VARIABLE
from corral.envs.protocol import AgentLaunch, AgentRun
from corral.sandboxes.base import (
    RUNNER_ROOT,
    Bind,
    NetworkPolicy,
    Sandbox,
    SandboxError,
    SandboxProcess,
    SandboxProvider,
    SandboxSpec,
)
from corral.sandboxes.pool import WarmPool
from corral.sandboxes.providers import make_provider

log = logging.getLogger(__name__)

CODE_ROOT = RUNNER_ROOT  # where the payload is bound; the bwrap jail covers it
UPLOAD_ROOT = "/tmp/.corral-env"
# corral's modules a sandbox needs (standard library only), from corral/envs.
RUNNER_MODULES = (
    "agent_launcher.py",
    "episode.py",
    "importing.py",
    "model_actions.py",
    "runner.py",
)
_DIR_MODE, _FILE_MODE = 0o700, 0o600


class EnvFailure(Exception):
    """The env failed (its code raised, its process or sandbox went away); the message says
    which and why. The episode cannot go on."""


class AgentUnsupported(Exception):
    """This handle cannot run a black-box agent (its env has no sandbox); nothing was
    started and the episode goes on."""


class EnvHandle(Protocol):
    """One episode's env, wherever it runs. Every method but :meth:`close` may raise
    :class:`EnvFailure`; none is called concurrently with another."""

    has_end_turn: bool

    async def reset(self, task: Task) -> str: ...

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome: ...

    async def end_turn(self, arguments: dict[str, Any]) -> ToolOutcome: ...

    async def state(self) -> dict[str, Any]: ...

    async def run_agent(self, launch: AgentLaunch) -> AgentRun:
        """Run a black-box agent in the env's sandbox, in the task's working folder, until it
        exits or its budget runs out (:func:`corral.envs.agent_bridge.run_agent`). Raises
        :class:`AgentUnsupported` (no sandbox), :class:`~corral.envs.agent_bridge.AgentRefused`
        (the launch breaks the server's policy; nothing started) or :class:`EnvFailure` (the
        sandbox failed under it)."""
        ...

    async def close(self) -> None:
        """Release the env (kill its process, remove its sandbox). Idempotent; never raises;
        finishes even when the caller is cancelled."""
        ...


class EnvHost(Protocol):
    """Starts envs for one bundle. :meth:`open` before the first :meth:`start`,
    :meth:`aclose` at shutdown."""

    description: str

    async def open(self) -> None: ...

    async def start(self) -> EnvHandle:
        """A ready env; :class:`EnvFailure` if it cannot start (nothing is left behind, also
        when the caller is cancelled)."""
        ...

    async def aclose(self) -> None: ...


def _fail(exc: BaseException) -> EnvFailure:
    return EnvFailure(f"the env raised {type(exc).__name__}: {exc}")


def _outcome(value: Any) -> ToolOutcome:
    """``value`` as the ToolOutcome the server reads, its fields as their types (as the
    runner sends them); EnvFailure when the env returned something else."""
    if not isinstance(value, ToolOutcome):
        raise EnvFailure(f"the env returned {type(value).__name__}, not a ToolOutcome")
    return ToolOutcome(str(value.content), done=bool(value.done), error=bool(value.error))


def _state(value: Any) -> dict[str, Any]:
    """``value`` as the env's state; EnvFailure when it is not a JSON object (its size and
    content the episode checks against ``max_state_bytes``)."""
    if not isinstance(value, dict):
        raise EnvFailure(f"the env's state is {type(value).__name__}, not an object")
    return value


TaskView = Callable[[Task], Task]


async def _env_task(view: TaskView, task: Task) -> Task:
    """``view(task)`` in a worker thread (a view may build files); EnvFailure if it fails."""
    try:
        return await asyncio.to_thread(view, task)
    except TaskDataError as exc:
        raise EnvFailure(str(exc)) from exc


class InProcessEnv:
    """An env object in the server's process; its methods run in worker threads."""

    def __init__(self, env: Env, view: TaskView | None = None) -> None:
        self.env = env
        self.view = view
        self.has_end_turn = callable(getattr(env, END_TURN_TOOL, None))

    async def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:
            raise _fail(exc) from exc

    async def reset(self, task: Task) -> str:
        """Reset the env on ``task`` as ``view`` shows it (the bundle's env view)."""
        if self.view is not None:
            task = await _env_task(self.view, task)
        return str(await self._call(self.env.reset, task))

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        return _outcome(await self._call(self.env.call_tool, name, arguments))

    async def end_turn(self, arguments: dict[str, Any]) -> ToolOutcome:
        return _outcome(await self._call(getattr(self.env, END_TURN_TOOL), arguments))

    async def state(self) -> dict[str, Any]:
        return _state(await self._call(self.env.state))

    async def run_agent(self, launch: AgentLaunch) -> AgentRun:
        """Refused: an agent runs commands, which only a sandbox may hold."""
        raise AgentUnsupported(
            "a black-box agent needs a sandbox, and this server runs the env in its own "
            "process: serve the bundle with --sandbox (bwrap or docker)"
        )

    async def close(self) -> None:
        return None


class InProcessHost:
    """Envs as objects in the server's process (bundles whose ``[sandbox] needs = "none"``)."""

    description = "in-process (no sandbox)"

    def __init__(self, bundle: Bundle) -> None:
        self.bundle = bundle

    async def open(self) -> None:
        return None

    async def start(self) -> EnvHandle:
        try:
            env = await asyncio.to_thread(self.bundle.make_env)
            return InProcessEnv(env, self.bundle.env_task)
        except Exception as exc:
            raise _fail(exc) from exc

    async def aclose(self) -> None:
        return None


class SandboxedEnv:
    """An env held by a runner process in a sandbox (protocol in :mod:`corral.envs.runner`)."""

    def __init__(
        self,
        sandbox: Sandbox,
        process: SandboxProcess,
        view: TaskView | None = None,
        agents: AgentSetup | None = None,
    ) -> None:
        self.sandbox = sandbox
        self.process = process
        self.view = view
        self.agents = agents
        self.has_end_turn = False
        self._closing: asyncio.Future[None] | None = None

    async def request(self, op: str, **fields: Any) -> Any:
        """Send one request and return its answer's ``ok`` value; :class:`EnvFailure` for an
        error answer, a process or sandbox that went away, or an answer that is not JSON."""
        line = json.dumps({"op": op, **fields}, separators=(",", ":")).encode() + b"\n"
        try:
            await self.process.write(line)
            raw = await self.process.readline()
        except SandboxError as exc:
            raise await self._gone(str(exc)) from exc
        if not raw:
            raise await self._gone("its output closed")
        try:
            answer = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise EnvFailure(f"the env's runner sent a line that is not JSON: {exc}") from exc
        if "error" in answer:
            err = answer["error"]
            where = f" ({err['where']})" if err.get("where") else ""
            raise EnvFailure(f"the env raised {err.get('type')}: {err.get('message')}{where}")
        return answer.get("ok")

    async def _gone(self, detail: str) -> EnvFailure:
        alive = await self.sandbox.is_alive()
        where = "its process ended" if alive else f"its sandbox {self.sandbox.id} is gone"
        return EnvFailure(f"the env stopped answering: {where} ({detail}){self._stderr()}")

    def _stderr(self) -> str:
        tail = self.process.stderr_tail().strip()
        return f"; its stderr ends: {tail[-1500:]}" if tail else ""

    async def reset(self, task: Task) -> str:
        """Reset the env on ``task`` as ``view`` shows it: only that view crosses into the
        sandbox (hidden task data stays in the server's process)."""
        if self.view is not None:
            task = await _env_task(self.view, task)
        return str(await self.request("reset", task=task.to_json()))

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        return ToolOutcome(**await self.request("call_tool", name=name, arguments=arguments))

    async def end_turn(self, arguments: dict[str, Any]) -> ToolOutcome:
        return ToolOutcome(**await self.request("end_turn", arguments=arguments))

    async def state(self) -> dict[str, Any]:
        return _state(await self.request("state"))

    async def run_agent(self, launch: AgentLaunch) -> AgentRun:
        """The agent in this env's sandbox, as the host's :class:`AgentSetup` says; a
        sandbox that fails under it is an :class:`EnvFailure`."""
        if self.agents is None:
            raise AgentUnsupported("this env's host runs no agents")
        setup = self.agents
        if setup.refusal is not None:
            raise AgentUnsupported(setup.refusal)
        try:
            return await run_agent(
                self.sandbox,
                launch,
                python=setup.python,
                code_root=setup.code_root,
                jail=setup.jail,
                workdir=setup.workdir,
                policy=setup.policy,
            )
        except SandboxError as exc:
            gone = "" if await self.sandbox.is_alive() else f" (sandbox {self.sandbox.id} is gone)"
            raise EnvFailure(f"{exc}{gone}") from exc

    async def close(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._teardown())
        with contextlib.suppress(Exception):
            await asyncio.shield(self._closing)

    async def _teardown(self) -> None:
        try:
            await self.process.kill()
        finally:
            try:
                await self.sandbox.close()
            except Exception as exc:  # logged: a sweep removes what a failed close leaves
                log.warning("closing sandbox %s failed: %s", self.sandbox.id, exc)


@dataclass(frozen=True)
class AgentSetup:
    """How a sandboxed env's handle runs agents (:func:`corral.envs.agent_bridge.run_agent`'s
    arguments but the sandbox and the launch): the host's interpreter, payload root and model
    jail, the task's working folder, and the server's policy."""

    python: str
    code_root: str
    jail: tuple[str, ...]
    workdir: str
    policy: AgentPolicy
    refusal: str | None = None  # set: why agents are not run in these sandboxes


def build_payload(bundle: Bundle, into: Path) -> Path:
    """Write the payload (module docstring) under ``into`` (which must not hold one yet);
    return its root. Every folder is 0700 and every file 0600, whatever the umask."""
    root = into / "payload"
    here = Path(__file__).resolve().parent
    files: dict[str, Path] = {"corral/__init__.py": Path(os.devnull)}
    files["corral/envs/__init__.py"] = Path(os.devnull)
    files.update({f"corral/envs/{name}": here / name for name in RUNNER_MODULES})
    files.update({f"bundle/{rel}": bundle.root / rel for rel in bundle.payload_files()})
    into.mkdir(parents=True, exist_ok=True)
    _private_dir(root)
    _private_dir(root / "bundle")  # the runner's bundle folder, even for an env of one module
    for rel, source in files.items():
        target = root / rel
        for folder in reversed(target.relative_to(root).parents[:-1]):
            _private_dir(root / folder)
        # Created owner-only from the start: never readable by others, not even for a moment.
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
        with os.fdopen(fd, "wb") as out:
            out.write(source.read_bytes())
        os.chmod(target, _FILE_MODE)  # the umask may have taken bits off; none may be added
    return root


def _private_dir(path: Path) -> None:
    if not path.is_dir():
        path.mkdir(mode=_DIR_MODE)
    os.chmod(path, _DIR_MODE)


class SandboxHost:
    """One sandbox per episode from ``provider`` (module docstring). ``warm``: keep that many
    sandboxes started ahead (a :class:`~corral.sandboxes.pool.WarmPool`). ``python``: the
    interpreter inside; ``upload_root``: where the payload goes in backends without binds.
    ``agent_clis``: the operator's npm install of the agent CLIs, handed to every sandbox
    (module docstring; ``ValueError`` when it is not a folder); ``agent_policy``: what agents
    may do (default :class:`~corral.envs.agent_bridge.AgentPolicy`'s; its ``path_dirs`` are
    set here). :meth:`open` sweeps what a crashed earlier server left, then fills the pool."""

    def __init__(
        self,
        bundle: Bundle,
        provider: SandboxProvider,
        spec: SandboxSpec,
        *,
        warm: int = 0,
        python: str = "python3",
        upload_root: str = UPLOAD_ROOT,
        agent_clis: Path | None = None,
        agent_policy: AgentPolicy | None = None,
    ) -> None:
        self.bundle = bundle
        self.provider = provider
        self.python = python
        self.warm = warm
        self.description = f"sandbox {provider.name}" + (
            "" if provider.isolated else " (NO isolation)"
        )
        self._tmp = Path(tempfile.mkdtemp(prefix="corral-payload-"))
        # The links to the agent CLIs: a folder of its own, since the payload's is owner-only
        # and the model's user (another uid under local as root, or docker) must list it.
        self._links_tmp: Path | None = None
        self.payload = build_payload(bundle, self._tmp)
        self._files = [p for p in sorted(self.payload.rglob("*")) if p.is_file()]
        if not provider.isolated:
            self.code_root, self._upload = str(self.payload), False
        elif provider.host_binds:
            bind = Bind(source=self.payload, target=CODE_ROOT)
            spec = spec.model_copy(update={"binds": (*spec.binds, bind)})
            self.code_root, self._upload = CODE_ROOT, False
        else:
            self.code_root, self._upload = upload_root, True
        policy = agent_policy or AgentPolicy()
        if agent_clis is not None:
            try:
                spec, policy = self._hand_over_clis(agent_clis, spec, policy)
            except BaseException:
                self._remove_tmp()
                raise
        self.spec = spec
        jail = tuple(provider.model_jail(spec))
        self._jail = json.dumps(list(jail))
        refusal = None
        if provider.isolated and spec.network.mode != "none":
            # bwrap's "loopback" and docker's host networking share the host's network
            # namespace: the agent would reach every host port directly, past the bridge.
            refusal = (
                f"this bundle's sandboxes have network {spec.network.mode!r}: an agent there "
                "would reach the host's network directly, past its bridge to the gateway; "
                "agents run only in sandboxes with network 'none'"
            )
        self.agents = AgentSetup(
            python=python,
            code_root=self.code_root,
            jail=jail,
            workdir=spec.workdir,
            policy=policy,
            refusal=refusal,
        )
        self._pool: WarmPool | None = WarmPool(provider, spec, warm) if warm > 0 else None

    def _hand_over_clis(
        self, folder: Path, spec: SandboxSpec, policy: AgentPolicy
    ) -> tuple[SandboxSpec, AgentPolicy]:
        """``spec`` and ``policy`` with the CLIs in ``folder`` reachable by agents (module
        docstring)."""
        folder = folder.resolve()
        clis = find_agent_clis(folder)
        if not clis.named():
            log.warning("no agent CLI found in %s: only command agents can run", folder)
        if not self.provider.isolated:  # the sandbox sees the host's own paths
            links = write_links(clis, self._links_folder(), str(folder))
            return spec, dataclasses.replace(policy, path_dirs=(str(links),))
        if not self.provider.host_binds:
            log.warning(
                "sandbox %s mounts no host folder: the agent CLIs in %s are not handed to its "
                "sandboxes (only command agents can run)",
                self.provider.name,
                folder,
            )
            return spec, policy
        links = write_links(clis, self._links_folder(), AGENT_CLIS_ROOT)
        binds = (
            Bind(source=folder, target=AGENT_CLIS_ROOT),
            Bind(source=links, target=AGENT_BIN_ROOT),
        )
        spec = spec.model_copy(update={"binds": (*spec.binds, *binds)})
        return spec, dataclasses.replace(policy, path_dirs=(AGENT_BIN_ROOT,))

    def _links_folder(self) -> Path:
        """A fresh, not yet existing folder for the links, inside a 0755 temporary folder."""
        self._links_tmp = Path(tempfile.mkdtemp(prefix="corral-agent-bin-"))
        os.chmod(self._links_tmp, 0o755)
        return self._links_tmp / "bin"

    def _remove_tmp(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)
        if self._links_tmp is not None:
            shutil.rmtree(self._links_tmp, ignore_errors=True)

    async def open(self) -> None:
        swept = await self.provider.sweep()
        if swept:
            log.warning("swept %d sandbox(es) left by a dead server: %s", len(swept), swept)
        if self._pool is not None:
            await self._pool.start(wait=False)

    async def _sandbox(self) -> Sandbox:
        if self._pool is not None:
            return await self._pool.acquire()
        return await self.provider.create(self.spec)

    async def start(self) -> EnvHandle:
        try:
            sandbox = await self._sandbox()
        except SandboxError as exc:
            raise EnvFailure(f"no sandbox for the env: {exc}") from exc
        env: SandboxedEnv | None = None
        try:
            if self._upload:
                for path in self._files:
                    rel = path.relative_to(self.payload).as_posix()
                    await sandbox.write_file(f"{self.code_root}/{rel}", path.read_bytes())
            manifest = self.bundle.manifest
            process = await sandbox.spawn(
                [
                    self.python,
                    "-m",
                    "corral.envs.runner",
                    f"{self.code_root}/bundle",
                    manifest.env.module,
                    manifest.env.class_name,
                    manifest.name,
                ],
                env={
                    "PYTHONPATH": self.code_root,
                    "PYTHONDONTWRITEBYTECODE": "1",
                    JAIL_VARIABLE: self._jail,
                },
            )
            env = SandboxedEnv(sandbox, process, self.bundle.env_task, self.agents)
            started = await env.request("start")
            env.has_end_turn = bool(started.get("end_turn"))
            return env
        except BaseException as exc:
            await (env.close() if env is not None else _close_quietly(sandbox))
            if isinstance(exc, SandboxError):
                raise EnvFailure(f"the env could not start in {sandbox.id}: {exc}") from exc
            raise

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
        self._remove_tmp()


def env_host(
    bundle: Bundle,
    sandbox: str | SandboxProvider | None,
    *,
    image: str | None = None,
    warm: int = 0,
    agent_clis: Path | None = None,
    agent_policy: AgentPolicy | None = None,
) -> EnvHost:
    """Where ``bundle``'s envs run: ``sandbox=None`` in this process (:class:`InProcessHost`;
    ``ValueError`` for a bundle whose ``[sandbox] needs`` is not ``"none"``), else a
    :class:`SandboxHost` on that provider (or backend name, made with ``image`` or the bundle's
    own) with the bundle's ``[sandbox]`` limits, ``warm`` sandboxes started ahead and the agent
    options (in-process envs run no agents, so these are unused there)."""
    needs = bundle.manifest.sandbox
    if sandbox is None:
        if needs.needs != "none":
            raise ValueError(
                f"bundle {bundle.name!r} needs a sandbox ([sandbox] needs = {needs.needs!r}): "
                "serve it with --sandbox bwrap or docker (kubernetes and e2b where configured; "
                "local for development only, with no isolation)"
            )
        return InProcessHost(bundle)
    if isinstance(sandbox, str):
        sandbox = make_provider(sandbox, f"serve-{bundle.name}", image=image or needs.image)
    spec = SandboxSpec(
        workdir="/work",
        memory_mb=needs.memory_mb,
        cpus=needs.cpus,
        pids=needs.pids,
        disk_mb=needs.disk_mb,
        network=NetworkPolicy(mode=needs.network),
        labels={"corral.bundle": bundle.name},
    )
    return SandboxHost(
        bundle, sandbox, spec, warm=warm, agent_clis=agent_clis, agent_policy=agent_policy
    )


async def _close_quietly(sandbox: Sandbox) -> None:
    try:
        await sandbox.close()
    except Exception as exc:
        log.warning("closing sandbox %s failed: %s", sandbox.id, exc)
