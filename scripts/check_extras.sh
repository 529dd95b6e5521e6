#!/usr/bin/env bash
# Each kind of user's extra (pyproject.toml) installs and runs on its own: for gateway, envs
# and train (and the base install), a venv of REPO[extra] alone plays what that user runs, and
# a package the extra must not pull in (torch for gateway and envs) is checked absent.
#
#   bash scripts/check_extras.sh      (CI: .ci/run, after the main install and the dockerd)
#
# The venvs are cached under CORRAL_EXTRAS_CACHE (default /var/cache/corral-extras) as
# <extra>-<hash>, the hash covering pyproject.toml's dependency tables and the Python version:
# a change to either rebuilds that venv; otherwise the check only runs the programs. The main
# install (`python`, with corral[local]) builds the tiny model and runs the engine the gateway
# fronts. With DOCKER_HOST set (CI's private dockerd and sandbox image) the envs check plays a
# docker-sandboxed episode too. One line per extra; exits non-zero with the reason on failure.
set -euo pipefail
# Helpers run in $(...) subshells: a failing step there must stop them too.
shopt -s inherit_errexit

REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${CORRAL_EXTRAS_CACHE:-/var/cache/corral-extras}"
# The main install (corral[local], as .ci/run installs it): the tiny model and the engine.
SYSTEM_PYTHON=python
export PIP_DISABLE_PIP_VERSION_CHECK=1
WORK="$(mktemp -d)"
started=$SECONDS

pids=()
cleanup() {
    # Only the servers this script started, by their pid.
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT

fail() {
    echo "check_extras: FAIL: $*" >&2
    exit 1
}

# The last lines of a log, for a failure message.
tail_of() { tail -n 25 "$1" | grep -v "is ignored: it is neither" || true; }

# ---- cached venvs ----------------------------------------------------------------------------

mkdir -p "$CACHE"
# One check at a time per cache: two CI runs must not build the same venv at once.
exec 9>"$CACHE/.lock"
flock 9

deps_hash="$("$SYSTEM_PYTHON" - "$REPO/pyproject.toml" <<'EOF'
import hashlib, json, sys, tomllib

with open(sys.argv[1], "rb") as f:
    toml = tomllib.load(f)
project = toml["project"]
tables = {
    "build-system": toml.get("build-system"),
    "dependencies": project.get("dependencies"),
    "optional-dependencies": project.get("optional-dependencies"),
    "scripts": project.get("scripts"),  # the venv's `corral` command
    "python": sys.version,  # a venv is bound to the interpreter it was made from
}
print(hashlib.sha256(json.dumps(tables, sort_keys=True).encode()).hexdigest()[:16])
EOF
)"

# venv NAME SPEC [FIRST...]: the path of the cached venv with `pip install -e SPEC`, built when
# absent (after `pip install FIRST...` when given). A venv is complete once .complete is
# written: a build cut short is thrown away and redone.
venv() {
    local name="$1" spec="$2"
    shift 2
    local dir="$CACHE/$name-$deps_hash" log="$CACHE/$name-$deps_hash.log"
    if [ ! -e "$dir/.complete" ]; then
        # Venvs of older hashes are never used again: a train venv is ~2 GB.
        rm -rf "$CACHE/$name"-*
        "$SYSTEM_PYTHON" -m venv "$dir"
        if [ $# -gt 0 ]; then
            "$dir/bin/pip" install "$@" >"$log" 2>&1 || fail "$name: pip install $* ($log): $(tail_of "$log")"
        fi
        "$dir/bin/pip" install -e "$spec" >>"$log" 2>&1 || fail "$name: pip install -e $spec ($log): $(tail_of "$log")"
        touch "$dir/.complete"
    fi
    # An editable install points at the checkout it was made from; CI clones afresh, maybe
    # elsewhere: point it at this one (no dependency changes, so no resolution).
    local at
    # Asked from / : run from the checkout, python would find ./corral first whatever the
    # install points at.
    at="$(cd / && "$dir/bin/python" -c 'import corral; print(corral.__path__[0])' 2>/dev/null || true)"
    if [ "$at" != "$REPO/corral" ]; then
        "$dir/bin/pip" install --no-deps -e "$REPO" >>"$log" 2>&1 || fail "$name: re-pointing at $REPO ($log)"
    fi
    echo "$dir"
}

# ---- helpers ---------------------------------------------------------------------------------

free_port() {
    "$SYSTEM_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start LOG COMMAND...: run a server in the background, its output to LOG; sets $started_pid.
start() {
    local log="$1"
    shift
    "$@" >"$log" 2>&1 &
    started_pid=$!
    pids+=("$started_pid")
}

# ready URL PID LOG: wait (two minutes at most) until URL answers 200; fail at once, with the
# server's log, when the server PID exits first.
ready() {
    local why
    why="$("$SYSTEM_PYTHON" - "$1" "$2" 2>&1 <<'EOF'
import sys, time, urllib.request

url, pid = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                sys.exit(f"the server for {url} exited")
    except FileNotFoundError:
        sys.exit(f"the server for {url} exited")
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            if reply.status == 200:
                sys.exit(0)
    except OSError:
        pass  # not listening yet, or 503 while its engine starts
    time.sleep(0.2)
sys.exit(f"{url} did not answer 200 within 120 s")
EOF
)" || fail "$why ($3): $(tail_of "$3")"
}

# absent VENV MODULE...: each module must NOT import in VENV (the extra stays minimal).
absent() {
    local dir="$1" module
    shift
    for module in "$@"; do
        if "$dir/bin/python" -c "import $module" 2>/dev/null; then
            fail "$(basename "$dir"): '$module' is installed, but this extra must not pull it in"
        fi
    done
}

# episode VENV URL TOKEN SPLIT_INDEX TOOL ARGS_JSON...: play one episode over the WebSocket
# with corral's EnvClient from VENV: reset, call each TOOL ARGS pair in turn; the last must
# end the episode with a reward. Prints the reward.
episode() {
    "$1/bin/python" - "${@:2}" <<'EOF'
import asyncio, json, sys

from corral.envs.client import EnvClient

url, token, index, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]

async def play() -> None:
    async with EnvClient(url, token or None, timeout=60, reset_timeout=120) as client:
        first = await client.reset("eval", index)
        assert first.observation.tools, "reset gave no tools"
        for name, arguments in zip(calls[::2], calls[1::2]):
            result = await client.call_tool(name, json.loads(arguments))
        assert result.done and result.reward is not None, f"episode not graded: {result}"
        print(result.reward)

asyncio.run(play())
EOF
}

