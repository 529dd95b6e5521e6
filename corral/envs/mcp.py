"""MCP over JSON-RPC 2.0, as OpenEnv's server speaks it (:class:`McpHandler`).

Methods: ``openenv/session/create`` (params may name the task as a reset does; it starts an
episode, whose id is the session id), ``tools/list`` (needs no session), ``tools/call``
(``name``, ``arguments``, and the session), ``openenv/session/close``. Error codes are
OpenEnv's: -32700 the text is not JSON, -32600 not a JSON-RPC request (params not an object
included), -32601 no such method, -32602 bad params (a missing ``name``, an unknown session,
an unknown tool, bad arguments, a task that does not exist), -32603 the env failed, -32000 the
server cannot (full, the env did not start, the episode is over).

Where sessions live is the caller's :class:`McpScope`: HTTP ``POST /mcp``
(:func:`mcp_http_routes`) names them by ``session_id``
(:class:`~corral.envs.http_episodes.HttpEpisodes`); a socket (``/mcp``, or ``/ws``'s ``mcp``
frames, :mod:`corral.envs.websocket`) has one of its own.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError

from corral.envs.episodes import Episode, EpisodeManager, ServerError, bundle_tools
from corral.envs.http_bodies import read_body
from corral.envs.http_episodes import HttpEpisodes
from corral.envs.protocol import (
    MAX_FRAME_DEPTH,
    CallToolAction,
    ErrorCode,
    Reason,
    RequestId,
    ResetData,
    ToolErrorType,
    depth,
    json_safe_errors,
    quoted,
)


class RpcCode(IntEnum):
    PARSE_ERROR = -32700
    INVALID_REQUEST = -32600
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602
    INTERNAL_ERROR = -32603
    SERVER_ERROR = -32000


class RpcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jsonrpc: str
    method: str
    params: dict[str, Any] = {}
    id: RequestId | None = None


class RpcError(Exception):
    def __init__(self, code: RpcCode, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


def rpc_error(
    code: RpcCode, message: str, request_id: RequestId | None = None, data: Any = None
) -> dict[str, Any]:
    """A JSON-RPC error response (``data`` only when there is some)."""
    error: dict[str, Any] = {"code": int(code), "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def _from_server_error(exc: ServerError) -> RpcError:
    """A refusal as JSON-RPC: the caller's mistake (-32602) or the server's inability (-32000),
    its OpenEnv code and corral reason in ``data``."""
    data: dict[str, Any] = {"code": exc.code.value, **exc.extra}
    if exc.reason is not None:
        data["reason"] = exc.reason.value
    mistake = exc.code == ErrorCode.VALIDATION_ERROR or exc.reason == Reason.NO_EPISODE
    return RpcError(RpcCode.INVALID_PARAMS if mistake else RpcCode.SERVER_ERROR, str(exc), data)


class McpScope(Protocol):
    """Where a JSON-RPC conversation's sessions (episodes) live."""

    async def create(self, data: ResetData) -> str:
        """The session id of a new (or this socket's) episode."""
        ...

    async def find(self, session_id: str | None, *, calling: bool = False) -> Episode | None:
        """The session's episode (None: no session named and none bound); RpcError for an
        unknown id. ``calling``: for a ``tools/call`` (a socket may start its episode)."""
        ...

    async def close(self, session_id: str | None) -> None: ...


class HttpScope:
    """``POST /mcp``: sessions by ``session_id``, in the server's HTTP episodes."""

    def __init__(self, episodes: HttpEpisodes) -> None:
        self.episodes = episodes

    async def create(self, data: ResetData) -> str:
        episode, _ = await self.episodes.open(data)
        return episode.id

    async def find(self, session_id: str | None, *, calling: bool = False) -> Episode | None:
        if session_id is None:
            return None
        try:
            return self.episodes.get(session_id)
        except ServerError:
            raise RpcError(
                RpcCode.INVALID_PARAMS, f"Unknown session_id: {quoted(session_id)}"
            ) from None

    async def close(self, session_id: str | None) -> None:
        if not session_id:
            raise RpcError(RpcCode.INVALID_PARAMS, "Invalid params - 'session_id' is required")
        try:
            await self.episodes.close(session_id)
        except ServerError:
            raise RpcError(
                RpcCode.INVALID_PARAMS, f"Unknown session_id: {quoted(session_id)}"
            ) from None


