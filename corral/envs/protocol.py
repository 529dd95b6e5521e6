"""The env server's wire format, as typed models: OpenEnv's MCP actions and observations.

One shape steps every episode, whichever way it travels (the WebSocket ``/ws``, HTTP
``/reset`` + ``/step``, JSON-RPC ``/mcp``), so an OpenEnv client plays corral's server
unchanged. On ``/ws`` each text frame is one JSON object:

- client -> server: ``{"type": "reset", "data": {...}}``, ``{"type": "step", "data":
  <action>}``, ``{"type": "state"}``, ``{"type": "close"}``, ``{"type": "mcp", "data":
  <JSON-RPC request>}``;
- server -> client: ``{"type": "observation", "data": {"observation": {...}, "reward": r,
  "done": d}}``, ``{"type": "state", "data": {...}}``, ``{"type": "mcp", "data": <JSON-RPC
  response>}``, ``{"type": "error", "data": {"message": ..., "code": ..., ...}}``.

An action is OpenEnv's: ``{"type": "list_tools"}`` or ``{"type": "call_tool", "tool_name":
..., "arguments": {...}}`` (either may carry ``metadata``). Observations: :class:`ResetObservation`
after a reset, :class:`ListToolsObservation` after ``list_tools``, :class:`CallToolObservation`
after a call. corral's extensions, all optional for an OpenEnv client: ``reset``'s data may
name the task (``split`` + ``index``, or ``task_id``); every client frame may carry
``request_id`` (a string or an integer), which the reply echoes; error data carries a
``reason`` finer than its OpenEnv ``code``.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    StrictStr,
    Tag,
    TypeAdapter,
    model_serializer,
    model_validator,
)

# Strict: a ``true`` or ``1.0`` id is refused, never echoed back as ``1``.
RequestId = StrictStr | StrictInt

# Frames nested deeper than this are refused before validation (json.loads itself gives up
# near Python's recursion limit; pydantic and json.dumps would recurse as deep).
MAX_FRAME_DEPTH = 64


class ErrorCode(StrEnum):
    """``error`` codes: exactly OpenEnv's seven (corral's finer cases are ``reason``)."""

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"


class Reason(StrEnum):
    """corral's finer error cases, in an error's ``reason`` field."""

    TASK_NOT_FOUND = "task_not_found"  # VALIDATION_ERROR: the reset names no task
    NO_EPISODE = "no_episode"  # EXECUTION_ERROR: a step or state with no episode
    EPISODE_DONE = "episode_done"  # EXECUTION_ERROR: a step after the episode ended
    REAPED = "reaped"  # SESSION_ERROR: the episode idled past idle_timeout
    SHUTDOWN = "shutdown"  # SESSION_ERROR: the server is shutting down
    TOO_DEEP = "too_deep"  # VALIDATION_ERROR: a frame nested past MAX_FRAME_DEPTH
    OLD_SHAPE = "old_shape"  # VALIDATION_ERROR: corral's pre-OpenEnv step shape
    STATE_TOO_LARGE = "state_too_large"  # EXECUTION_ERROR: state over max_state_bytes
    BODY_TOO_LARGE = "body_too_large"  # VALIDATION_ERROR: an HTTP body over the server's cap
    CLOSED = "closed"  # SESSION_ERROR: the episode was closed (by a client) before its end
    NO_AGENT_SUPPORT = "no_agent_support"  # EXECUTION_ERROR: no [agent] section, or no sandbox
    AGENT_RUNNING = "agent_running"  # EXECUTION_ERROR: an agent plays the episode right now
    AGENT_REFUSED = "agent_refused"  # VALIDATION_ERROR: the launch breaks the server's policy
    AGENT_FAILED = "agent_failed"  # EXECUTION_ERROR: the agent's sandbox failed; episode over


class ToolErrorType(StrEnum):
    """OpenEnv's categories of a framework-detected tool failure."""

    EXECUTION_ERROR = "execution_error"
    INVALID_ARGS = "invalid_args"
    TRANSPORT_ERROR = "transport_error"
    TOOL_NOT_FOUND = "tool_not_found"
    TIMEOUT = "timeout"


