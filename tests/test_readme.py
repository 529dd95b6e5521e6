"""The README's snippets run as pasted, in order, in one shell, in a clean copy of the repository.

Every ```bash and ```python block of README.md is a snippet, except a block right after a
``<!-- readme-test: skip (reason) -->`` comment. The bash blocks are joined into one script
(so ``export``s and background servers carry from one block to the next); each python block
runs as ``python -`` at its place in that script, with the script's environment. The copy holds
the repository's tracked and untracked-but-not-ignored files, as a fresh clone would, and the
snippets write only there. The servers they start in the background are real (the local engine,
the gateway, the env servers) on the README's fixed ports, which must be free.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PORTS = (30000, 8000, 8200, 8201)  # the ones the snippets use
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[A-Za-z0-9_-]*)\s*$")


@dataclass(frozen=True)
class Snippet:
    lang: str
    code: str
    line: int  # where its fence opens, 1-based
    skip_reason: str | None


def readme_snippets(text: str) -> list[Snippet]:
    """Every fenced bash/python block of ``text``, in order, with its skip reason if any.

    Raises ValueError on a fence that is never closed (a README that renders wrongly)."""
    lines = text.splitlines()
    snippets: list[Snippet] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start = i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"README.md:{start + 1}: a code fence that is never closed")
        lang = opened["lang"]
        if lang in ("bash", "python"):
            before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            skip = SKIP.search(before)
            snippets.append(
                Snippet(
                    lang=lang,
                    code="\n".join(lines[start + 1 : end]),
                    line=start + 1,
                    skip_reason=skip["reason"].strip() if skip else None,
                )
            )
        i = end + 1
    return snippets


def shell_script(snippets: list[Snippet]) -> str:
    """One bash script that runs the snippets in order and stops at the first failure."""
    parts = ["set -euo pipefail"]
    for snippet in snippets:
        parts.append(f"echo '>>> README.md:{snippet.line}' >&2")
        if snippet.lang == "bash":
            parts.append(snippet.code)
        else:
            marker = "CORRAL_README_PYTHON"
            assert marker not in snippet.code
            parts.append(f"python - <<'{marker}'\n{snippet.code}\n{marker}")
    return "\n".join(parts) + "\n"


def clean_copy(dest: Path) -> Path:
    """The files a fresh clone of this checkout would have (tracked + untracked, not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = Path(os.fsdecode(raw))
        source = REPO / rel
        if not source.is_file():  # deleted in the work tree but still tracked
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return dest


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_snippets_parse_and_every_skip_says_why() -> None:
    snippets = readme_snippets(README.read_text())
    run = [s for s in snippets if s.skip_reason is None]
    assert len(run) >= 6, "the Quick start's snippets were not found"
    assert any(s.lang == "python" for s in run)
    skipped = [s for s in snippets if s.skip_reason is not None]
    # Not run here: the two commands (what CI itself runs), the engines this machine's tests
    # run elsewhere (vLLM, the routers; SGLang needs a GPU) and the agent CLIs, whose requests
    # need a real model (tests/test_harness_rollouts.py plays them against a scripted engine).
    assert len(skipped) == 3, [s.line for s in skipped]
    assert skipped[0] is snippets[0]
    assert "corral run" in snippets[0].code and "bash .ci/run" in snippets[0].code
    assert "--engine-api vllm" in skipped[1].code
    assert "SGLang or vLLM" in (skipped[1].skip_reason or "")
    assert "--harness claude-code" in skipped[2].code


def test_a_fence_left_open_is_an_error() -> None:
    with pytest.raises(ValueError, match="never closed"):
        readme_snippets("text\n```bash\necho hi\n")


@pytest.mark.timeout(1200)
def test_readme_snippets_run_as_pasted(tmp_path: Path) -> None:
    busy = [port for port in PORTS if not port_is_free(port)]
    assert not busy, f"the README's ports {busy} are taken on this machine: free them first"
    snippets = [s for s in readme_snippets(README.read_text()) if s.skip_reason is None]
    root = clean_copy(tmp_path / "corral")
    script = root / ".readme-snippets.sh"
    script.write_text(shell_script(snippets))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_TOKEN") and k != "CORRAL_ADMIN"}
    # `python` and `corral` are this interpreter's, as after the README's pip install.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # Output to a file, not a pipe: servers left running by a failed snippet would hold a pipe
    # open, and the test would wait for them instead of for the script.
    log = tmp_path / "snippets.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", str(script)],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=1100)
        finally:
            # The last snippet stops the servers; a failure midway leaves them to this.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    tail = output[-6000:]
    assert proc.returncode == 0, f"a README snippet failed (rc {proc.returncode}):\n{tail}"
    assert "Traceback" not in output, tail
    # What the snippets say they produce.
    assert re.search(r"^\d+ tokens, \d+ of them the model's$", output, re.M), tail
    assert "reward 1.0 status completed" in output, tail
    # The shellcraft episode, played by hand in a bwrap sandbox.
    assert "uid=1000" in output, tail
    assert "status graded reward 0.0" in output, tail
    for made in (
        "tiny/config.json",
        "rows/eval.jsonl",
        "runs/eval/summary.json",
        "runs/play/summary.json",
        "runs/train/metrics.jsonl",
        "runs/train/curves.png",
    ):
        assert (root / made).is_file(), f"{made} was not written:\n{tail}"


WIRE_EXAMPLE = re.compile(r"<!-- wire-example: gridsim -->\n```json\n(?P<body>.*?)\n```", re.S)


def wire_block(frames: list[Any]) -> str:
    """The README's rendering of ``frames``: indented JSON, lists of scalars on one line."""
    import json

    def render(value: Any, depth: int) -> str:
        pad = "  " * depth
        if isinstance(value, dict) and value:
            items = [f"{pad}  {json.dumps(k)}: {render(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
            items = [f"{pad}  {render(v, depth + 1)}" for v in value]
            return "[\n" + ",\n".join(items) + f"\n{pad}]"
        return json.dumps(value)

    return render(frames, 0)


async def test_the_readme_wire_example_is_what_the_server_sends() -> None:
    """The README's gridsim episode: its ``send`` frames, replayed on a real server, get
    exactly its ``reply`` frames (on a mismatch the message holds the block to paste)."""
    import json

    import websockets

    from corral.envs.client import ws_url
    from corral.envs.server import build_app
    from tests.servers import serve

    found = WIRE_EXAMPLE.search(README.read_text())
    assert found, "the README's wire example (after <!-- wire-example: gridsim -->) is missing"
    frames = json.loads(found["body"])
    assert found["body"] == wire_block(frames), "the README's wire example is not formatted"
    sends = [f["send"] for f in frames[0::2]]
    replies = [f["reply"] for f in frames[1::2]]
    assert len(sends) == len(replies) == 4
    got: list[Any] = []
    with serve(build_app(REPO / "bundles" / "gridsim")) as url:
        async with websockets.connect(ws_url(url)) as ws:
            for send in sends:
                await ws.send(json.dumps(send))
                got += [{"send": send}, {"reply": json.loads(await ws.recv())}]
    block = wire_block(got)
    assert [f["reply"] for f in got[1::2]] == replies, f"README.md's block is now:\n{block}"
