"""Shared fixtures: the tiny chat models, built offline (cached across runs by source hash)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The Qwen 2.5-style tiny model, imprinted with the tool-calling format."""
    from corral.engines.tiny_model import cached_tiny_model

    return cached_tiny_model("qwen25")


@pytest.fixture(scope="session")
def tiny_think_model_dir() -> Path:
    """The Qwen3-style variant whose template drops earlier <think> blocks from history."""
    from corral.engines.tiny_model import cached_tiny_model

    return cached_tiny_model("qwen3")
