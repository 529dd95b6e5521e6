#!/usr/bin/env python3
"""Run vLLM's and SGLang's chat-completions test files against a live corral gateway.

    python scripts/peer_suites.py --vllm-tests ~/src/vllm --sglang-tests ~/src/sglang

Each DIR is the root of a checkout of that project (only its test files are read, nothing of
it is imported or installed). The script starts the tiny model's local engine and a gateway on
127.0.0.1, runs the peer files below with pytest and the shims of ``tests/peer_suites/`` (which
replace only the peers' server fixtures: every test talks to a gateway session), then prints
per file how many passed and how many failed, by class:

- protocol: the gateway answers what OpenAI's API would not (field, chunk shape, status, route);
- model: the tiny model's content (it only learnt a weather tool-call format), not the protocol;
- peer: a vLLM/SGLang-only extension or route (LoRA, structured_outputs, prompt_logprobs,
  /invocations, rerank...) or in-process unit test;
- unclassified: a failure ``tests/peer_suites/classification.py`` does not know (new: look!).

Per-cause lists follow the table. Then the wire probes run (one request per protocol point,
P1-P18 of ``tests/peer_suites/README.md``; ``--no-probes`` skips them), and with
``--clients-python VENV/bin/python`` LiteLLM and LangChain's ChatOpenAI are tried on a session.
``--json PATH`` writes every outcome with its class and cause, the probes and the clients' output.
``--corral-src DIR`` runs another corral tree (e.g. ``git archive HEAD corral`` unpacked) than
the one this script is in. Exit status 1 when any failure is unclassified, 0 otherwise
(``--strict`` also fails on protocol failures and failed probes).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
SHIMS = REPO / "tests" / "peer_suites"
sys.path.insert(0, str(SHIMS))

from classification import CAUSES, classify  # noqa: E402

VLLM_FILES = [
    "tests/entrypoints/openai/chat_completion/test_chat.py",
    "tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py",
    "tests/entrypoints/openai/chat_completion/test_chat_echo.py",
    "tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py",
    "tests/entrypoints/openai/chat_completion/test_chat_completion.py",
]
SGLANG_FILES = [
    "test/srt/openai_server/basic/test_openai_server.py",
    "test/srt/openai_server/function_call/test_openai_function_calling.py",
    "test/srt/openai_server/function_call/test_tool_choice.py",
    "test/srt/openai_server/function_call/test_parallel_tool_calls.py",
    "test/srt/openai_server/validation/test_request_body_validation.py",
]
CLASSES = ["protocol", "model", "peer", "unclassified"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url} exited with {proc.returncode}; its log:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"{url} not healthy after {timeout:.0f} s; log: {log}")


class Stack:
    """The tiny model's local engine and a corral gateway, on loopback, for the run's length."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(args.corral_src), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        self.admin_token = secrets.token_hex(16)
        self.env["CORRAL_PEER_SUITES_ADMIN"] = self.admin_token
        self.procs: list[subprocess.Popen[bytes]] = []
        self.model_dir = Path(args.model) if args.model else self._tiny_model()
        self.tools = self._probe_tools()
        self.gateway = ""

    def _tiny_model(self) -> Path:
        code = "from corral.engines.tiny_model import cached_tiny_model; print(cached_tiny_model())"
        print("building (or reusing) the tiny model ...", flush=True)
        out = subprocess.run(
            [sys.executable, "-c", code], env=self.env, check=True, capture_output=True, text=True
        )
        return Path(out.stdout.strip().splitlines()[-1])

    def _probe_tools(self) -> list[dict[str, Any]]:
        """The tools the tiny model was imprinted with (its contract holds for exactly those)."""
        if not (self.model_dir / "corral_build.json").exists():
            return [WEATHER_TOOL]
        code = "import json; from corral.engines.tiny_model import TOOLS; print(json.dumps(TOOLS))"
        out = subprocess.run(
            [sys.executable, "-c", code], env=self.env, capture_output=True, text=True
        )
        return json.loads(out.stdout) if out.returncode == 0 else [WEATHER_TOOL]

    def _spawn(self, name: str, argv: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.workdir / f"{name}.log"
        cmd = [sys.executable, "-c", "import sys; from corral.cli import main; sys.exit(main())"]
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                cmd + argv, env=self.env, stdout=f, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        self.procs.append(proc)
        return proc, log

    def __enter__(self) -> Stack:
        engine_port, gateway_port = free_port(), free_port()
        engine_url = f"http://127.0.0.1:{engine_port}"
        self.gateway = f"http://127.0.0.1:{gateway_port}"
        engine_argv = ["engine", "--model", str(self.model_dir), "--host", "127.0.0.1"]
        engine_argv += ["--port", str(engine_port)]
        engine, log = self._spawn("engine", engine_argv)
        wait_healthy(f"{engine_url}/health", engine, log, 180)
        gateway_argv = ["gateway", "--engine-url", engine_url, "--model", str(self.model_dir)]
        gateway_argv += ["--host", "127.0.0.1", "--port", str(gateway_port)]
        gateway_argv += ["--admin-token-var", "CORRAL_PEER_SUITES_ADMIN"]
        gateway_argv += ["--tool-call-parser", self.args.tool_call_parser]
        gateway_argv += ["--served-model-name", self.args.served_model_name]
        if self.args.reasoning_parser:
            gateway_argv += ["--reasoning-parser", self.args.reasoning_parser]
        gateway, log = self._spawn("gateway", gateway_argv)
        wait_healthy(f"{self.gateway}/health", gateway, log, 180)
        print(f"engine {engine_url}, gateway {self.gateway}, model {self.model_dir}", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_suite(
    stack: Stack, suite: str, checkout: Path, files: list[str], args: argparse.Namespace
) -> dict[str, dict[str, str]]:
    present = [f for f in files if (checkout / f).exists()]
    for missing in sorted(set(files) - set(present)):
        print(f"[{suite}] not in the checkout, skipped: {missing}", flush=True)
    if not present:
        return {}
    results_path = stack.workdir / f"{suite}-results.json"
    env = dict(stack.env)
    env["PYTHONPATH"] = os.pathsep.join([str(SHIMS), env["PYTHONPATH"]])
    env.update(
        CORRAL_PEER_GATEWAY=stack.gateway,
        CORRAL_PEER_ADMIN_TOKEN=stack.admin_token,
        CORRAL_PEER_MODEL_NAME=args.served_model_name,
        CORRAL_PEER_MODEL_DIR=str(stack.model_dir),
        CORRAL_PEER_CHECKOUT=str(checkout),
        CORRAL_PEER_RESULTS=str(results_path),
    )
    for var in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "pytest", "-c", str(SHIMS / "pytest.ini")]
    cmd += ["--rootdir", str(checkout), "--noconftest", "-p", f"{suite}_shim"]
    cmd += ["-p", "no:cacheprovider", "-q", "-rN", "--tb=line"]
    cmd += ["--timeout", str(args.timeout)]
    if args.k:
        cmd += ["-k", args.k]
    cmd += present
    print(f"[{suite}] {' '.join(cmd[3:])}", flush=True)
    log = stack.workdir / f"{suite}-pytest.log"
    with open(log, "wb") as f:
        subprocess.run(cmd, cwd=checkout, env=env, stdout=f, stderr=subprocess.STDOUT)
    if not results_path.exists():
        sys.exit(f"[{suite}] pytest wrote no results; its log:\n{log.read_text()[-4000:]}")
    results: dict[str, dict[str, str]] = json.loads(results_path.read_text())
    return results


def report(all_results: dict[str, dict[str, dict[str, str]]]) -> tuple[list[dict[str, Any]], int]:
    rows: list[dict[str, Any]] = []
    for suite, results in all_results.items():
        for nodeid, r in sorted(results.items()):
            row = {"suite": suite, "test": nodeid, **r, "class": "", "cause": ""}
            if r["outcome"] in ("failed", "error"):
                row["class"], row["cause"] = classify(suite, nodeid, r["message"])
            rows.append(row)

    per_file: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    for row in rows:
        key = (row["suite"], row["test"].split("::", 1)[0])
        per_file[key][row["class"] or row["outcome"]] += 1
    header = ["suite", "file", "passed", *CLASSES, "skipped"]
    table = [header]
    totals: Counter[str] = Counter()
    for (suite, path), counts in sorted(per_file.items()):
        totals.update(counts)
        table.append([suite, Path(path).name, *(str(counts[c]) for c in header[2:])])
    table.append(["all", "", *(str(totals[c]) for c in header[2:])])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    print()
    for i, r in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)))
        if i == 0 or i == len(table) - 2:
            print("  ".join("-" * w for w in widths))

    by_cause: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["class"]:
            by_cause[row["cause"]].append(row)
    order = {cause: i for i, cause in enumerate(CAUSES)}
    for cls in CLASSES:
        causes = sorted(
            (c for c, rs in by_cause.items() if rs[0]["class"] == cls),
            key=lambda c: order.get(c, len(order)),
        )
        if not causes:
            continue
        print(f"\n== {cls} failures")
        for cause in causes:
            print(f"\n[{cause}] {CAUSES.get(cause, ('', cause))[1]}")
            for row in by_cause[cause]:
                line = f"  {row['suite']}: {row['test']}"
                if cls == "unclassified":
                    line += f"\n      {row['message'][:300]}"
                print(line)
    return rows, totals["unclassified"]


