"""What the gateway needs from an engine: the subset of SGLang's native API it calls.

``corral.engines.sglang.SGLangClient`` implements it over HTTP, for a real SGLang server or
router and for corral's local engine alike; ``corral.engines.vllm.VLLMClient`` implements it
over vLLM's token API (``/inference/v1/generate``). :func:`make_engine_client` picks one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol

from corral.engines.protocol import GenerateRequest, GenerateResponse, ModelInfo
from corral.engines.stream import StreamDelta


class EngineClient(Protocol):
    async def generate(self, req: GenerateRequest) -> GenerateResponse: ...

    def stream(self, req: GenerateRequest) -> AsyncIterator[StreamDelta]: ...

    async def abort(self, rid: str) -> None: ...

    async def health(self) -> bool: ...

    async def get_model_info(self) -> ModelInfo: ...

    async def aclose(self) -> None: ...


EngineApi = Literal["sglang", "vllm"]
ENGINE_APIS: tuple[EngineApi, ...] = ("sglang", "vllm")


def make_engine_client(
    api: EngineApi,
    url: str,
    *,
    timeout: float = 300.0,
    connect_timeout: float = 5.0,
    max_connections: int = 512,
    retries: int = 2,
    api_key: str | None = None,
) -> EngineClient:
    """The client of the engine at ``url`` that speaks ``api``: ``"sglang"`` (SGLang's native
    API: SGLang, its router, corral's local engine) or ``"vllm"`` (vLLM's token API, vLLM
    started with ``--enable-scale-out``). ``url`` may list several engines, comma-separated:
    then each session goes to one of them
    (:class:`~corral.engines.affinity.SessionAffineEngines`). The settings mean what
    ``SGLangClient``'s do (``api_key``: the bearer token sent to every engine listed); a bad
    URL or setting raises ``ValueError``, an unknown ``api`` too."""
    urls = engine_urls(url)
    if len(urls) > 1:
        from corral.engines.affinity import SessionAffineEngines

        clients = [
            make_engine_client(
                api,
                one,
                timeout=timeout,
                connect_timeout=connect_timeout,
                max_connections=max_connections,
                retries=retries,
                api_key=api_key,
            )
            for one in urls
        ]
        return SessionAffineEngines(clients, urls)
    # Imported here: each client module imports this one for the protocol.
    from corral.engines.sglang import SGLangClient
    from corral.engines.vllm import VLLMClient

    cls: type[SGLangClient] | type[VLLMClient]
    if api == "sglang":
        cls = SGLangClient
    elif api == "vllm":
        cls = VLLMClient
    else:
        raise ValueError(f"unknown engine API {api!r}; expected one of {list(ENGINE_APIS)}")
    return cls(
        urls[0],
        timeout=timeout,
        connect_timeout=connect_timeout,
        max_connections=max_connections,
        retries=retries,
        api_key=api_key,
    )


def engine_urls(url: str) -> list[str]:
    """The engine URLs in ``url`` (one, or several comma-separated); ``ValueError`` if none."""
    urls = [one.strip() for one in url.split(",") if one.strip()]
    if not urls:
        raise ValueError(f"no engine URL in {url!r}")
    return urls
