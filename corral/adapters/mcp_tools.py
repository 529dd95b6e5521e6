"""One episode's tools over MCP (streamable HTTP), for black-box agents (``corral play``).

A black-box agent reaches its episode's tools the way any MCP host reaches any tool server:
``tools/list`` answers the row's tools (names, descriptions and JSON-schema parameters exactly
as the row has them, ``end_turn`` included), and each ``tools/call`` is forwarded to the episode
as a step on the env server (:meth:`EnvClient.call_tool`).

The logic lives in :class:`EpisodeTools` (plain Python: forwarding, the episode's end, the
env's failures); :func:`serve_episode_tools` only puts the official ``mcp`` SDK's low-level
server and its streamable HTTP transport in front of it, behind a bearer token.

One server per episode, each on a port of its own on 127.0.0.1, running in the caller's event
loop (where the episode's WebSocket client lives). Why not one server with a path per episode:
an episode's tools then live and die with their server, so nothing of one episode (a token, a
session, a late call from an agent's stray child) can reach another episode or outlive it, and
there is no routing table to keep in step with the episodes; a server costs one listening
socket and a few milliseconds to start, small beside an episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import mcp.types as mcp_types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server

from corral.bearer import BearerGate
from corral.envs.client import EnvClient, EnvClientError, EnvServerError
from corral.envs.episode import END_TURN_TOOL
from corral.envs.protocol import (
    EPISODE_ENDING_TOOL_ERRORS,
    CallToolObservation,
    StepResult,
)
from corral.serving import serve_in_loop

# The end_turn description the agent reads: it decides when the agent stops, so it says what
# ending the turn does, whatever the row's text.
END_TURN_DESCRIPTION = (
    "End your turn, with your answer for this turn. When the environment has no further turn "
    "for you this ends the episode and it is graded; call it once you are done."
)
# ``_meta`` key on every tools/call result: the episode's state, for agents that want to stop
# when it ends (hosts do not show ``_meta`` to the model).
META_KEY = "corral/episode"
MCP_PATH = "/mcp"


@dataclass(frozen=True)
class ToolReply:
    """What one tool call answers: the text the model reads, whether it is a tool error, and
    whether the episode is over after it."""

    text: str
    is_error: bool
    done: bool
    status: str


class EpisodeTools:
    """An episode's tools, forwarded to the episode on the env server.

    ``client`` must hold the episode (reset already done); ``tools`` are the row's tools in
    OpenAI's schema. Calls are serialised (one in flight at a time, in arrival order).

    Contract of :meth:`call`: it never raises for anything the agent or the env does.
    - a tool error (unknown tool, bad arguments, a refused action) comes back as an error reply
      and the episode goes on; a tool the row does not list is forwarded too, so that the env
      answers (and counts) every call the agent made;
    - the call that ends the episode returns the env's text with ``done``; the final
      observation (reward, scores, status) is kept in :attr:`outcome`;
    - the env failing (a ``timeout`` or ``execution_error`` tool error, an ``error`` reply, a
      lost socket, a call past its deadline) ends the episode as failed: the reason is kept in
      :attr:`failure` and the agent gets an error reply saying so;
    - any call after the end is answered with an error reply saying the episode is over, and
      is not forwarded.
    """

    def __init__(self, client: EnvClient, tools: list[dict[str, Any]]) -> None:
        self.client = client
        self.tools = tools
        self.outcome: StepResult[CallToolObservation] | None = None
        self.failure: str | None = None
        self.calls = 0  # calls forwarded to the env
        self._lock = asyncio.Lock()

    @property
    def done(self) -> bool:
        return self.outcome is not None or self.failure is not None

    def mcp_tools(self) -> list[mcp_types.Tool]:
        """The row's tools as MCP tools (``parameters`` becomes ``inputSchema`` verbatim)."""
        return [mcp_tool(schema) for schema in self.tools]

    async def call(self, name: str, arguments: dict[str, Any] | None) -> ToolReply:
        """Forward one call to the episode (see the class contract)."""
        async with self._lock:
            if self.done:
                return self._over()
            self.calls += 1
            try:
                data = await self.client.call_tool(name, arguments if arguments is not None else {})
            except EnvClientError as exc:  # EnvServerError, EpisodeLostError, timeouts
                self.failure = _failure_reason(name, exc)
                return ToolReply(
                    f"error: the environment failed, the episode is over ({self.failure})",
                    is_error=True,
                    done=True,
                    status="error",
                )
            observation = data.observation
            error = observation.error
            if error is not None and error.error_type in EPISODE_ENDING_TOOL_ERRORS:
                self.failure = f"the env failed on {name!r} ({error.error_type}): {error.message}"
                return ToolReply(
                    f"error: the environment failed, the episode is over ({self.failure})",
                    is_error=True,
                    done=True,
                    status="error",
                )
            if data.done:
                self.outcome = data
            return ToolReply(
                observation.text,
                is_error=observation.is_error,
                done=data.done,
                status=observation.status,
            )

    async def end(self, max_calls: int) -> None:
        """End the episode if it is still running, so the verifier grades it: ``end_turn``
        with no answer, repeated while the env hands out further turns, at most ``max_calls``
        times. An episode still running after that is flagged in :attr:`failure`."""
        for _ in range(max_calls):
            if self.done:
                return
            await self.call(END_TURN_TOOL, {})
        if not self.done:
            self.failure = f"the episode did not end after {max_calls} end_turn calls"

    def _over(self) -> ToolReply:
        why = f"it failed: {self.failure}" if self.failure else "it has ended"
        return ToolReply(
            f"error: the episode is over ({why}); no more tool calls are taken",
            is_error=True,
            done=True,
            status="error" if self.failure else self._status(),
        )

    def _status(self) -> str:
        return self.outcome.observation.status if self.outcome else "running"


