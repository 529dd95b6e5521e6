"""Wiring: a gateway app from an engine URL and a model folder (what ``corral gateway`` runs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from transformers import AutoConfig, AutoTokenizer

from corral.engines.sglang import SGLangClient
from corral.gateway.app import build_gateway_app
from corral.gateway.pipeline import TurnPipeline
from corral.gateway.settings import GatewaySettings


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
    settings: GatewaySettings | None = None,
    **overrides: Any,
) -> Starlette:
    """A gateway in front of the SGLang-API engine at ``engine_url``.

    ``model_path`` is a Hugging Face folder: its tokenizer and chat template render prompts
    (the engine's weights may live elsewhere). ``settings`` defaults are filled from the
    model: its folder name as the model name, its context window.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if settings is None:
        settings = GatewaySettings(
            model_name=Path(model_path).name,
            max_context_tokens=model_context_length(model_path),
        )
    settings = replace(settings, **overrides)
    engine = SGLangClient(engine_url, timeout=settings.engine_timeout_s)
    pipeline = TurnPipeline(settings, engine, tokenizer)
    return build_gateway_app(settings, engine, pipeline)
