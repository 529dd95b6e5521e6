"""The env server's WebSocket messages, as typed models (one JSON object per text frame).

The shapes are OpenEnv's, so an OpenEnv client can play an episode:

- client -> server: ``{"type": "reset", "data": {...}}``, ``{"type": "step", "data": {...}}``,
  ``{"type": "state"}``, ``{"type": "close"}``;
- server -> client: ``{"type": "observation", "data": {"observation": {...}, "reward": r,
  "done": d}}``, ``{"type": "state", "data": {...}}``, ``{"type": "error", "data": {"message":
  ..., "code": ...}}``.

corral's extensions, all optional for an OpenEnv client:

- ``reset``'s data names the task: ``{"split": "eval", "index": 3}`` or ``{"task_id": "..."}``;
- ``step``'s data is one action: ``{"call_tool": {"name": ..., "arguments": {...}}}`` or
  ``{"list_tools": {}}``;
- every client message may carry ``request_id`` (a string or an integer), which the reply
  echoes; a reply to a message without one carries none;
- error data may carry more fields than ``message`` and ``code`` (``CAPACITY_REACHED`` adds
  ``active`` and ``max``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

RequestId = str | int


class ErrorCode(StrEnum):
    """``error`` codes: OpenEnv's (first seven) and corral's own."""

    INVALID_JSON = "INVALID_JSON"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    VALIDATION_ERROR = "VALIDATION_ERROR"
    EXECUTION_ERROR = "EXECUTION_ERROR"
    CAPACITY_REACHED = "CAPACITY_REACHED"
    FACTORY_ERROR = "FACTORY_ERROR"
    SESSION_ERROR = "SESSION_ERROR"
    # corral's: a reset naming no task; a step or state with no live episode on the socket; a
    # step after the episode ended; a tool call that overran the server's tool timeout.
    TASK_NOT_FOUND = "TASK_NOT_FOUND"
    NO_EPISODE = "NO_EPISODE"
    EPISODE_DONE = "EPISODE_DONE"
    TOOL_TIMEOUT = "TOOL_TIMEOUT"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------------------------------
# client -> server


class ResetData(_Strict):
    """Which task to play: ``split`` + ``index``, or ``task_id``, or neither.

    Neither is what OpenEnv's own ``reset()`` sends (optionally with ``seed`` and
    ``episode_id``): the server then picks a task of its default split, ``seed`` mod the split's
    size when a seed is given (reproducible), else the next task in turn.
    """

    split: str | None = None
    index: int | None = Field(default=None, ge=0)
    task_id: str | None = None
    seed: int | None = None
    episode_id: str | None = None

    @model_validator(mode="after")
    def _one_task(self) -> ResetData:
        by_position = self.split is not None or self.index is not None
        if self.task_id is not None and by_position:
            raise ValueError('give either "task_id" or "split" + "index", not both')
        if by_position and (self.split is None or self.index is None):
            raise ValueError('name a task by both "split" and "index"')
        return self

    @property
    def names_a_task(self) -> bool:
        return self.task_id is not None or self.split is not None


class CallTool(_Strict):
    """One tool call. ``arguments`` is deliberately untyped here: arguments that are not a JSON
    object (or a string holding one, as OpenAI writes them) are the model's mistake, answered
    as a tool error observation, not a protocol error."""

    name: str
    arguments: Any = Field(default_factory=dict)


class StepAction(_Strict):
    """A step's data: exactly one of ``call_tool`` or ``list_tools`` (whose value is ``{}``)."""

    call_tool: CallTool | None = None
    list_tools: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_action(self) -> StepAction:
        if (self.call_tool is None) == (self.list_tools is None):
            raise ValueError('a step holds exactly one of "call_tool" or "list_tools"')
        return self


class ResetMessage(_Strict):
    type: Literal["reset"] = "reset"
    data: ResetData
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


ClientMessage = Annotated[
    ResetMessage | StepMessage | StateRequest | CloseMessage, Field(discriminator="type")
]
CLIENT_MESSAGE: TypeAdapter[ResetMessage | StepMessage | StateRequest | CloseMessage] = TypeAdapter(
    ClientMessage
)
CLIENT_TYPES = ("reset", "step", "state", "close")


# ---------------------------------------------------------------------------------------------
# server -> client


class EpisodeObservation(BaseModel):
    """What the model sees after a reset or step (``data.observation``).

    ``content``: the prompt after a reset, the tool's message after a call. ``tool_error``: the
    call was refused (unknown tool, bad arguments) and the episode goes on. ``tools``: the
    task's tools in OpenAI's schema, ``end_turn`` included (on reset and ``list_tools``).
    ``status``: ``running``, then ``graded`` when the verifier scored the episode, or ``error``
    when it could not (``error`` says why; the reward is then null, never 0).
    """

    model_config = ConfigDict(extra="allow")

    content: str = ""
    tool_error: bool = False
    task_id: str | None = None
    turn: int = 0
    step: int = 0
    status: Literal["running", "graded", "error"] = "running"
    tools: list[dict[str, Any]] | None = None
    scores: dict[str, float] | None = None
    error: str | None = None


class ObservationData(BaseModel):
    """OpenEnv's serialized observation: the observation, its reward and whether it ended."""

    observation: EpisodeObservation
    reward: float | None = None
    done: bool = False


class ObservationMessage(BaseModel):
    type: Literal["observation"] = "observation"
    data: ObservationData
    request_id: RequestId | None = None


class StateMessage(BaseModel):
    type: Literal["state"] = "state"
    data: dict[str, Any]
    request_id: RequestId | None = None


class ErrorData(BaseModel):
    """``message`` for people, ``code`` for programs; some codes add fields (extra allowed)."""

    model_config = ConfigDict(extra="allow")

    message: str
    code: ErrorCode


class ErrorMessage(BaseModel):
    type: Literal["error"] = "error"
    data: ErrorData
    request_id: RequestId | None = None


ServerMessage = Annotated[
    ObservationMessage | StateMessage | ErrorMessage, Field(discriminator="type")
]
SERVER_MESSAGE: TypeAdapter[ObservationMessage | StateMessage | ErrorMessage] = TypeAdapter(
    ServerMessage
)


def encode(message: ObservationMessage | StateMessage | ErrorMessage) -> str:
    """The frame text of a server message; ``request_id`` appears only when there is one."""
    exclude = {"request_id"} if message.request_id is None else None
    return message.model_dump_json(exclude=exclude)


def error_message(
    code: ErrorCode, message: str, request_id: RequestId | None = None, **extra: Any
) -> ErrorMessage:
    """An ``error`` reply with ``code``, ``message`` and any extra fields (e.g. counts)."""
    return ErrorMessage(data=ErrorData(message=message, code=code, **extra), request_id=request_id)
