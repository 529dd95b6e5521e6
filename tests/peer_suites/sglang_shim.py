"""pytest plugin: SGLang's OpenAI-server tests against a corral gateway session.

Loaded as ``-p sglang_shim`` (with this folder on ``PYTHONPATH``) and ``--noconftest`` from the
root of an SGLang checkout; ``scripts/peer_suites.py`` does both. What it replaces, and only that:

- ``sglang.test.test_utils.popen_launch_server``: instead of launching ``sglang.launch_server``
  it opens a gateway session (one per test class, as their ``setUpClass`` does) and returns a
  stand-in process whose ``pid`` ``sglang.srt.utils.kill_process_tree`` closes the session by.
  The server args (``--tool-call-parser llama3`` etc.) are ignored: the gateway runs the parser
  it was started with.
- ``DEFAULT_URL_FOR_TEST``: the gateway's root; the tests append ``/v1`` and use the
  bearer-routed ``/v1/...`` routes, where the key picks the session. Their hard-coded keys are
  replaced by that session's key (see ``peer_shim_common``).
- ``DEFAULT_*MODEL_NAME*`` and ``$QWEN3_8B``: the gateway's served model name.
- ``get_tokenizer``: the gateway model's tokenizer (what the launched server would load).
- ``CustomTestCase``: ``unittest.TestCase`` (SGLang's only adds CI retries).
- ``TEST_RERANK_QUERY_DOCS`` and ``encode_image_base64``: small stand-ins for imports only.
"""

from __future__ import annotations

import base64
import itertools
import os
import sys
import types
import unittest
from dataclasses import dataclass
from typing import Any

import peer_shim_common as common
import pytest

DEFAULT_URL_FOR_TEST = common.GATEWAY
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = 600
TEST_RERANK_QUERY_DOCS = [
    {"query": "How many people live in Berlin?", "documents": ["Berlin has 3.5M people."]},
    {"query": "What is the capital of France?", "documents": ["Paris.", "Lyon is a city."]},
]


@dataclass
class _Process:
    pid: int


_pids = itertools.count(900_000)
_sessions: dict[int, common.GatewaySession] = {}


def popen_launch_server(model: str, base_url: str, *args: Any, **kwargs: Any) -> _Process:
    process = _Process(next(_pids))
    _sessions[process.pid] = common.open_session(f"sglang:{model}")
    return process


def kill_process_tree(pid: int, *args: Any, **kwargs: Any) -> None:
    session = _sessions.pop(pid, None)
    if session is not None:
        common.close_session(session)


def get_tokenizer(name: str, *args: Any, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(common.MODEL_DIR)


def encode_image_base64(data: Any) -> str:
    raw = data if isinstance(data, bytes) else str(data).encode()
    return base64.b64encode(raw).decode()


class CustomTestCase(unittest.TestCase):
    pass


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _install_stubs() -> None:
    _module("sglang", __file__="sglang-shim")
    _module("sglang.srt")
    _module("sglang.srt.utils", kill_process_tree=kill_process_tree)
    _module("sglang.srt.utils.hf_transformers_utils", get_tokenizer=get_tokenizer)
    _module("sglang.srt.hf_transformers_utils", get_tokenizer=get_tokenizer)
    _module("sglang.test")
    _module("sglang.test.runners", TEST_RERANK_QUERY_DOCS=TEST_RERANK_QUERY_DOCS)
    _module(
        "sglang.test.test_utils",
        DEFAULT_URL_FOR_TEST=DEFAULT_URL_FOR_TEST,
        DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH=DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
        DEFAULT_SMALL_MODEL_NAME_FOR_TEST=common.MODEL_NAME,
        DEFAULT_SMALL_MODEL_NAME_FOR_TEST_QWEN=common.MODEL_NAME,
        DEFAULT_SMALL_CROSS_ENCODER_MODEL_NAME_FOR_TEST=common.MODEL_NAME,
        CustomTestCase=CustomTestCase,
        popen_launch_server=popen_launch_server,
    )
    _module("sglang.utils", encode_image_base64=encode_image_base64)
    os.environ.setdefault("QWEN3_8B", common.MODEL_NAME)


_install_stubs()
common.install_auth_rewrites()


def pytest_configure(config: pytest.Config) -> None:
    if common.RESULTS:
        config.pluginmanager.register(common.ResultRecorder(common.RESULTS), "corral-results")
