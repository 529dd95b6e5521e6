"""Shared fixtures: the tiny chat models (built offline once per test run)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen 2.5-style tiny model, imprinted with the tool-calling format."""
    from corral.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", template="qwen25")


@pytest.fixture(scope="session")
def tiny_think_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Qwen3-style variant whose template drops earlier <think> blocks from history."""
    from corral.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny3") / "model", template="qwen3")