def _failure_reason(name: str, exc: EnvClientError) -> str:
    if isinstance(exc, EnvServerError):
        return f"the env server answered {name!r} with {exc}"
    return f"the env server could not be reached for {name!r}: {exc}"


def mcp_tool(schema: dict[str, Any]) -> mcp_types.Tool:
    """An OpenAI function-tool schema as an MCP tool; ``end_turn`` gets
    :data:`END_TURN_DESCRIPTION`."""
    function = schema["function"]
    name = function["name"]
    description = END_TURN_DESCRIPTION if name == END_TURN_TOOL else function.get("description")
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return mcp_types.Tool(name=name, description=description, input_schema=parameters)


def call_result(reply: ToolReply) -> mcp_types.CallToolResult:
    """A :class:`ToolReply` as an MCP result (``isError`` for tool errors and the end)."""
    return mcp_types.CallToolResult(
        content=[mcp_types.TextContent(text=reply.text)],
        is_error=reply.is_error,
        _meta={META_KEY: {"done": reply.done, "status": reply.status}},
    )


def mcp_server(tools: EpisodeTools) -> Server[Any]:
    """The SDK's low-level server answering ``tools/list`` and ``tools/call`` from ``tools``."""

    async def list_tools(
        ctx: ServerRequestContext[Any], params: mcp_types.PaginatedRequestParams | None
    ) -> mcp_types.ListToolsResult:
        return mcp_types.ListToolsResult(tools=tools.mcp_tools())

    async def call_tool(
        ctx: ServerRequestContext[Any], params: mcp_types.CallToolRequestParams
    ) -> mcp_types.CallToolResult:
        return call_result(await tools.call(params.name, params.arguments))

    return Server(
        "corral-episode",
        instructions="The tools of one corral episode; end_turn ends your turn.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


@dataclass(frozen=True)
class McpEndpoint:
    """Where an agent reaches the episode's tools: the streamable HTTP URL and its token."""

    url: str
    token: str


@contextlib.asynccontextmanager
async def serve_episode_tools(
    tools: EpisodeTools, *, host: str = "127.0.0.1"
) -> AsyncIterator[McpEndpoint]:
    """Serve ``tools`` over MCP streamable HTTP at ``http://host:PORT/mcp`` (a free port) with
    a fresh random bearer token, in this event loop, until the block exits.

    Raises ``RuntimeError`` if the server cannot start. On exit the server stops: open MCP
    sessions are dropped (a graceful second for requests in flight) and the port is released.
    """
    token = secrets.token_urlsafe(32)
    server = mcp_server(tools)
    starlette_app = server.streamable_http_app(
        streamable_http_path=MCP_PATH, host=host, session_idle_timeout=None
    )
    # lifespan "off": the app's lifespan would run the SDK's session manager, which is run
    # here instead so that its failure surfaces as an exception in this task. The server has
    # corral's transport limits, as every other: no stray client holds a socket for ever.
    async with (
        server.session_manager.run(),
        serve_in_loop(
            BearerGate(starlette_app, token),
            host=host,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        ) as url,
    ):
        yield McpEndpoint(url=f"{url}{MCP_PATH}", token=token)
