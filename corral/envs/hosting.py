"""Where a bundle's env code runs: in the server's process, or in a sandbox per episode.

An :class:`EnvHost` starts one :class:`EnvHandle` per episode; the server talks to every env
through that handle, the same way wherever the env runs.

- :class:`InProcessHost`: the env object lives in the server process and its methods run in
  worker threads. No isolation; a call past its deadline is abandoned but its thread runs on.
- :class:`SandboxHost`: each episode gets a sandbox from a provider (bwrap, docker,
  kubernetes, e2b, or local for development), and inside it a runner process
  (:mod:`corral.envs.runner`) that holds the env and answers the server over stdin/stdout.
  Closing the handle kills the runner and removes the sandbox, so a call past its deadline
  really stops. The verifier never runs there: the server grades the state the env reports,
  in its own process, where the model's actions cannot reach it.

What goes into a sandbox (the *payload*): the bundle folder without its task files, and the
three standard-library modules the runner needs (``episode``, ``importing``, ``runner``) under
an otherwise empty ``corral`` package. Backends that mount host folders (bwrap, docker) get it as
a read-only bind at :data:`CODE_ROOT`; the others (kubernetes, e2b) get it uploaded into
:data:`UPLOAD_ROOT` of each sandbox, where the sandbox's own processes could change it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from corral.envs.bundle import Bundle
from corral.envs.episode import END_TURN_TOOL, Env, Task, ToolOutcome
from corral.sandboxes.base import (
    Bind,
    Sandbox,
    SandboxError,
    SandboxProcess,
    SandboxProvider,
    SandboxSpec,
)
from corral.sandboxes.pool import WarmPool

log = logging.getLogger(__name__)

CODE_ROOT = "/opt/corral"
UPLOAD_ROOT = "/tmp/.corral-env"
_RUNNER_MODULES = ("episode.py", "importing.py", "runner.py")


class EnvFailure(Exception):
    """The env failed (its code raised, its process or sandbox went away); the message says
    which and why. The episode cannot go on."""


class EnvHandle(Protocol):
    """One episode's env, wherever it runs. Every method but :meth:`close` may raise
    :class:`EnvFailure`; none is called concurrently with another."""

    has_end_turn: bool

    async def reset(self, task: Task) -> str: ...

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome: ...

    async def end_turn(self, arguments: dict[str, Any]) -> ToolOutcome: ...

    async def state(self) -> dict[str, Any]: ...

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


class InProcessEnv:
    """An env object in the server's process; its methods run in worker threads."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.has_end_turn = callable(getattr(env, END_TURN_TOOL, None))

    async def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.to_thread(fn, *args)
        except Exception as exc:
            raise _fail(exc) from exc

    async def reset(self, task: Task) -> str:
        return str(await self._call(self.env.reset, task))

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        outcome: ToolOutcome = await self._call(self.env.call_tool, name, arguments)
        return outcome

    async def end_turn(self, arguments: dict[str, Any]) -> ToolOutcome:
        outcome: ToolOutcome = await self._call(getattr(self.env, END_TURN_TOOL), arguments)
        return outcome

    async def state(self) -> dict[str, Any]:
        state: dict[str, Any] = await self._call(self.env.state)
        return state

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
            return InProcessEnv(await asyncio.to_thread(self.bundle.make_env))
        except Exception as exc:
            raise _fail(exc) from exc

    async def aclose(self) -> None:
        return None


class SandboxedEnv:
    """An env held by a runner process in a sandbox (protocol in :mod:`corral.envs.runner`)."""

    def __init__(self, sandbox: Sandbox, process: SandboxProcess) -> None:
        self.sandbox = sandbox
        self.process = process
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
        return str(await self.request("reset", task=task.to_json()))

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        return ToolOutcome(**await self.request("call_tool", name=name, arguments=arguments))

    async def end_turn(self, arguments: dict[str, Any]) -> ToolOutcome:
        return ToolOutcome(**await self.request("end_turn", arguments=arguments))

    async def state(self) -> dict[str, Any]:
        state = await self.request("state")
        if not isinstance(state, dict):
            raise EnvFailure(f"the env's state is {type(state).__name__}, not an object")
        return state

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


def build_payload(bundle: Bundle, into: Path) -> Path:
    """Write the payload (module docstring) under ``into``; return its root."""
    root = into / "payload"
    envs = root / "corral" / "envs"
    envs.mkdir(parents=True)
    (root / "corral" / "__init__.py").write_text("")
    (envs / "__init__.py").write_text("")
    here = Path(__file__).resolve().parent
    for name in _RUNNER_MODULES:
        shutil.copyfile(here / name, envs / name)
    splits = {(bundle.root / p).resolve() for p in bundle.manifest.splits.values()}

    def skip(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n == "__pycache__" or (Path(folder) / n).resolve() in splits}

    shutil.copytree(bundle.root, root / "bundle", ignore=skip)
    return root


class SandboxHost:
    """One sandbox per episode from ``provider`` (module docstring). ``warm``: keep that many
    sandboxes started ahead (a :class:`~corral.sandboxes.pool.WarmPool`). ``python``: the
    interpreter inside; ``upload_root``: where the payload goes in backends without binds.
    :meth:`open` sweeps what a crashed earlier server left, then fills the pool."""

    def __init__(
        self,
        bundle: Bundle,
        provider: SandboxProvider,
        spec: SandboxSpec,
        *,
        warm: int = 0,
        python: str = "python3",
        upload_root: str = UPLOAD_ROOT,
    ) -> None:
        self.bundle = bundle
        self.provider = provider
        self.python = python
        self.warm = warm
        self.description = f"sandbox {provider.name}" + (
            "" if provider.isolated else " (NO isolation)"
        )
        self._tmp = Path(tempfile.mkdtemp(prefix="corral-payload-"))
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
        self.spec = spec
        self._pool: WarmPool | None = WarmPool(provider, spec, warm) if warm > 0 else None

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
                env={"PYTHONPATH": self.code_root, "PYTHONDONTWRITEBYTECODE": "1"},
            )
            env = SandboxedEnv(sandbox, process)
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
        shutil.rmtree(self._tmp, ignore_errors=True)


async def _close_quietly(sandbox: Sandbox) -> None:
    try:
        await sandbox.close()
    except Exception as exc:
        log.warning("closing sandbox %s failed: %s", sandbox.id, exc)