# -- wire probes ----------------------------------------------------------------------------------
# Single requests that check one point of OpenAI's chat-completions protocol each, on a fresh
# session: the known causes of the peers' failures, and what their files do not reach. Each
# returns (ok, what the gateway did). The ids match tests/peer_suites/README.md.

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = [{"role": "user", "content": "Say hello."}]


class Wire:
    def __init__(
        self, gateway: str, admin_token: str, model: str, tools: list[dict[str, Any]]
    ) -> None:
        self.gateway = gateway
        self.model = model
        self.tools = tools
        admin = {"Authorization": f"Bearer {admin_token}"}
        body = httpx.post(f"{gateway}/sessions", headers=admin, json={}, timeout=30).json()
        self.base_url = body["base_url"]
        self.api_key = body["api_key"]
        self.auth = {"Authorization": f"Bearer {self.api_key}"}

    def chat(self, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return httpx.post(
            f"{self.base_url}/chat/completions",
            headers={**self.auth, **kwargs.pop("headers", {})},
            json=body if "content" not in kwargs else None,
            timeout=120,
            **kwargs,
        )

    def chunks(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        r = self.chat({**body, "stream": True})
        out = []
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
        return out


def _status(r: httpx.Response, want: int) -> tuple[bool, str]:
    return r.status_code == want, f"{r.status_code} {r.text[:220]}"


def _each(wire: Wire, bodies: dict[str, dict[str, Any]], want: int) -> tuple[bool, str]:
    bad = []
    for name, body in bodies.items():
        r = wire.chat({"messages": HELLO, "max_tokens": 3, **body})
        if r.status_code != want:
            bad.append(f"{name}: {r.status_code} {r.text[:120]}")
    return not bad, "; ".join(bad) or f"all {want}"


def probe_final_chunk(wire: Wire) -> tuple[bool, str]:
    # max_tokens 1: the one engine delta holds the text and the finish reason together.
    for chunk in wire.chunks({"messages": HELLO, "max_tokens": 1, "temperature": 0}):
        indexes = [c["index"] for c in chunk["choices"]]
        if len(indexes) != len(set(indexes)):
            return False, "chunk choices " + json.dumps(chunk["choices"])[:300]
    return True, "one entry per index per chunk"


def probe_tool_call_entries(wire: Wire) -> tuple[bool, str]:
    for chunk in wire.chunks({"messages": WEATHER, "tools": wire.tools, "temperature": 0}):
        for choice in chunk["choices"]:
            calls = choice["delta"].get("tool_calls") or []
            indexes = [c["index"] for c in calls]
            if len(indexes) != len(set(indexes)):
                return False, "delta.tool_calls " + json.dumps(calls)[:300]
    return True, "one entry per tool-call index per delta"


def probe_response_format(wire: Wire) -> tuple[bool, str]:
    schema = {"name": "r", "schema": {"type": "object"}}
    return _each(
        wire,
        {
            "json_object": {"response_format": {"type": "json_object"}},
            "json_schema": {"response_format": {"type": "json_schema", "json_schema": schema}},
        },
        200,
    )


def probe_sampling_fields(wire: Wire) -> tuple[bool, str]:
    return _each(
        wire,
        {
            "logit_bias": {"logit_bias": {"5": 1.0}},
            "frequency_penalty": {"frequency_penalty": 0.5},
            "presence_penalty": {"presence_penalty": 0.5},
        },
        200,
    )


def probe_models_retrieve(wire: Wire) -> tuple[bool, str]:
    r = httpx.get(f"{wire.base_url}/models/{wire.model}", headers=wire.auth, timeout=30)
    ok = r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json")
    return ok, f"{r.status_code} {r.headers.get('content-type')} {r.text[:120]}"


def probe_seed_range(wire: Wire) -> tuple[bool, str]:
    return _each(wire, {"2**63": {"seed": 2**63}, "-2**63-1": {"seed": -(2**63) - 1}}, 400)


def probe_tool_schema(wire: Wire) -> tuple[bool, str]:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "unknown_type"}}},
        },
    }
    return _status(wire.chat({"messages": WEATHER, "tools": [tool], "max_tokens": 3}), 400)


