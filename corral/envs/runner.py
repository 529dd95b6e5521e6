"""Run one episode's env inside a sandbox, driven by the env server over stdin/stdout.

Standard library only: this file is copied into the sandbox with :mod:`corral.envs.episode`
and :mod:`corral.envs.importing` (see :mod:`corral.envs.hosting`), where nothing else of
corral is installed. Started as::

    python3 -m corral.envs.runner BUNDLE_DIR ENV_MODULE ENV_CLASS BUNDLE_NAME

The protocol is one JSON object per line; the server speaks first and waits for each answer
(strictly one request at a time), so no bytes are ever in flight unasked:

=============================================  ==============================================
request                                        answer (``{"ok": ...}`` or ``{"error": ...}``)
=============================================  ==============================================
``{"op": "start"}``                            ``{"end_turn": bool}``: the env class loaded
``{"op": "reset", "task": {...}}``             the first observation (a string)
``{"op": "call_tool", "name", "arguments"}``   ``{"content", "done", "error"}``
``{"op": "end_turn", "arguments"}``            ``{"content", "done", "error"}``
``{"op": "state"}``                            the env's state (plain JSON data)
=============================================  ==============================================

An error answer is ``{"error": {"type", "message", "where"}}`` (``where``: the last frame in the
bundle's code). After an error in ``start`` or ``reset`` the runner exits; after an error in a
tool call it keeps serving (the server decides: it ends the episode). The env's own prints go
to stderr.

Before any bundle code is imported, :func:`harden` puts the runner out of reach of the
commands its env runs for the model (those run through the backend's jail as well, see
:mod:`corral.envs.model_actions`; this is the part that holds even where the jail is empty):

- the process is made non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``): its ``/proc/<pid>/mem``,
  ``maps``, ``environ`` and ``fd/`` then need ``CAP_SYS_PTRACE`` over it, which no model
  command holds in any isolating backend, even one running as the runner's own uid;
- the protocol streams move off file descriptors 0 and 1 to private, close-on-exec copies, and
  0 and 1 become ``/dev/null`` and stderr: a child that inherits the standard descriptors
  cannot read requests or forge answers, and the env's prints cannot corrupt the stream;
- the environment is cut to the few variables the runner and the env need
  (:data:`KEPT_VARIABLES`): whatever the backend or its image put there stays out of the
  env's children.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import traceback
from pathlib import Path
from typing import IO, Any

from corral.envs.episode import END_TURN_TOOL, Task, ToolOutcome
from corral.envs.importing import bundle_package, import_file

PR_SET_DUMPABLE = 4
# What the env process keeps of its environment (see :func:`harden`); the rest is dropped.
KEPT_VARIABLES = (
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "TZ",
    "PYTHONPATH",
    "PYTHONDONTWRITEBYTECODE",
    "CORRAL_MODEL_JAIL",
)


def private_streams() -> tuple[IO[bytes], IO[bytes]]:
    """Make this process non-dumpable and move its protocol streams off fds 0/1 (module
    docstring: the first two points of :func:`harden`); the private streams (down, up).
    Raises ``OSError`` when the process cannot be made non-dumpable: serving anyway would
    leave its memory open to the model's commands. The black-box agent's launcher
    (:mod:`corral.envs.agent_launcher`) hardens itself with it too."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(err)}")
    # os.dup's copies are non-inheritable (close-on-exec): no child ever holds the protocol.
    down = os.fdopen(os.dup(0), "rb")
    up = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # prints go to stderr, never into the protocol
    sys.stdin = open(os.devnull)  # noqa: SIM115 -- lives as long as the process
    sys.stdout = sys.stderr
    return down, up


def harden() -> tuple[IO[bytes], IO[bytes]]:
    """Make this process unreachable from its children (module docstring) and return the
    private protocol streams (requests, answers). Raises ``OSError`` when the process cannot be
    made non-dumpable: serving anyway would leave its memory open to the model's commands."""
    requests, answers = private_streams()
    for name in list(os.environ):
        if name not in KEPT_VARIABLES:
            del os.environ[name]
    return requests, answers


def _error(exc: BaseException, root: Path) -> dict[str, Any]:
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename and Path(frame.filename).resolve().is_relative_to(root.resolve()):
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            break
    return {"error": {"type": type(exc).__name__, "message": str(exc), "where": where}}


def _outcome(value: Any) -> dict[str, Any]:
    if not isinstance(value, ToolOutcome):
        raise TypeError(f"the env returned {type(value).__name__}, not a ToolOutcome")
    return {"content": str(value.content), "done": bool(value.done), "error": bool(value.error)}


class Runner:
    """Holds one env; :meth:`handle` answers one request (see the module docstring)."""

    def __init__(self, root: Path, module: str, class_name: str, bundle_name: str) -> None:
        self.root = root
        self.module = module
        self.class_name = class_name
        self.bundle_name = bundle_name
        self.env: Any = None

    def handle(self, request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The answer to ``request`` and whether to keep serving."""
        op = request.get("op")
        try:
            if op == "start":
                package = bundle_package(self.root, self.bundle_name)
                env_class = getattr(import_file(self.root, package, self.module), self.class_name)
                self.env = env_class()
                return {"ok": {"end_turn": callable(getattr(self.env, END_TURN_TOOL, None))}}, True
            if self.env is None:
                raise RuntimeError(f"{op!r} before 'start'")
            if op == "reset":
                return {"ok": str(self.env.reset(Task.from_json(request["task"])))}, True
            if op == "call_tool":
                outcome = self.env.call_tool(request["name"], request["arguments"])
                return {"ok": _outcome(outcome)}, True
            if op == "end_turn":
                return {"ok": _outcome(self.env.end_turn(request["arguments"]))}, True
            if op == "state":
                state = self.env.state()
                json.dumps(state)  # not plain JSON data: an error here, not a broken stream
                return {"ok": state}, True
            raise ValueError(f"unknown op {op!r}")
        except Exception as exc:
            return _error(exc, self.root), op not in ("start", "reset")


def serve(runner: Runner, requests: IO[bytes], answers: IO[bytes]) -> None:
    """Answer requests until stdin closes or a fatal error."""
    for line in requests:
        try:
            request = json.loads(line)
        except json.JSONDecodeError as exc:
            answer, go_on = {"error": {"type": "ProtocolError", "message": str(exc)}}, False
        else:
            answer, go_on = runner.handle(request)
        answers.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")
        answers.flush()
        if not go_on:
            return


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print("usage: python3 -m corral.envs.runner BUNDLE_DIR MODULE CLASS NAME", file=sys.stderr)
        return 2
    requests, answers = harden()
    serve(Runner(Path(argv[0]), argv[1], argv[2], argv[3]), requests, answers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
