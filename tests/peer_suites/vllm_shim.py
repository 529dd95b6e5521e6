"""pytest plugin: vLLM's OpenAI-server tests against a corral gateway session.

Loaded as ``-p vllm_shim`` (with this folder on ``PYTHONPATH``) and ``--noconftest`` from the
root of a vLLM checkout; ``scripts/peer_suites.py`` does both. What it replaces, and only that:

- ``tests.utils.RemoteOpenAIServer``: instead of ``vllm serve`` it opens a gateway session for
  the module; ``get_client`` / ``get_async_client`` / ``url_for`` point at that session, with
  ``max_retries=0`` and a 600 s timeout as vLLM's does. The server args are ignored.
- ``tests.utils.ROCM_*``: empty.
- ``huggingface_hub.snapshot_download``: a placeholder path (the LoRA download that feeds
  ``test_chat.py``'s server args; nothing is downloaded, the gateway serves no LoRA).
- ``vllm.config.ModelConfig``: only ``get_vocab_size()``, read from the gateway model's config.
- ``vllm``'s protocol classes (``ChatCompletionRequest``, ``SamplingParams``): the few unit
  tests that build them in-process (no HTTP) are skipped, they test vLLM's own code.
- ``tests/entrypoints/conftest.py`` (``sample_json_schema`` and friends) is registered as is;
  vLLM's root conftest (torch, vllm, model downloads) is not loaded.

MODEL_NAME constants are left as they are: the gateway serves one model whatever the request's
``model`` says, so requests carry vLLM's model names unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import openai
import peer_shim_common as common
import pytest

ROCM_ENV_OVERRIDES: dict[str, str] = {}
ROCM_EXTRA_ARGS: list[str] = []


class RemoteOpenAIServer:
    """A gateway session in place of a ``vllm serve`` process."""

    DUMMY_API_KEY = "token-abc123"  # vLLM's; replaced by the session key on the way out

    def __init__(self, model: str, vllm_serve_args: Any = (), **kwargs: Any) -> None:
        self.model = model
        self.args = list(vllm_serve_args)
        self.session: common.GatewaySession | None = None

    def __enter__(self) -> RemoteOpenAIServer:
        self.session = common.open_session(f"vllm:{self.model}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.session is not None:
            common.close_session(self.session)
            self.session = None

    def _session(self) -> common.GatewaySession:
        if self.session is None:
            raise RuntimeError("RemoteOpenAIServer used outside its with-block")
        return self.session

    @property
    def url_root(self) -> str:
        return self._session().root

    @property
    def host(self) -> str:
        return common.GATEWAY.split("://", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(common.GATEWAY.rsplit(":", 1)[1])

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(parts)

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=self._session().api_key, max_retries=0, **kwargs
        )

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self._session().api_key, max_retries=0, **kwargs
        )


class ModelConfig:
    def __init__(self, model: str = "", **kwargs: Any) -> None:
        self.model = model

    def get_vocab_size(self) -> int:
        config = json.loads((Path(common.MODEL_DIR) / "config.json").read_text())
        return int(config["vocab_size"])


def _in_process_only(*args: Any, **kwargs: Any) -> Any:
    pytest.skip("builds vLLM's own request/sampling classes in-process: no wire protocol")


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # every stub may have stub children
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _install_stubs() -> None:
    tests_dir = Path(common.CHECKOUT) / "tests"
    tests = _module("tests")
    tests.__path__ = [str(tests_dir)]
    _module(
        "tests.utils",
        RemoteOpenAIServer=RemoteOpenAIServer,
        ROCM_ENV_OVERRIDES=ROCM_ENV_OVERRIDES,
        ROCM_EXTRA_ARGS=ROCM_EXTRA_ARGS,
    )
    _module("vllm")
    _module("vllm.config", ModelConfig=ModelConfig)
    _module("vllm.sampling_params", SamplingParams=_in_process_only)
    _module("vllm.entrypoints")
    _module("vllm.entrypoints.openai")
    _module("vllm.entrypoints.openai.chat_completion")
    _module(
        "vllm.entrypoints.openai.chat_completion.protocol",
        ChatCompletionRequest=_in_process_only,
    )
    try:
        import huggingface_hub
    except ImportError:
        huggingface_hub = _module("huggingface_hub")
    huggingface_hub.snapshot_download = lambda repo_id, **kw: f"/nonexistent/{repo_id}"


_install_stubs()
common.install_auth_rewrites()


def pytest_configure(config: pytest.Config) -> None:
    fixtures = Path(common.CHECKOUT) / "tests" / "entrypoints" / "conftest.py"
    if fixtures.exists():
        spec = importlib.util.spec_from_file_location("vllm_entrypoints_conftest", fixtures)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config.pluginmanager.register(module, "vllm-entrypoints-conftest")
    if common.RESULTS:
        config.pluginmanager.register(common.ResultRecorder(common.RESULTS), "corral-results")
