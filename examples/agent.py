"""An example black-box agent for ``corral play``, built only on the ``openai`` and ``mcp`` SDKs.

Nothing here imports corral: any program that reads these variables, talks to the model with an
OpenAI client and to the tools with an MCP client plays the same way.

- ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``: the model (read by the OpenAI SDK itself);
- ``CORRAL_MCP_URL``, ``CORRAL_MCP_TOKEN``: the episode's tools (MCP, streamable HTTP, bearer);
- ``CORRAL_TASK_PROMPT``, ``CORRAL_SYSTEM_PROMPT``: the task (the system prompt may be empty);
- optional: ``OPENAI_MODEL`` (default: the first model the endpoint lists), ``AGENT_MAX_STEPS``
  (model calls, default 8), ``AGENT_MAX_TOKENS`` (per model call, default 512).

The loop: list the tools, offer them to the model as OpenAI function tools, run each tool call
the model makes through MCP and hand the result back as a ``tool`` message, until the model
answers without a tool call, a tool result says the episode is over, or the steps run out.
Leaving the episode running is fine: corral ends it when the agent exits. Exits 0 when the loop
ran; any error (the model or the MCP server unreachable) exits non-zero with a traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import httpx2  # the HTTP client the mcp SDK's streamable HTTP transport takes
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, Tool
from openai import AsyncOpenAI

# The _meta key under which corral's MCP server says whether the episode is over.
EPISODE_META = "corral/episode"


def openai_tool(tool: Tool) -> dict[str, Any]:
    """An MCP tool as an OpenAI function tool (the input schema is the parameters schema)."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": tool.input_schema,
        },
    }


def result_text(result: CallToolResult) -> str:
    """The text the model reads for a tool result (text blocks joined; errors included)."""
    return "\n".join(block.text for block in result.content if block.type == "text")


def episode_over(result: CallToolResult) -> bool:
    return bool((result.meta or {}).get(EPISODE_META, {}).get("done"))


def first_messages() -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = os.environ.get("CORRAL_SYSTEM_PROMPT", "")
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": os.environ["CORRAL_TASK_PROMPT"]})
    return messages


async def call_tool(mcp: Client, name: str, raw_arguments: str) -> CallToolResult | str:
    """Run one tool call; arguments that are not a JSON object are answered here, as the
    model's mistake, without a call."""
    try:
        arguments = json.loads(raw_arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: the arguments are not valid JSON ({exc.msg})"
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object"
    return await mcp.call_tool(name, arguments)


async def play() -> None:
    llm = AsyncOpenAI(max_retries=0)
    model = os.environ.get("OPENAI_MODEL") or (await llm.models.list()).data[0].id
    max_steps = int(os.environ.get("AGENT_MAX_STEPS", "8"))
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "512"))
    headers = {"Authorization": f"Bearer {os.environ['CORRAL_MCP_TOKEN']}"}
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        Client(streamable_http_client(os.environ["CORRAL_MCP_URL"], http_client=http)) as mcp,
    ):
        tools = [openai_tool(tool) for tool in (await mcp.list_tools()).tools]
        messages = first_messages()
        for _ in range(max_steps):
            completion = await llm.chat.completions.create(
                model=model, messages=messages, tools=tools, max_tokens=max_tokens
            )
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return  # the model answered without a tool: its turn is over
            over = False
            for call in message.tool_calls:
                if call.type != "function":
                    continue
                result = await call_tool(mcp, call.function.name, call.function.arguments)
                text = result if isinstance(result, str) else result_text(result)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
                over = over or (not isinstance(result, str) and episode_over(result))
            if over:
                return


if __name__ == "__main__":
    asyncio.run(play())