def probe_parallel_false(wire: Wire) -> tuple[bool, str]:
    body = {"messages": WEATHER, "tools": wire.tools, "parallel_tool_calls": False}
    return _status(wire.chat(body), 200)


def probe_nullable(wire: Wire) -> tuple[bool, str]:
    names = ["logprobs", "top_logprobs", "n", "stream", "stream_options", "temperature", "stop"]
    return _each(wire, {name: {name: None} for name in names}, 200)


def probe_newer_fields(wire: Wire) -> tuple[bool, str]:
    return _each(
        wire,
        {
            "reasoning_effort": {"reasoning_effort": "low"},
            "store": {"store": False},
            "service_tier": {"service_tier": "auto"},
            "prompt_cache_key": {"prompt_cache_key": "k1"},
            "safety_identifier": {"safety_identifier": "user-1"},
            "verbosity": {"verbosity": "medium"},
            "modalities": {"modalities": ["text"]},
            "audio=null": {"audio": None},
            "prediction=null": {"prediction": None},
            "web_search_options=null": {"web_search_options": None},
        },
        200,
    )


def probe_include_obfuscation(wire: Wire) -> tuple[bool, str]:
    body = {"messages": HELLO, "stream": True}
    body["stream_options"] = {"include_usage": True, "include_obfuscation": False}
    return _status(wire.chat(body), 200)