# Tool failures after which the env's state cannot be trusted: the episode ends.
EPISODE_ENDING_TOOL_ERRORS = frozenset({ToolErrorType.TIMEOUT, ToolErrorType.EXECUTION_ERROR})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON) nests lists and objects, without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


# ---------------------------------------------------------------------------------------------
# client -> server


class ResetData(_Strict):
    """Which task to play: ``split`` + ``index``, or ``task_id``, or neither.

    Neither is what OpenEnv's own ``reset()`` sends (optionally with ``seed`` and
    ``episode_id``): the server then picks a task of its default split, ``seed`` mod the split's
    size when a seed is given (reproducible), else the next task in turn. ``episode_id`` names
    the episode when no live episode has that id already.
    """

    split: str | None = None
    index: int | None = Field(default=None, ge=0)
    task_id: str | None = None
    seed: int | None = Field(default=None, ge=0)
    episode_id: str | None = Field(default=None, min_length=1, max_length=255)

    @model_validator(mode="after")
    def _one_task(self) -> ResetData:
        by_position = self.split is not None or self.index is not None
        if self.task_id is not None and by_position:
            raise ValueError('give either "task_id" or "split" + "index", not both')
        if by_position and (self.split is None or self.index is None):
            raise ValueError('name a task by both "split" and "index"')
        return self


class ListToolsAction(_Strict):
    """OpenEnv's ``ListToolsAction``: the tools (needs no reset)."""

    type: Literal["list_tools"] = "list_tools"
    metadata: dict[str, Any] = Field(default_factory=dict)


class CallToolAction(_Strict):
    """OpenEnv's ``CallToolAction``. ``arguments`` is deliberately untyped here: arguments
    that are not a JSON object (or a string holding one, as OpenAI writes them) are the
    model's mistake, answered as an ``invalid_args`` tool error, not a protocol error."""

    type: Literal["call_tool"] = "call_tool"
    tool_name: str
    arguments: Any = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)


StepAction = Annotated[ListToolsAction | CallToolAction, Field(discriminator="type")]
STEP_ACTION: TypeAdapter[ListToolsAction | CallToolAction] = TypeAdapter(StepAction)
# The shape a step's data had before it was OpenEnv's: named in the refusal.
NEW_SHAPE_HINT = (
    'a step\'s data is {"type": "call_tool", "tool_name": ..., "arguments": {...}} or '
    '{"type": "list_tools"}'
)


class ResetMessage(_Strict):
    type: Literal["reset"] = "reset"
    data: ResetData = Field(default_factory=ResetData)
    request_id: RequestId | None = None


class StepMessage(_Strict):
    type: Literal["step"] = "step"
    data: StepAction
    request_id: RequestId | None = None


class StateRequest(_Strict):
    type: Literal["state"] = "state"
    request_id: RequestId | None = None


class CloseMessage(_Strict):
    type: Literal["close"] = "close"
    request_id: RequestId | None = None


class McpMessage(_Strict):
    """OpenEnv's ``WSMCPMessage``: a JSON-RPC request on ``/ws`` (checked by the handler)."""

    type: Literal["mcp"] = "mcp"
    data: Any
    request_id: RequestId | None = None


# -- a black-box agent in the episode's sandbox (corral's extension; see corral.harnesses) ----

# Replaced, wherever it appears in an AgentLaunch's argv, env values and file contents, by the
# origin the agent reaches the gateway at from inside its sandbox ("http://127.0.0.1:PORT":
# a listener of the agent's own, bridged to the gateway by the env server).
GATEWAY_PLACEHOLDER = "@@CORRAL_GATEWAY@@"
# Where the agent's own folders are in its sandbox, made by the sandbox side before it starts,
# owned by the model's user: HOME, TMPDIR (a folder of its own: Codex refuses a CODEX_HOME
# under the temporary folder), and CORRAL_AGENT_DIR (its program files, read-only).
AGENT_ROOT = "/tmp/corral-agent"
AGENT_HOME = f"{AGENT_ROOT}/home"
AGENT_TMP = f"{AGENT_ROOT}/tmp"
AGENT_DIR = f"{AGENT_ROOT}/agent"
AgentFileArea = Literal["home", "agent_dir"]


