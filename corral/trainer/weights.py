"""Pushing the trainer's weights to the engines that generate the rollouts.

Two paths, one interface (:class:`WeightSync`):

- :class:`DiskWeightSync`: save a Hugging Face folder and have every engine load it
  (``update_weights_from_disk``: SGLang's API, and the local engine's; for vLLM, its in-place
  reload, see :mod:`corral.engines.vllm`). The folder is the version's; older ones are deleted
  once a newer one is loaded everywhere.
- :class:`InProcessWeightSync`: the local engine in this process; the converted tensors are
  copied into its model between two of its steps (no disk, no new model).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from corral.engines.errors import EngineError

if TYPE_CHECKING:
    from corral.engines.local.engine import LocalEngine
    from corral.trainer.model import ModelSpec


class WeightSyncError(RuntimeError):
    """An engine did not take the weights; the message names the engine and its reason."""


class WeightSync(Protocol):
    async def push(self, model: Any, spec: ModelSpec, version: str) -> None:
        """Make every engine serve ``model``'s weights as ``version``, or raise
        :class:`WeightSyncError`."""
        ...


class DiskWeightSync:
    """Weights through ``<out_dir>/<version>`` and ``update_weights_from_disk``; the tokenizer
    files are copied from ``tokenizer_from`` so each folder is a complete model. ``api`` is
    the engines' API: SGLang's (and the local engine's) or vLLM's; ``api_key``, their bearer
    token when they have one (``corral engine --token-var``, ``--api-key``)."""

    def __init__(
        self,
        engines: Sequence[str],
        out_dir: Path,
        *,
        tokenizer_from: Path | None = None,
        api: Literal["sglang", "vllm"] = "sglang",
        api_key: str | None = None,
    ) -> None:
        if not engines:
            raise ValueError("no engine to push weights to")
        self.engines = list(engines)
        self.api = api
        self.out_dir = out_dir
        self.tokenizer_from = tokenizer_from
        self._api_key = api_key
        self._last: Path | None = None

    async def push(self, model: Any, spec: ModelSpec, version: str) -> None:
        from corral.engines.sglang import SGLangClient
        from corral.engines.vllm import VLLMClient
        from corral.trainer.convert import save_hf_checkpoint

        path = await asyncio.to_thread(
            save_hf_checkpoint,
            model,
            spec,
            self.out_dir / version,
            tokenizer_from=self.tokenizer_from,
        )
        # Absolute: each engine resolves the folder on its own side (vLLM would take a
        # relative path for a hub repo id).
        folder = str(await asyncio.to_thread(Path(path).resolve))

        async def load(url: str) -> None:
            try:
                client = VLLMClient if self.api == "vllm" else SGLangClient
                async with client(url, api_key=self._api_key) as engine:
                    await engine.update_weights_from_disk(folder, weight_version=version)
            except EngineError as exc:
                raise WeightSyncError(f"engine {url} did not load {path}: {exc}") from exc

        async with asyncio.TaskGroup() as tg:
            for url in self.engines:
                tg.create_task(load(url))
        if self._last is not None and self._last != path:
            shutil.rmtree(self._last, ignore_errors=True)
        self._last = path


class InProcessWeightSync:
    """Weights straight into a :class:`~corral.engines.local.engine.LocalEngine` running in
    this process (on its own loop, usually a server thread's)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    async def push(self, model: Any, spec: ModelSpec, version: str) -> None:
        from corral.trainer.convert import megatron_state_dict, megatron_to_hf

        loop = self.engine.loop
        if loop is None:
            raise WeightSyncError("the local engine is not running")
        tensors = await asyncio.to_thread(lambda: megatron_to_hf(megatron_state_dict(model), spec))
        update = self.engine.update_weights_from_tensors(tensors, weight_version=version)
        answer = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(update, loop))
        if not answer.success:
            raise WeightSyncError(f"the local engine did not take the weights: {answer.message}")


class FollowerWeightSync:
    """A trainer rank other than the leader: takes its part in gathering the weights from
    the tensor-parallel shards (a collective) and pushes nothing; ``in_memory`` mirrors the
    leader's :class:`InProcessWeightSync`, else its :class:`DiskWeightSync` (whose folder only
    the writing rank writes)."""

    def __init__(self, *, in_memory: bool, out_dir: Path) -> None:
        self.in_memory = in_memory
        self.out_dir = out_dir

    async def push(self, model: Any, spec: ModelSpec, version: str) -> None:
        from corral.trainer.convert import megatron_state_dict, megatron_to_hf, save_hf_checkpoint

        if self.in_memory:
            await asyncio.to_thread(lambda: megatron_to_hf(megatron_state_dict(model), spec))
        else:
            await asyncio.to_thread(save_hf_checkpoint, model, spec, self.out_dir / version)
