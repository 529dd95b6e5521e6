"""What both peer-suite shims share: gateway sessions, auth rewriting and result recording.

The shims stand in for the peers' server fixtures (vLLM's ``RemoteOpenAIServer``, SGLang's
``popen_launch_server``): instead of launching an engine they open a session on a live corral
gateway. ``scripts/peer_suites.py`` starts that gateway and passes it in the environment:

- ``CORRAL_PEER_GATEWAY``: the gateway's root URL (``http://127.0.0.1:PORT``);
- ``CORRAL_PEER_ADMIN_TOKEN``: its admin token (sessions are created and deleted with it);
- ``CORRAL_PEER_MODEL_NAME`` / ``CORRAL_PEER_MODEL_DIR``: the served model name and folder;
- ``CORRAL_PEER_CHECKOUT``: the root of the peer's checkout whose tests run;
- ``CORRAL_PEER_RESULTS``: where the per-test outcomes are written as JSON.

The peers' tests hard-code API keys (``sk-123456``, ``EMPTY``) that are no gateway session's
key. The OpenAI clients and ``requests`` calls aimed at the gateway get the right session's key
instead: that is the server fixture's job (a server started with ``--api-key``), nothing else of
the request is touched.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import httpx

GATEWAY = os.environ.get("CORRAL_PEER_GATEWAY", "http://127.0.0.1:8000").rstrip("/")
ADMIN_TOKEN = os.environ.get("CORRAL_PEER_ADMIN_TOKEN", "")
MODEL_NAME = os.environ.get("CORRAL_PEER_MODEL_NAME", "corral-tiny")
MODEL_DIR = os.environ.get("CORRAL_PEER_MODEL_DIR", "")
CHECKOUT = os.environ.get("CORRAL_PEER_CHECKOUT", os.getcwd())
RESULTS = os.environ.get("CORRAL_PEER_RESULTS", "")

_SESSION_IN_URL = re.compile(r"/sessions/([^/?#]+)")


@dataclass
class GatewaySession:
    id: str
    api_key: str
    base_url: str  # .../sessions/{id}/v1, what an OpenAI client is pointed at

    @property
    def root(self) -> str:
        """The session's URL without ``/v1`` (what a peer's ``url_root`` would be)."""
        return self.base_url.removesuffix("/v1")


_keys: dict[str, str] = {}
_current: list[GatewaySession] = []  # the session opened last and not yet closed


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"} if ADMIN_TOKEN else {}


def open_session(label: str) -> GatewaySession:
    """A fresh gateway session, labelled in its metadata with the peer test that asked."""
    r = httpx.post(
        f"{GATEWAY}/sessions",
        headers=_admin(),
        json={"metadata": {"peer_suite": label}},
        timeout=30,
    )
    r.raise_for_status()
    body = r.json()
    session = GatewaySession(id=body["id"], api_key=body["api_key"], base_url=body["base_url"])
    _keys[session.id] = session.api_key
    _current.append(session)
    return session


def close_session(session: GatewaySession) -> None:
    httpx.delete(f"{GATEWAY}/sessions/{session.id}", headers=_admin(), timeout=30)
    _keys.pop(session.id, None)
    if session in _current:
        _current.remove(session)


def key_for_url(url: str) -> str | None:
    """The session key a request to ``url`` must carry; None for URLs off the gateway."""
    if not url.startswith(GATEWAY):
        return None
    match = _SESSION_IN_URL.search(url[len(GATEWAY) :])
    if match and match.group(1) in _keys:
        return _keys[match.group(1)]
    return _current[-1].api_key if _current else None


def install_auth_rewrites() -> None:
    """OpenAI clients and ``requests`` calls aimed at the gateway carry the session's key."""
    import openai

    for cls in (openai.OpenAI, openai.AsyncOpenAI):
        _wrap_client_init(cls)

    try:
        import requests
    except ImportError:
        return
    original = requests.Session.request
    if getattr(original, "_corral_peer_shim", False):
        return

    @functools.wraps(original)
    def request(self: Any, method: str, url: Any, *args: Any, **kwargs: Any) -> Any:
        key = key_for_url(str(url))
        if key is not None:
            headers = dict(kwargs.get("headers") or {})
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            headers["Authorization"] = f"Bearer {key}"
            kwargs["headers"] = headers
        return original(self, method, url, *args, **kwargs)

    request._corral_peer_shim = True  # type: ignore[attr-defined]
    requests.Session.request = request  # type: ignore[method-assign]


def _wrap_client_init(cls: Any) -> None:
    original = cls.__init__
    if getattr(original, "_corral_peer_shim", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base = kwargs.get("base_url") or os.environ.get("OPENAI_BASE_URL")
        key = key_for_url(str(base)) if base else None
        if key is not None:
            kwargs["api_key"] = key
        original(self, *args, **kwargs)

    __init__._corral_peer_shim = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


class ResultRecorder:
    """A pytest plugin writing each test's outcome and first failure line to RESULTS."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.results: dict[str, dict[str, str]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
        if entry["outcome"] in ("failed", "error"):
            return  # keep the first failure (a teardown error after a failed call adds nothing)
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = _crash_message(report)
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            longrepr = report.longrepr
            entry["message"] = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)

    def pytest_sessionfinish(self, session: Any) -> None:
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.results, f, indent=1, sort_keys=True)


def _crash_message(report: Any) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return " ".join(text.split())[:600]