def probe_history_echo(wire: Wire) -> tuple[bool, str]:
    # An assistant turn as openai's ChatCompletionMessage.model_dump() gives it back.
    echoed = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}
    return _each(
        wire,
        {
            "model_dump": {"messages": [*WEATHER, echoed, tool], "tools": wire.tools},
            "refusal part": {"messages": [*HELLO, refusal, *HELLO]},
        },
        200,
    )


def probe_top_k(wire: Wire) -> tuple[bool, str]:
    return _each(wire, {"top_k=0": {"top_k": 0}, "top_k=-2": {"top_k": -2}}, 400)


def probe_named_prefill(wire: Wire) -> tuple[bool, str]:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": WEATHER, "tools": wire.tools, "tool_choice": choice, "temperature": 0}
    r = wire.chat(body)
    message = r.json()["choices"][0]["message"] if r.status_code == 200 else {}
    return bool(message.get("tool_calls")), f"{r.status_code} {json.dumps(message)[:220]}"


def probe_json_errors(wire: Wire) -> tuple[bool, str]:
    bad = []
    for method, url in (
        ("GET", f"{wire.base_url}/nope"),
        ("GET", f"{wire.base_url}/chat/completions"),
    ):
        r = httpx.request(method, url, headers=wire.auth, timeout=30)
        try:
            r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            bad.append(f"{method} {url.rsplit('/v1', 1)[1]}: {r.status_code} {r.text[:40]!r}")
    return not bad, "; ".join(bad) or "JSON error bodies"


def probe_error_param(wire: Wire) -> tuple[bool, str]:
    r = wire.chat({"messages": HELLO, "tool_choice": "required"})
    error = r.json().get("error", {}) if r.status_code == 400 else {}
    return error.get("param") == "tool_choice", f"{r.status_code} {r.text[:220]}"


