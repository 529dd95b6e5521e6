"""Wiring: a gateway app from an engine URL and a model folder (what ``corral gateway`` runs)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from starlette.applications import Starlette
from transformers import AutoConfig, AutoTokenizer

from corral.engines.affinity import SessionAffineEngines
from corral.engines.client import EngineApi, engine_urls, make_engine_client
from corral.engines.health import HealthMonitor
from corral.engines.protocol import ModelInfo
from corral.engines.sglang import SGLangClient
from corral.engines.vllm import VLLMClient
from corral.gateway.app import build_gateway_app
from corral.gateway.pipeline import TurnPipeline
from corral.gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

# How long the start-up check waits for the engine's /health: SGLang's may run a one-token
# generation and take up to 20 s (the engine client's health probe waits as long).
HEALTH_CHECK_TIMEOUT_S = 30.0
# Several engines: how often each is probed, and how long a probe may take (one GET /health,
# no retry). Two failed probes in a row mark an engine down: a hung one within ~7 s.
ENGINE_PROBE_INTERVAL_S = 2.0
ENGINE_PROBE_TIMEOUT_S = 2.5
# How long loading the current weights into a revived engine may take.
CATCH_UP_TIMEOUT_S = 900.0


def model_context_length(model_path: str | Path) -> int:
    """The model's context window from its config (``max_position_embeddings``)."""
    config = AutoConfig.from_pretrained(str(model_path))
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the context length of the model at {model_path}")