class AgentFile(_Strict):
    """A file written for the agent before it starts: under its ``HOME`` (configs it may
    change) or under ``CORRAL_AGENT_DIR`` (its own program files, made read-only).
    ``path`` is relative, "/"-separated, without ``..``."""

    area: AgentFileArea = "home"
    path: str = Field(min_length=1, max_length=1024)
    content_b64: str
    executable: bool = False


class AgentLaunch(_Strict):
    """How to run one black-box agent in the episode's sandbox, in the task's workspace (its
    working folder), as the model's unprivileged user. ``env`` is the agent's whole
    environment but for ``HOME``, ``TMPDIR``, ``PATH`` and ``CORRAL_AGENT_DIR``, which the
    sandbox side sets. ``gateway``: the gateway's origin as the *env server* reaches it
    (``http(s)://host:port``); the agent reaches it through :data:`GATEWAY_PLACEHOLDER`.
    ``transcript``: which of its output streams is its transcript (kept whole, up to a
    bound). ``timeout_s``: its budget; past it the agent gets SIGTERM, then its whole process
    tree is killed ``kill_grace_s`` later."""

    harness: str = Field(min_length=1, max_length=64)  # for the record: "codex", "command", ...
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    files: list[AgentFile] = Field(default_factory=list)
    gateway: str = Field(min_length=1, max_length=2048)
    timeout_s: float = Field(gt=0)
    kill_grace_s: float = Field(default=5.0, ge=0, le=60)
    transcript: Literal["stdout", "stderr"] = "stdout"


class AgentRun(BaseModel):
    """How the agent's process ended. ``exit_code`` is ``None`` when it was killed (its
    budget ran out: ``timed_out``; or the sandbox killed it: ``killed_reason``). Times are
    seconds since the env server took the launch: ``started_s`` when the agent's process
    started, ``first_request_s`` when it first connected to the gateway (None: never),
    ``seconds`` when it ended. ``transcript`` is the transcript stream's first
    ``MAX_TRANSCRIPT_BYTES`` (``transcript_truncated`` when it wrote more); the tails are
    the last bytes of each stream, decoded."""

    exit_code: int | None
    timed_out: bool = False
    killed_reason: str | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    transcript: str = ""
    transcript_truncated: bool = False
    started_s: float | None = None
    first_request_s: float | None = None
    seconds: float = 0.0
    gateway_connections: int = 0


class AgentMessage(_Strict):
    """Run a black-box agent on this socket's episode, then end the episode (the bundle's
    ``[agent] finish_tool``, else ``end_turn`` until it ends) and grade it. The reply, an
    ``agent`` frame, comes when all that is done."""

    type: Literal["agent"] = "agent"
    data: AgentLaunch
    request_id: RequestId | None = None


ClientMessageT = (
    ResetMessage | StepMessage | StateRequest | CloseMessage | McpMessage | AgentMessage
)
CLIENT_MESSAGE: TypeAdapter[ClientMessageT] = TypeAdapter(
    Annotated[ClientMessageT, Field(discriminator="type")]
)
CLIENT_TYPES = ("reset", "step", "state", "close", "mcp", "agent")


# ---------------------------------------------------------------------------------------------
# server -> client: tools and results


class McpTool(_Strict):
    """A tool as MCP (and OpenEnv's ``Tool``) lists it."""

    name: str
    description: str
    input_schema: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's chat-completions ``tools`` shape (what a model is shown)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.input_schema,
            },
        }


class TextContent(_Strict):
    type: Literal["text"] = "text"
    text: str


class ToolResult(_Strict):
    """A tool's answer, shaped as OpenEnv serializes a FastMCP ``CallToolResult``: ``data`` is
    what ``MCPToolClient.call_tool`` returns (the text), ``is_error`` marks the env's own
    refusal (a bad argument value): the episode goes on."""

    content: list[TextContent]
    structured_content: None = None
    data: str
    is_error: bool = False

    @classmethod
    def of(cls, text: str, *, is_error: bool = False) -> ToolResult:
        return cls(content=[TextContent(text=text)], data=text, is_error=is_error)