def probe_content_type(wire: Wire) -> tuple[bool, str]:
    body = json.dumps({"messages": HELLO, "max_tokens": 3})
    r = wire.chat({}, content=body, headers={"Content-Type": "text/plain"})
    return _status(r, 400)


PROBES: list[tuple[str, str, Any]] = [
    ("P1", "one entry per choice index in every chunk (finish chunk)", probe_final_chunk),
    ("P2", "response_format json_object / json_schema accepted", probe_response_format),
    ("P3/P4", "logit_bias, frequency_penalty, presence_penalty accepted", probe_sampling_fields),
    ("P5", "GET /v1/models/{model} answers the model", probe_models_retrieve),
    ("P6", "seed outside int64 is a 400", probe_seed_range),
    ("P7", "function parameters that are no JSON Schema are a 400", probe_tool_schema),
    ("P8", "parallel_tool_calls: false accepted", probe_parallel_false),
    ("P9", "null accepted for optional request fields", probe_nullable),
    ("P10", "current OpenAI request fields accepted", probe_newer_fields),
    ("P11", "stream_options.include_obfuscation accepted", probe_include_obfuscation),
    ("P12", "history as the SDK returns it (annotations, audio, refusal)", probe_history_echo),
    ("P13", "top_k 0 or < -1 is a 400, not a 502", probe_top_k),
    ("P14", "named tool_choice yields the call (weather prompt)", probe_named_prefill),
    ("P15", "one entry per tool-call index in a delta", probe_tool_call_entries),
    ("P16", "unknown route / wrong method answer an OpenAI error body", probe_json_errors),
    ("P17", "cross-field 400s name their param (tool_choice)", probe_error_param),
    ("P18", "a body sent as text/plain is a 400", probe_content_type),
]


def run_probes(stack: Stack, model: str) -> list[dict[str, Any]]:
    wire = Wire(stack.gateway, stack.admin_token, model, stack.tools)
    rows = []
    print("\n== wire probes (fresh session; see tests/peer_suites/README.md)")
    for pid, title, probe in PROBES:
        try:
            ok, actual = probe(wire)
        except Exception as exc:  # a probe that breaks is a failed probe, shown
            ok, actual = False, f"{type(exc).__name__}: {exc}"
        rows.append({"probe": pid, "title": title, "ok": ok, "actual": actual})
        print(
            f"  {'ok  ' if ok else 'FAIL'} {pid:6} {title}" + ("" if ok else f"\n         {actual}")
        )
    return rows


CLIENTS = r"""
import os, sys
base, key = os.environ["CLIENT_BASE_URL"], os.environ["CLIENT_API_KEY"]
import json
hello = [{"role": "user", "content": "Say hello."}]
weather = [{"role": "user", "content": "What is the weather in Paris?"}]
tools = json.loads(os.environ["CLIENT_TOOLS"])
def check(name, fn):
    try:
        print(f"ok    {name}: {fn()}")
    except Exception as exc:
        print(f"FAIL  {name}: {type(exc).__name__}: {str(exc)[:300]}")
try:
    import litellm
    from importlib.metadata import version
    litellm.suppress_debug_info = True
    print("litellm", version("litellm"))
    def ll_stream(messages, **kw):
        out = litellm.completion(model="openai/corral", api_base=base, api_key=key,
                                 messages=messages, stream=True, **kw)
        chunks = list(out)
        return repr(litellm.stream_chunk_builder(chunks).choices[0].message)[:200]
    check("litellm stream, ends on length", lambda: ll_stream(hello, max_tokens=1))
    check("litellm stream, ends on stop", lambda: ll_stream(hello, temperature=0))
    check("litellm stream, tool call", lambda: ll_stream(weather, tools=tools, temperature=0))
except ImportError as exc:
    print("litellm not importable:", exc)
try:
    from langchain_openai import ChatOpenAI
    from importlib.metadata import version
    print("langchain-openai", version("langchain-openai"))
    llm = ChatOpenAI(model="corral", base_url=base, api_key=key, temperature=0)
    check("langchain invoke", lambda: llm.invoke(hello).content[:80])
    check("langchain stream", lambda: "".join(c.content for c in llm.stream(hello))[:80])
    check("langchain stream, ends on length",
          lambda: "".join(c.content for c in llm.bind(max_tokens=1).stream(hello))[:80])
    bound = llm.bind_tools(tools)
    check("langchain tool call", lambda: bound.invoke(weather).tool_calls)
    def lc_stream_tools():
        acc = None
        for c in bound.stream(weather):
            acc = c if acc is None else acc + c
        return acc.tool_calls
    check("langchain streamed tool call", lc_stream_tools)
    def lc_multi_turn():
        ai = bound.invoke(weather)
        result = {"role": "tool", "tool_call_id": ai.tool_calls[0]["id"], "content": "sunny"}
        return bound.invoke([*weather, ai, result]).content[:80]
    check("langchain multi-turn with tool result", lc_multi_turn)
except ImportError as exc:
    print("langchain-openai not importable:", exc)
"""