def create_gateway(
    engine_url: str,
    model_path: str | Path,
    *,
    engine_api: EngineApi = "sglang",
    engine_token: str | None = None,
    settings: GatewaySettings | None = None,
    **overrides: Any,
) -> Starlette:
    """A gateway in front of the engine at ``engine_url`` (or the engines it lists,
    comma-separated: each session on one of them), which speaks ``engine_api``:
    SGLang's native API (SGLang, its router, corral's local engine) or vLLM's token API (vLLM
    started with ``--enable-scale-out``); both answer ``GET /health``, which the start-up
    check asks. ``engine_token``: the engines' bearer token (``corral engine --token-var``,
    SGLang's or vLLM's ``--api-key``), sent on every engine request.

    ``model_path`` is a Hugging Face folder: its tokenizer and chat template render prompts
    (the engine's weights may live elsewhere). ``settings`` defaults are filled from the
    model: its folder name as the model name, its context window.

    Several engines: a :class:`~corral.engines.health.HealthMonitor` (:func:`engine_monitor`)
    watches them while the app runs; engines down or serving stale weights get no requests,
    and a request that fails on one before any output is retried on the next
    (:class:`~corral.engines.affinity.SessionAffineEngines`). One engine: no monitor (there
    is nowhere else to go); the start-up check logs whether it answers, and the gateway's
    ``/health`` asks it on every call.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if settings is None:
        settings = GatewaySettings(
            model_name=Path(model_path).name,
            max_context_tokens=model_context_length(model_path),
        )
    settings = replace(settings, **overrides)
    engine = make_engine_client(
        engine_api, engine_url, timeout=settings.engine_timeout_s, api_key=engine_token
    )
    pipeline = TurnPipeline(settings, engine, tokenizer)
    monitor: HealthMonitor | None = None
    if isinstance(engine, SessionAffineEngines):
        monitor = engine.monitor = engine_monitor(engine, engine_api, token=engine_token)

    async def startup_check() -> None:
        if monitor is not None:
            # Its first round logs each engine up or down; then it watches them until the
            # gateway stops (this task is cancelled then).
            await monitor.run()
            return
        for url in engine_urls(engine_url):
            await check_engine(
                url,
                timeout_s=min(settings.engine_timeout_s, HEALTH_CHECK_TIMEOUT_S),
                token=engine_token,
            )

    app = build_gateway_app(
        settings,
        engine,
        pipeline,
        startup_check=startup_check,
        engine_states=engine.engine_states if isinstance(engine, SessionAffineEngines) else None,
    )
    # Where the engines' states can be read (tests, an operator's shell); None for one engine.
    app.state.engine_monitor = monitor
    return app


def engine_monitor(
    engines: SessionAffineEngines,
    engine_api: EngineApi,
    *,
    token: str | None = None,
    interval_s: float = ENGINE_PROBE_INTERVAL_S,
    probe_timeout_s: float = ENGINE_PROBE_TIMEOUT_S,
) -> HealthMonitor:
    """The health monitor of ``engines``: probes each one's ``GET /health`` (one try, no
    retry, ``probe_timeout_s``) every ``interval_s``, and checks the weight version of one
    that comes back (``GET /get_model_info``) against the engines up.

    A stale SGLang engine (SGLang, corral's local engine) is brought current by the gateway:
    an engine that is up reports the folder it last loaded as its ``model_path`` (SGLang sets
    it on every successful ``update_weights_from_disk``, the local engine too), so the
    revived one is sent ``update_weights_from_disk`` with that folder and version (the
    folder must be readable from every engine, as :class:`~corral.trainer.weights.
    DiskWeightSync` already needs). A vLLM engine reports its launch model there, not the
    folder it last reloaded: a stale one is held out until something else loads it."""
    urls = engines.names

    async def probe(index: int) -> str | None:
        return await engine_health_problem(urls[index], timeout_s=probe_timeout_s, token=token)

    async def model_info(index: int) -> ModelInfo:
        return await engines.engines[index].get_model_info()

    async def catch_up(index: int, reference: ModelInfo) -> None:
        client = engines.engines[index]
        if not isinstance(client, SGLangClient) or isinstance(client, VLLMClient):
            raise TypeError(f"cannot load weights into a {type(client).__name__}")
        await client.update_weights_from_disk(
            reference.model_path,
            weight_version=reference.weight_version,
            read_timeout=CATCH_UP_TIMEOUT_S,
        )

    return HealthMonitor(
        urls,
        probe,
        model_info=model_info,
        catch_up=catch_up if engine_api == "sglang" else None,
        interval_s=interval_s,
        probe_timeout_s=probe_timeout_s,
        catch_up_timeout_s=CATCH_UP_TIMEOUT_S,
    )


async def check_engine(
    engine_url: str, *, timeout_s: float = HEALTH_CHECK_TIMEOUT_S, token: str | None = None
) -> None:
    """Log whether the engine at ``engine_url`` answers its health check (``GET /health`` with
    a 2xx, what the gateway's own ``/health`` asks): one INFO line when it does, one WARNING
    naming the URL and what happened when it does not. Never raises: a gateway starts anyway
    (the engine may come up later; until then turns are answered 503). ``token``: the
    engine's bearer token, if it has one."""
    problem = await engine_health_problem(engine_url, timeout_s=timeout_s, token=token)
    if problem is None:
        log.info("the engine at %s answers its health check", engine_url)
    else:
        log.warning(
            "the engine at %s does not answer its health check: %s (starting anyway; "
            "turns fail with 503 until it does)",
            engine_url,
            problem,
        )


async def engine_health_problem(
    engine_url: str, *, timeout_s: float, token: str | None = None
) -> str | None:
    """None when ``GET {engine_url}/health`` answers a 2xx within ``timeout_s``; else what
    happened, in words: ``connection refused``, ``no answer within 30 s``, ``HTTP 503
    Service Unavailable``, or the connection error's own words. ``token`` is sent as a bearer
    when given (corral's engine leaves ``/health`` open; an engine guarding it too still
    answers)."""
    url = engine_url.rstrip("/") + "/health"
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        # One try, no retries: this only decides whether to warn.
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as client,
            client.get(url, allow_redirects=False, headers=headers) as resp,
        ):
            if 200 <= resp.status < 300:
                return None
            return f"HTTP {resp.status} {resp.reason or ''}".rstrip()
    except aiohttp.ClientConnectorError as exc:
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect ({exc.os_error.strerror or exc})"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}: {exc}"
