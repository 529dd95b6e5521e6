"""The row writer: an env server's tasks as training rows (``corral rows URL OUTDIR``).

A row is what a trainer's data loader reads and a rollout plays: the task's system prompt and
first prompt as chat ``messages``, and in ``metadata`` where the task lives (split, index, task
id), the tools it offers (OpenAI schema, ``end_turn`` included) and the server it plays on with
the rollout settings. Rows carry the NAME of the environment variable that holds the server's
token, never the token.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict

from corral.envs.client import EnvClient, EnvClientError
from corral.envs.settings import RESET_TIMEOUT_S, TOOL_TIMEOUT_S


class RowsError(Exception):
    """The rows could not be written (server unreachable, token refused, bad answer)."""


@dataclass(frozen=True)
class RowSettings:
    """Rollout settings written into every row (seconds for timeouts)."""

    max_turns: int = 4
    tool_timeout: float = TOOL_TIMEOUT_S
    reset_timeout: float = RESET_TIMEOUT_S
    model_timeout: float = 600.0
    token_var: str | None = None


class EnvRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    token_var: str | None
    max_turns: int
    tool_timeout: float
    reset_timeout: float
    model_timeout: float


class RowMetadata(BaseModel):
    model_config = ConfigDict(extra="forbid")

    split: str
    index: int
    task_id: str
    tools: list[dict[str, Any]]
    env: EnvRef


class Row(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, str]]
    metadata: RowMetadata


def _toolset(tools: list[dict[str, Any]]) -> tuple[str, ...]:
    return tuple(sorted(t["function"]["name"] for t in tools))


class _TaskAPI:
    """The server's HTTP task API, with errors that say what to fix."""

    def __init__(self, url: str, token: str | None, settings: RowSettings) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.settings = settings
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30.0)

    def get(self, path: str) -> Any:
        try:
            response = self.http.get(path)
        except httpx.HTTPError as exc:
            raise RowsError(f"cannot reach the env server at {self.url}: {exc}") from None
        if response.status_code == 401:
            where = (
                f"the token in ${self.settings.token_var}"
                if self.settings.token_var
                else "no token (pass --token-var NAME)"
            )
            raise RowsError(f"the env server at {self.url} refused {where} (HTTP 401)")
        if response.status_code != 200:
            raise RowsError(
                f"the env server at {self.url} answered {path} with HTTP "
                f"{response.status_code}: {response.text[:200]}"
            )
        return response.json()

    def close(self) -> None:
        self.http.close()


def write_rows(
    url: str,
    outdir: Path,
    settings: RowSettings,
    *,
    token: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, int]:
    """Write ``all.jsonl`` and one ``{split}.jsonl`` per split of the server at ``url``.

    Returns the row count per file. ``progress(done, total)`` is called as tasks are read.
    Raises :class:`RowsError` if the server is unreachable, refuses the token or answers
    something that is not its task API; files are only written once every row is known, so
    a failure leaves no partial output.
    """
    api = _TaskAPI(url, token, settings)
    try:
        splits = [s["name"] for s in api.get("/splits")["splits"]]
        listing = [
            (split, t["index"]) for split in splits for t in api.get(f"/tasks/{split}")["tasks"]
        ]
        tasks = []
        for done, (split, index) in enumerate(listing, start=1):
            tasks.append(api.get(f"/tasks/{split}/{index}"))
            if progress is not None:
                progress(done, len(listing))
    finally:
        api.close()

    # One episode per distinct toolset: the tools a row offers are the ones a played
    # episode lists, not only what the task API says.
    toolsets: dict[tuple[str, ...], dict[str, Any]] = {}
    for task in tasks:
        toolsets.setdefault(_toolset(task["tools"]), task)
    listed = asyncio.run(_list_tools(url, token, settings, list(toolsets.values())))
    tools_by_set = dict(zip(toolsets, listed, strict=True))

    env = EnvRef(
        url=url.rstrip("/"),
        token_var=settings.token_var,
        max_turns=settings.max_turns,
        tool_timeout=settings.tool_timeout,
        reset_timeout=settings.reset_timeout,
        model_timeout=settings.model_timeout,
    )
    rows: dict[str, list[Row]] = {split: [] for split in splits}
    for task in tasks:
        messages = []
        if task.get("system_prompt"):
            messages.append({"role": "system", "content": task["system_prompt"]})
        messages.append({"role": "user", "content": task["prompt"]})
        rows[task["split"]].append(
            Row(
                messages=messages,
                metadata=RowMetadata(
                    split=task["split"],
                    index=task["index"],
                    task_id=task["id"],
                    tools=tools_by_set[_toolset(task["tools"])],
                    env=env,
                ),
            )
        )

    outdir.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    everything = [row for split in splits for row in rows[split]]
    for name, chunk in [("all", everything), *rows.items()]:
        path = outdir / f"{name}.jsonl"
        path.write_text("".join(row.model_dump_json() + "\n" for row in chunk))
        counts[path.name] = len(chunk)
    return counts


async def _list_tools(
    url: str, token: str | None, settings: RowSettings, tasks: list[dict[str, Any]]
) -> list[list[dict[str, Any]]]:
    out = []
    for task in tasks:
        try:
            async with EnvClient(url, token=token, timeout=settings.reset_timeout) as client:
                await client.reset(split=task["split"], index=task["index"])
                # The model is shown OpenAI function tools; the server lists MCP tools.
                out.append([tool.openai() for tool in await client.list_tools()])
        except EnvClientError as exc:
            raise RowsError(f"could not play task {task['id']} on {url}: {exc}") from None
    return out


def read_rows(path: Path, *, split: str | None = None, limit: int | None = None) -> list[Row]:
    """Rows from a JSONL file written by :func:`write_rows` (blank lines skipped): those of
    ``split`` only when given, the first ``limit`` when given. :class:`RowsError` naming the
    file and line of the first line that is not a row."""
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(Row.model_validate_json(line))
        except ValueError as exc:
            raise RowsError(f"{path}:{lineno}: not a corral row: {exc}") from None
    chosen = [r for r in rows if split is None or r.metadata.split == split]
    return chosen[:limit] if limit is not None else chosen