def run_clients(stack: Stack, model: str, python: Path) -> str:
    wire = Wire(stack.gateway, stack.admin_token, model, stack.tools)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp")}
    env.update(CLIENT_BASE_URL=wire.base_url, CLIENT_API_KEY=wire.api_key)
    env["CLIENT_TOOLS"] = json.dumps(stack.tools)
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # no fetch of the cost map from the web
    out = subprocess.run(
        [str(python), "-c", CLIENTS], env=env, capture_output=True, text=True, timeout=600
    )
    text = out.stdout + (out.stderr[-2000:] if out.returncode else "")
    print("\n== third-party clients (" + str(python) + ")\n" + text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-tests", type=Path, help="root of a vLLM checkout")
    parser.add_argument("--sglang-tests", type=Path, help="root of an SGLang checkout")
    parser.add_argument("--corral-src", type=Path, default=REPO, help="corral tree to run")
    parser.add_argument("--model", help="model folder (default: the cached tiny model)")
    parser.add_argument("--served-model-name", default="corral-tiny")
    parser.add_argument("--tool-call-parser", default="qwen25")
    parser.add_argument("--reasoning-parser", default="")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("-k", help="pytest -k expression, passed through")
    parser.add_argument("--json", type=Path, help="write every outcome, classified, here")
    parser.add_argument("--logs", type=Path, help="keep the servers' and pytest's logs here")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 on protocol failures and failed probes too"
    )
    parser.add_argument("--no-probes", action="store_true", help="skip the wire probes")
    parser.add_argument(
        "--clients-python",
        type=Path,
        help="python of a venv with litellm and/or langchain-openai: run them against a session",
    )
    args = parser.parse_args()
    if not (args.vllm_tests or args.sglang_tests or not args.no_probes):
        parser.error("give --vllm-tests DIR and/or --sglang-tests DIR (or drop --no-probes)")
    args.corral_src = args.corral_src.resolve()

    with tempfile.TemporaryDirectory(prefix="corral-peer-suites-") as tmp:
        workdir = args.logs.resolve() if args.logs else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        all_results: dict[str, dict[str, dict[str, str]]] = {}
        with Stack(args, workdir) as stack:
            if args.vllm_tests:
                all_results["vllm"] = run_suite(
                    stack, "vllm", args.vllm_tests.resolve(), VLLM_FILES, args
                )
            if args.sglang_tests:
                all_results["sglang"] = run_suite(
                    stack, "sglang", args.sglang_tests.resolve(), SGLANG_FILES, args
                )
            probes = [] if args.no_probes else run_probes(stack, args.served_model_name)
            clients = (
                run_clients(stack, args.served_model_name, args.clients_python)
                if args.clients_python
                else ""
            )
        rows, unclassified = report(all_results)
    if args.json:
        blob = {"tests": rows, "probes": probes, "clients": clients}
        args.json.write_text(json.dumps(blob, indent=1))
    protocol = sum(1 for r in rows if r["class"] == "protocol") + sum(
        1 for p in probes if not p["ok"]
    )
    return 1 if unclassified or (args.strict and protocol) else 0


if __name__ == "__main__":
    sys.exit(main())