class ToolError(_Strict):
    """A failure the server detected (not the env's answer): unknown tool, bad arguments,
    an env past the tool timeout, an env that raised or died."""

    error_type: ToolErrorType
    message: str


Status = Literal["running", "graded", "error"]


class EpisodeFields(BaseModel):
    """corral's episode fields on an observation. ``status``: ``running``, then ``graded``
    when the verifier scored the episode, or ``error`` when it could not (``grade_error`` says
    why; the reward is then null, never 0)."""

    model_config = ConfigDict(extra="forbid")

    task_id: str | None = None
    turn: int = 0
    step: int = 0
    status: Status = "running"
    scores: dict[str, float] | None = None
    grade_error: str | None = None

    @model_serializer(mode="wrap")
    def _present_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``scores`` / ``grade_error`` appear once there are some; with no episode (a
        ``list_tools`` before any reset) no episode field appears."""
        data = dict(handler(self))
        for key in ("scores", "grade_error"):
            if data.get(key) is None:
                data.pop(key, None)
        if self.task_id is None:
            for key in ("task_id", "turn", "step", "status"):
                data.pop(key, None)
        return data


class ResetObservation(_Strict):
    """After a reset: the task's prompt, the system prompt and its tools (``end_turn`` last).
    ``agent_instructions``: the bundle's ``[agent] instructions`` for a black-box agent
    (corral's extension: serialized only when the bundle has them)."""

    prompt: str
    system_prompt: str
    tools: list[McpTool]
    task_id: str
    episode_id: str
    turn: int = 0
    step: int = 0
    status: Status = "running"
    agent_instructions: str | None = None

    @model_serializer(mode="wrap")
    def _instructions_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = dict(handler(self))
        if data.get("agent_instructions") is None:
            data.pop("agent_instructions", None)
        return data

    @property
    def text(self) -> str:
        return self.prompt

    @property
    def is_error(self) -> bool:
        return False


class ListToolsObservation(EpisodeFields):
    """After ``list_tools``: the tools; the episode fields when the socket has an episode."""

    tools: list[McpTool]

    @property
    def text(self) -> str:
        return json.dumps([t.name for t in self.tools])

    @property
    def is_error(self) -> bool:
        return False


class CallToolObservation(EpisodeFields):
    """After a call: OpenEnv's ``CallToolObservation`` (``tool_name``, ``result``, ``error``)
    with corral's episode fields. Exactly one of ``result`` and ``error`` is set."""

    tool_name: str
    result: ToolResult | None = None
    error: ToolError | None = None

    @property
    def text(self) -> str:
        """What the model reads: the tool's text, or the error's message."""
        if self.error is not None:
            return self.error.message
        return self.result.data if self.result is not None else ""

    @property
    def is_error(self) -> bool:
        return self.error is not None or (self.result is not None and self.result.is_error)


def _observation_kind(value: Any) -> str:
    keys = value.keys() if isinstance(value, dict) else vars(value).keys()
    if "prompt" in keys:
        return "reset"
    return "call" if "tool_name" in keys else "list"


Observation = Annotated[
    Annotated[ResetObservation, Tag("reset")]
    | Annotated[ListToolsObservation, Tag("list")]
    | Annotated[CallToolObservation, Tag("call")],
    Discriminator(_observation_kind),
]
ObsT = TypeVar("ObsT", ResetObservation, ListToolsObservation, CallToolObservation)


class StepResult(BaseModel, Generic[ObsT]):
    """OpenEnv's serialized observation: the observation, its reward and whether it ended."""

    observation: ObsT
    reward: float | None = None
    done: bool = False


class ObservationData(BaseModel):
    """A ``StepResult`` of any observation kind (what the ``observation`` frame carries)."""

    observation: Observation
    reward: float | None = None
    done: bool = False


class EpisodeState(BaseModel):
    """A ``state`` reply: OpenEnv's ``episode_id`` and ``step_count``, corral's counters and
    status, and the env's own state under ``env``: live while the episode runs, the state read
    at grading once graded, ``None`` after the env failed (``error`` then says why)."""

    episode_id: str
    step_count: int
    done: bool
    task_id: str
    turn: int
    status: Status
    env: dict[str, Any] | None
    error: str | None = None


# ---------------------------------------------------------------------------------------------
# server -> client: frames


class ObservationMessage(BaseModel):
    type: Literal["observation"] = "observation"
    data: ObservationData
    request_id: RequestId | None = None


class StateMessage(BaseModel):
    type: Literal["state"] = "state"
    data: EpisodeState
    request_id: RequestId | None = None


class McpReply(BaseModel):
    """OpenEnv's ``WSMCPResponse``: a JSON-RPC response."""

    type: Literal["mcp"] = "mcp"
    data: dict[str, Any]
    request_id: RequestId | None = None


class AgentResult(BaseModel):
    """The ``agent`` frame's data: how the agent ended, and the episode after it was ended
    and graded (``status`` ``graded`` with ``reward``, or ``error`` with ``grade_error``)."""

    run: AgentRun
    status: Status
    reward: float | None = None
    scores: dict[str, float] | None = None
    grade_error: str | None = None
    turn: int = 0
    step: int = 0


class AgentReply(BaseModel):
    type: Literal["agent"] = "agent"
    data: AgentResult
    request_id: RequestId | None = None


class ErrorData(BaseModel):
    """``message`` for people, ``code`` (OpenEnv's) and ``reason`` (corral's) for programs.
    ``VALIDATION_ERROR`` adds ``errors``; ``CAPACITY_REACHED`` adds ``active_sessions`` and
    ``max_sessions``."""

    model_config = ConfigDict(extra="forbid")

    message: str
    code: ErrorCode
    reason: Reason | None = None
    errors: list[dict[str, Any]] | None = None
    active_sessions: int | None = None
    max_sessions: int | None = None


class ErrorMessage(BaseModel):
    type: Literal["error"] = "error"
    data: ErrorData
    request_id: RequestId | None = None


ServerMessageT = ObservationMessage | StateMessage | McpReply | AgentReply | ErrorMessage
SERVER_MESSAGE: TypeAdapter[ServerMessageT] = TypeAdapter(
    Annotated[ServerMessageT, Field(discriminator="type")]
)


def encode(message: ServerMessageT) -> str:
    """The frame text of a server message: ``request_id`` appears only when there is one, and
    error fields only when set."""
    if isinstance(message, ErrorMessage):
        body: dict[str, Any] = {
            "type": "error",
            "data": message.data.model_dump(mode="json", exclude_none=True),
        }
        if message.request_id is not None:
            body["request_id"] = message.request_id
        return json.dumps(body)
    exclude = {"request_id"} if message.request_id is None else None
    return message.model_dump_json(exclude=exclude)


def encode_observation(result: StepResult[Any], request_id: RequestId | None = None) -> str:
    """The ``observation`` frame text of a step result (as :func:`encode` would write it)."""
    body: dict[str, Any] = {"type": "observation", "data": result.model_dump(mode="json")}
    if request_id is not None:
        body["request_id"] = request_id
    return json.dumps(body)


def error_message(
    code: ErrorCode,
    message: str,
    request_id: RequestId | None = None,
    **extra: Any,
) -> ErrorMessage:
    """An ``error`` reply with ``code``, ``message`` and any of ErrorData's extra fields."""
    return ErrorMessage(data=ErrorData(message=message, code=code, **extra), request_id=request_id)


def quoted(text: str, limit: int = 80) -> str:
    """``text`` as a message quotes it: ``repr``, cut to ``limit`` characters, so a client's
    huge id is never echoed whole."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def json_safe_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """pydantic's ``errors()`` reduced to JSON data (``loc``, ``msg``, ``type``): its ``input``
    and ``ctx`` may hold anything, even the whole frame."""
    return [
        {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg")), "type": e.get("type")}
        for e in errors
    ]