line() { printf '%-8s ok  %4ds  %s\n' "$1" "$2" "$3"; }

# ---- the tiny model (main install; cached under ~/.cache/corral/tiny by its source hash) -----

TINY="$("$SYSTEM_PYTHON" -c 'from corral.engines.tiny_model import cached_tiny_model; print(cached_tiny_model())' 2>"$WORK/tiny.log")" \
    || fail "cannot build the tiny model with $SYSTEM_PYTHON (the main install needs corral[local])"

# The engine the gateway check fronts, started now: its start-up (torch, the model) overlaps the
# base check.
engine_port=$(free_port)
start "$WORK/engine.log" "$SYSTEM_PYTHON" -m corral.cli engine --model "$TINY" --port "$engine_port"
engine_pid=$started_pid

# ---- base: no extra serves gridsim (needs no sandbox) -----------------------------------------

t=$SECONDS
BASE="$(venv base "$REPO")"
absent "$BASE" torch transformers
port=$(free_port)
start "$WORK/base-serve.log" "$BASE/bin/corral" serve "$REPO/bundles/gridsim" --port "$port"
ready "http://127.0.0.1:$port/health" "$started_pid" "$WORK/base-serve.log"
reward=$(episode "$BASE" "http://127.0.0.1:$port" "" 0 \
    submit_schedule '{"schedule": [0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]}') \
    || fail "base: a gridsim episode failed"
line base $((SECONDS - t)) "serve gridsim, one episode (idle day: reward $reward); no torch"
GRIDSIM_URL="http://127.0.0.1:$port"  # reused by the gateway check's eval and play

# ---- gateway: agent developers ---------------------------------------------------------------

t=$SECONDS
GW="$(venv gateway "$REPO[gateway]")"
absent "$GW" torch llguidance
"$GW/bin/python" -c "import mcp" || fail "gateway: mcp does not import"
"$GW/bin/corral" play --help >/dev/null || fail "gateway: corral play --help"

export CHECK_ADMIN_TOKEN="check-extras-admin"
gateway_port=$(free_port)
start "$WORK/gateway.log" "$GW/bin/corral" gateway --engine-url "http://127.0.0.1:$engine_port" \
    --model "$TINY" --served-model-name tiny --port "$gateway_port" \
    --admin-token-var CHECK_ADMIN_TOKEN --log-level warning
GATEWAY_URL="http://127.0.0.1:$gateway_port"
ready "http://127.0.0.1:$engine_port/health" "$engine_pid" "$WORK/engine.log"
# /health is 200 once the gateway and its engine both answer.
ready "$GATEWAY_URL/health" "$started_pid" "$WORK/gateway.log"

# A session, one chat completion through the openai SDK, one recorded sample with tokens.
"$GW/bin/python" - "$GATEWAY_URL" <<'EOF' || fail "gateway: session/chat/samples ($WORK/gateway.log): $(tail_of "$WORK/gateway.log")"
import os, sys

import httpx, openai

gateway = sys.argv[1]
admin = {"Authorization": f"Bearer {os.environ['CHECK_ADMIN_TOKEN']}"}
session = httpx.post(f"{gateway}/sessions", headers=admin, json={}).raise_for_status().json()
client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
reply = client.chat.completions.create(
    model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0
)
assert reply.choices[0].message is not None
samples = httpx.get(f"{gateway}/sessions/{session['id']}/samples", headers=admin)
samples = samples.raise_for_status().json()
assert len(samples) == 1 and samples[0]["tokens"], f"expected one sample with tokens: {samples}"
EOF

