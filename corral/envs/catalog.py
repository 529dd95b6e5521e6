"""What the env server says about its bundle, read-only (:func:`catalog_routes`): the task
API (``GET /splits``, ``/tasks/{split}``, ``/tasks/{split}/{index}``) and OpenEnv's
``GET /schema`` and ``GET /metadata``.

An unknown split or index raises :class:`~corral.envs.bundle.TaskNotFound`, which the app
answers 404 (one handler, registered by :func:`corral.envs.server.build_app`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from pydantic import TypeAdapter

from corral.envs.bundle import Bundle
from corral.envs.episodes import task_tools
from corral.envs.protocol import STEP_ACTION, EpisodeState, Observation


def catalog_routes(bundle: Bundle) -> APIRouter:
    """The task API and OpenEnv's schema and metadata routes of ``bundle``."""
    router = APIRouter()

    @router.get("/splits")
    async def splits() -> dict[str, Any]:
        return {
            "splits": [{"name": s, "tasks": len(bundle.tasks(s))} for s in bundle.splits],
            "group_by": bundle.manifest.eval.group_by,
        }

    @router.get("/tasks/{split}")
    async def tasks(split: str) -> dict[str, Any]:
        found = bundle.tasks(split)
        return {"split": split, "tasks": [{"index": t.index, "id": t.id} for t in found]}

    @router.get("/tasks/{split}/{index}")
    async def task(split: str, index: int) -> dict[str, Any]:
        found = bundle.task(split, index)
        return {
            "id": found.id,
            "split": found.split,
            "index": found.index,
            "system_prompt": bundle.manifest.system_prompt,
            "prompt": found.prompt,
            "max_turns": bundle.manifest.max_turns,
            "tools": task_tools(bundle, found),
            "data": found.data,
        }

    @router.get("/schema")
    async def schema() -> dict[str, Any]:
        return {
            "action": STEP_ACTION.json_schema(),
            "observation": TypeAdapter(Observation).json_schema(),
            "state": EpisodeState.model_json_schema(),
        }

    @router.get("/metadata")
    async def metadata() -> dict[str, Any]:
        readme = Path(bundle.root) / "README.md"
        return {
            "name": bundle.name,
            "description": bundle.manifest.description,
            "version": bundle.manifest.version,
            "readme_content": readme.read_text() if readme.is_file() else None,
            "author": None,
            "documentation_url": None,
        }

    return router
