"""What the gateway needs from an engine: the subset of SGLang's native API it calls.

``corral.engines.sglang.SGLangClient`` implements it over HTTP, for a real SGLang server or
router and for corral's local engine alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from corral.engines.protocol import GenerateRequest, GenerateResponse, ModelInfo
from corral.engines.stream import StreamDelta


class EngineClient(Protocol):
    async def generate(self, req: GenerateRequest) -> GenerateResponse: ...

    def stream(self, req: GenerateRequest) -> AsyncIterator[StreamDelta]: ...

    async def abort(self, rid: str) -> None: ...

    async def health(self) -> bool: ...

    async def get_model_info(self) -> ModelInfo: ...

    async def aclose(self) -> None: ...