# corral eval and corral play (examples/agent.py over MCP) on one gridsim row each.
"$GW/bin/corral" rows "$GRIDSIM_URL" "$WORK/gridsim-rows" --max-turns 2 >"$WORK/rows.log" 2>&1 \
    || fail "gateway: corral rows: $(tail_of "$WORK/rows.log")"
"$GW/bin/corral" eval "$WORK/gridsim-rows/eval.jsonl" --gateway "$GATEWAY_URL" \
    --admin-token-var CHECK_ADMIN_TOKEN --limit 1 --out "$WORK/eval" >"$WORK/eval.log" 2>&1 \
    || fail "gateway: corral eval: $(tail_of "$WORK/eval.log")"
[ -s "$WORK/eval/episodes.jsonl" ] || fail "gateway: corral eval wrote no episode"
AGENT_MAX_STEPS=2 AGENT_MAX_TOKENS=64 "$GW/bin/corral" play "$WORK/gridsim-rows/eval.jsonl" \
    --gateway "$GATEWAY_URL" --admin-token-var CHECK_ADMIN_TOKEN --limit 1 \
    --agent-cmd "$GW/bin/python $REPO/examples/agent.py" --out "$WORK/play" >"$WORK/play.log" 2>&1 \
    || fail "gateway: corral play: $(tail_of "$WORK/play.log")"
line gateway $((SECONDS - t)) "in front of the engine: session, chat, one sample; eval; play over MCP; no torch"

# ---- envs: sandbox operators -----------------------------------------------------------------

t=$SECONDS
ENVS="$(venv envs "$REPO[envs]")"
absent "$ENVS" torch transformers
"$ENVS/bin/python" -c "import docker, pyseccomp" || fail "envs: docker or pyseccomp does not import"
"$ENVS/bin/corral" bundle validate "$REPO/bundles/shellcraft" >"$WORK/validate.log" 2>&1 \
    || fail "envs: corral bundle validate: $(tail_of "$WORK/validate.log")"

export CHECK_ENV_TOKEN="check-extras-env"
backends=(bwrap)
[ -n "${DOCKER_HOST:-}" ] && backends+=(docker)
for backend in "${backends[@]}"; do
    port=$(free_port)
    start "$WORK/serve-$backend.log" "$ENVS/bin/corral" serve "$REPO/bundles/shellcraft" \
        --sandbox "$backend" --port "$port" --token-var CHECK_ENV_TOKEN
    ready "http://127.0.0.1:$port/health" "$started_pid" "$WORK/serve-$backend.log"
    "$ENVS/bin/corral" rows "http://127.0.0.1:$port" "$WORK/rows-$backend" \
        --token-var CHECK_ENV_TOKEN >"$WORK/rows-$backend.log" 2>&1 \
        || fail "envs: corral rows ($backend): $(tail_of "$WORK/rows-$backend.log")"
    [ -s "$WORK/rows-$backend/eval.jsonl" ] || fail "envs: corral rows ($backend) wrote no eval rows"
    episode "$ENVS" "http://127.0.0.1:$port" "$CHECK_ENV_TOKEN" 0 \
        bash '{"command": "ls"}' submit '{}' >/dev/null \
        || fail "envs: a shellcraft episode in $backend failed: $(tail_of "$WORK/serve-$backend.log")"
done
skipped=""
[ -z "${DOCKER_HOST:-}" ] && skipped=" (docker skipped: no DOCKER_HOST)"
line envs $((SECONDS - t)) "validate, serve shellcraft in ${backends[*]}: rows, one episode each; no torch$skipped"

# ---- train: RL engineers ---------------------------------------------------------------------

t=$SECONDS
# torch first and pinned: this machine's CPU build comes from local disk; any other spec
# would pull a multi-gigabyte CUDA build.
TRAIN="$(venv train "$REPO[train]" torch==2.13.0)"
# The embedded defaults (tiny model, local engine and gateway, gridsim in a local sandbox), cut
# to one group of two one-turn rollouts and no evaluation: tens of seconds on a CPU.
(cd "$WORK" && "$TRAIN/bin/corral" train --steps 1 --run-dir "$WORK/train" \
    --set schedule.eval_every=0 --set schedule.eval_limit=2 \
    --set rollout.groups_per_step=1 --set rollout.rollouts_per_row=2 \
    --set rollout.max_tokens=64 --set env.max_turns=1) >"$WORK/train.log" 2>&1 \
    || fail "train: corral train: $(tail_of "$WORK/train.log")"
[ -s "$WORK/train/metrics.jsonl" ] || fail "train: no metrics.jsonl in the run folder"
line train $((SECONDS - t)) "corral train --steps 1 on the embedded defaults: metrics.jsonl"

echo "extras: all ok in $((SECONDS - started))s (venvs under $CACHE)"
