"""An example agent for ``corral play --harness command``: a shell agent on the OpenAI API,
standard library only (the sandbox has python3 and nothing else of yours).

It runs where corral puts it: in the task's sandbox, in the task's working folder, as an
unprivileged user, with its gateway session in its environment. Nothing here imports corral:

- ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``: its session (the only network it can reach);
- ``CORRAL_MODEL``: the model name to ask for;
- ``CORRAL_TASK_PROMPT``, ``CORRAL_INSTRUCTIONS``: the task and the bundle's instructions;
- optional: ``AGENT_MAX_STEPS`` (model calls, default 8), ``AGENT_MAX_TOKENS`` (default 512).

The loop: offer the model one ``bash`` tool, run each call with ``bash -c`` in the working
folder (10 s each, output cut at 8 KB), hand the result back, until the model answers without
a tool call or the steps run out. Then it exits 0: corral ends the episode and the verifier
grades the files the agent left. A model error exits 1 with the gateway's message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command with bash -c in the working folder.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
OUTPUT_LIMIT = 8192


def chat(messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One Chat Completions call; the assistant message. Exits 1 on an HTTP error."""
    body = {
        "model": os.environ.get("CORRAL_MODEL", "corral"),
        "messages": messages,
        "tools": [BASH_TOOL],
        "max_tokens": max_tokens,
    }
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
            "Content-Type": "application/json",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        sys.exit(f"the model call failed: {exc.code} {exc.read()[:500]!r}")
    return answer["choices"][0]["message"]


def bash(arguments: str) -> str:
    """Run the call's command; its exit code and output, cut to OUTPUT_LIMIT."""
    try:
        command = json.loads(arguments)["command"]
    except (ValueError, KeyError, TypeError):
        return 'error: the arguments must be {"command": "..."}'
    try:
        done = subprocess.run(
            ["bash", "-c", str(command)], capture_output=True, timeout=10, check=False
        )
    except subprocess.TimeoutExpired:
        return "timed out after 10 s"
    output = (done.stdout + done.stderr).decode(errors="replace")[:OUTPUT_LIMIT]
    return f"exit code: {done.returncode}\n{output}"


def main() -> None:
    steps = int(os.environ.get("AGENT_MAX_STEPS", "8"))
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", "512"))
    messages: list[dict[str, Any]] = []
    if os.environ.get("CORRAL_INSTRUCTIONS"):
        messages.append({"role": "system", "content": os.environ["CORRAL_INSTRUCTIONS"]})
    messages.append({"role": "user", "content": os.environ["CORRAL_TASK_PROMPT"]})
    for _ in range(steps):
        reply = chat(messages, max_tokens)
        messages.append(reply)
        calls = reply.get("tool_calls") or []
        if not calls:
            break
        for call in calls:
            result = bash(call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    print(json.dumps({"messages": len(messages)}))


if __name__ == "__main__":
    main()