class McpHandler:
    """Answers JSON-RPC requests for one server; never raises (every failure is a response)."""

    def __init__(self, manager: EpisodeManager) -> None:
        self.manager = manager

    @staticmethod
    def parse(text: str | bytes) -> Any:
        """The request object in ``text``; RpcError -32700 when it is not JSON (or nests past
        MAX_FRAME_DEPTH)."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            # ValueError, not only JSONDecodeError: bad UTF-8, and an integer past Python's
            # digit limit (4300), raise other ValueErrors.
            raise RpcError(RpcCode.PARSE_ERROR, f"Parse error: {exc}") from None
        except RecursionError:
            raise RpcError(RpcCode.PARSE_ERROR, "Parse error: nested too deeply") from None
        if depth(raw) > MAX_FRAME_DEPTH:
            raise RpcError(RpcCode.PARSE_ERROR, f"Parse error: nested over {MAX_FRAME_DEPTH} deep")
        return raw

    async def handle_text(self, text: str | bytes, scope: McpScope) -> dict[str, Any] | None:
        try:
            raw = self.parse(text)
        except RpcError as exc:
            return rpc_error(exc.code, str(exc))
        return await self.handle(raw, scope)

    async def handle(self, raw: Any, scope: McpScope) -> dict[str, Any] | None:
        """The JSON-RPC response to the parsed request ``raw``; None for a notification (a
        valid request with no ``id`` member, which JSON-RPC 2.0 never answers, not even with
        an error; one that is not a valid request is answered, with id null)."""
        rid = raw.get("id") if isinstance(raw, dict) else None
        rid = rid if isinstance(rid, str | int) and not isinstance(rid, bool) else None
        try:
            request = RpcRequest.model_validate(raw)
            if request.jsonrpc != "2.0":
                raise ValueError('"jsonrpc" must be "2.0"')
        except (ValidationError, ValueError) as exc:
            detail = (
                json_safe_errors(exc.errors()) if isinstance(exc, ValidationError) else str(exc)
            )
            return rpc_error(RpcCode.INVALID_REQUEST, "Invalid Request", rid, detail)
        notification = "id" not in raw
        try:
            result = await self._method(request, scope)
        except RpcError as exc:
            response = rpc_error(exc.code, str(exc), request.id, exc.data)
        except ServerError as exc:
            err = _from_server_error(exc)
            response = rpc_error(err.code, str(err), request.id, err.data)
        else:
            response = {"jsonrpc": "2.0", "id": request.id, "result": result}
        return None if notification else response

    async def _method(self, request: RpcRequest, scope: McpScope) -> Any:
        params = request.params
        session_id = params.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            raise RpcError(RpcCode.INVALID_PARAMS, "'session_id' must be a string")
        if request.method == "openenv/session/create":
            fields = {k: v for k, v in params.items() if k != "session_id"}
            try:
                data = ResetData.model_validate(fields)
            except ValidationError as exc:
                raise RpcError(
                    RpcCode.INVALID_PARAMS, "Invalid params", json_safe_errors(exc.errors())
                ) from None
            return {"session_id": await scope.create(data)}
        if request.method == "openenv/session/close":
            await scope.close(session_id)
            return {"session_id": session_id, "closed": True}
        if request.method == "tools/list":
            episode = await scope.find(session_id)
            tools = episode.tools if episode is not None else bundle_tools(self.manager.bundle)
            return {"tools": [t.model_dump() for t in tools]}
        if request.method == "tools/call":
            return await self._call(params, await scope.find(session_id, calling=True))
        raise RpcError(RpcCode.METHOD_NOT_FOUND, f"Method not found: {request.method}")

    async def _call(self, params: dict[str, Any], episode: Episode | None) -> Any:
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise RpcError(RpcCode.INVALID_PARAMS, "Missing 'name' in params")
        if episode is None:
            raise RpcError(
                RpcCode.INVALID_PARAMS,
                "Invalid params - 'session_id' is required: openenv/session/create starts one",
            )
        call = CallToolAction(tool_name=name, arguments=params.get("arguments", {}))
        out = await self.manager.step(episode, call)
        error = out.observation.error
        if error is None:
            assert out.observation.result is not None
            return out.observation.result.model_dump(mode="json")
        if error.error_type in (ToolErrorType.TOOL_NOT_FOUND, ToolErrorType.INVALID_ARGS):
            raise RpcError(RpcCode.INVALID_PARAMS, error.message, {"error_type": error.error_type})
        # The env timed out, raised or died: the episode is over.
        raise RpcError(
            RpcCode.INTERNAL_ERROR, error.message, {"error_type": error.error_type, "done": True}
        )


def mcp_http_routes(rpc: McpHandler, episodes: HttpEpisodes, *, max_body_bytes: int) -> APIRouter:
    """``POST /mcp``: one JSON-RPC request per body (at most ``max_body_bytes``; a larger one
    is answered -32600 with status 413), its sessions in ``episodes``; a notification is
    accepted with 202 and no body. Every answer is JSON-RPC, never the HTTP error shape."""
    router = APIRouter()

    @router.post("/mcp", response_model=None)
    async def mcp_post(request: Request) -> Response | dict[str, Any]:
        try:
            text = await read_body(request, max_body_bytes)
        except ServerError as exc:
            body = rpc_error(RpcCode.INVALID_REQUEST, str(exc))
            return Response(json.dumps(body), status_code=413, media_type="application/json")
        reply = await rpc.handle_text(text, HttpScope(episodes))
        if reply is None:  # a notification: accepted, and JSON-RPC answers nothing
            return Response(status_code=202)
        return reply

    return router
