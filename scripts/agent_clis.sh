#!/usr/bin/env bash
# Install the two real agent CLIs the gateway's wire dialects are tested against, pinned:
# Claude Code (Anthropic Messages) and Codex CLI (OpenAI Responses).
#
#   scripts/agent_clis.sh DIR            # install (idempotent) into DIR, print both binaries
#   scripts/agent_clis.sh --user [NAME]  # create the unprivileged user NAME (default
#                                        # corral-agent) if missing, print its name
#
# Install: `npm install --prefix DIR` of exactly @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION
# and @openai/codex@$CODEX_VERSION; skipped when both binaries are there at those versions.
# Prints two lines, `claude=PATH` and `codex=PATH`, each the real native binary (not a node
# wrapper): Claude Code ships a glibc executable, Codex a static musl one; neither needs Node
# at run time, only to install. Measured on the 2-core dev box: 760 MB; 14 s with a warm npm
# cache, 1-2 minutes cold.
#
# Running them headless, as an unprivileged user, off the network (checked in a network
# namespace with only loopback and a logging DNS stub: with these settings neither CLI looks
# up or connects to anything but the base URL):
#
#   Claude Code refuses `--permission-mode bypassPermissions` as root, so run it as the user
#   (`--allowedTools Bash` is the alternative to bypassPermissions; without either a Bash
#   command that writes a file is denied and the denial goes back to the model as a tool_result):
#     runuser -u corral-agent -- env HOME=/home/corral-agent \
#       CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 \
#       ANTHROPIC_BASE_URL=http://127.0.0.1:PORT ANTHROPIC_AUTH_TOKEN=TOKEN \
#       ANTHROPIC_MODEL=MODEL "$claude" -p PROMPT --permission-mode bypassPermissions
#   It posts to $ANTHROPIC_BASE_URL/v1/messages?beta=true (Authorization: Bearer TOKEN).
#   Without CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC it also sends HEAD $BASE/api/hello and
#   looks up api.anthropic.com. CLAUDE_CODE_MAX_RETRIES=0 stops its retries of 5xx/429.
#   A failed stream is still retried once as a non-streaming request unless
#   CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK=1.
#
#   Codex reads $CODEX_HOME/config.toml. Keep CODEX_HOME out of /tmp: under a temporary
#   directory it refuses to create its helper aliases, and then its sandbox cannot start
#   ("bwrap: execvp codex-linux-sandbox"). 0.169 rejects wire_api = "chat"; it appends
#   /responses to base_url. A config with everything networked turned off:
#     model = "MODEL"
#     model_provider = "corral"
#     check_for_update_on_startup = false
#     [analytics]
#     enabled = false            # else it looks up ab.chatgpt.com
#     [feedback]
#     enabled = false
#     [history]
#     persistence = "none"
#     [otel]
#     exporter = "none"
#     [features]
#     plugins = false            # else github.com, api.github.com, chatgpt.com
#     [model_providers.corral]
#     name = "corral"
#     base_url = "http://127.0.0.1:PORT/v1"
#     env_key = "CORRAL_API_KEY"
#     wire_api = "responses"
#     request_max_retries = 0    # optional: no retries of 5xx (default 4, x 5 stream retries)
#     stream_max_retries = 0
#   then, as the user:
#     runuser -u corral-agent -- env HOME=/home/corral-agent CODEX_HOME=/home/corral-agent/.codex \
#       CORRAL_API_KEY=TOKEN "$codex" exec --skip-git-repo-check --strict-config \
#       --sandbox workspace-write PROMPT < /dev/null
#   (--sandbox workspace-write lets its shell tool write in the working directory; the default
#   read-only sandbox makes `echo hi > out.txt` fail with "Read-only file system";
#   danger-full-access or --dangerously-bypass-approvals-and-sandbox run unsandboxed). Exec
#   never asks for approval. The final answer goes to stdout, the transcript to stderr.
set -euo pipefail

CLAUDE_CODE_VERSION="${CLAUDE_CODE_VERSION:-2.1.328}"
CODEX_VERSION="${CODEX_VERSION:-0.169.0}"

usage() {
    echo "usage: $0 DIR | $0 --user [NAME]" >&2
    exit 2
}

[ $# -ge 1 ] || usage

if [ "$1" = "--user" ]; then
    name="${2:-corral-agent}"
    if ! id -u "$name" >/dev/null 2>&1; then
        [ "$(id -u)" -eq 0 ] || { echo "$0: creating user $name needs root" >&2; exit 1; }
        useradd -m -s /bin/bash "$name"
    fi
    echo "$name"
    exit 0
fi

dir="$1"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"

# The version a package.json in node_modules declares ("" when absent).
installed_version() {
    local pkg="$dir/node_modules/$1/package.json"
    [ -f "$pkg" ] || return 0
    node -e 'process.stdout.write(require(process.argv[1]).version || "")' "$pkg"
}

# The native binaries. Claude Code: its package's bin is the native executable itself
# (older versions had cli.js plus a per-platform package; both are looked for). Codex: the
# per-platform optional dependency (npm alias @openai/codex@<v>-linux-x64) carries the musl
# binary under vendor/<target>/bin/ (codex.js only execve()s it).
find_claude() {
    local base="$dir/node_modules/@anthropic-ai"
    local candidate
    for candidate in \
        "$base/claude-code/bin/claude.exe" \
        "$base/claude-code/bin/claude" \
        "$base"/claude-code-linux-*/claude \
        "$base"/claude-code/node_modules/@anthropic-ai/claude-code-linux-*/claude; do
        if [ -f "$candidate" ] && [ -x "$candidate" ] && is_native "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    # Fall back to whatever npm linked (a node wrapper at worst).
    [ -e "$dir/node_modules/.bin/claude" ] && readlink -f "$dir/node_modules/.bin/claude"
}

find_codex() {
    local candidate
    for candidate in \
        "$dir"/node_modules/@openai/codex-linux-*/vendor/*/bin/codex \
        "$dir"/node_modules/@openai/codex/node_modules/@openai/codex-linux-*/vendor/*/bin/codex \
        "$dir"/node_modules/@openai/codex/vendor/*/bin/codex; do
        if [ -f "$candidate" ] && [ -x "$candidate" ] && is_native "$candidate"; then
            echo "$candidate"
            return 0
        fi
    done
    [ -e "$dir/node_modules/.bin/codex" ] && readlink -f "$dir/node_modules/.bin/codex"
}

# An ELF executable (not a #! script).
is_native() {
    [ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" = "177ELF" ]
}

up_to_date() {
    [ "$(installed_version @anthropic-ai/claude-code)" = "$CLAUDE_CODE_VERSION" ] \
        && [ "$(installed_version @openai/codex)" = "$CODEX_VERSION" ] \
        && [ -n "$(find_claude)" ] && [ -n "$(find_codex)" ]
}

if ! up_to_date; then
    start=$(date +%s)
    npm install --prefix "$dir" --no-audit --no-fund --loglevel=error \
        "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION" >&2
    echo "agent CLIs installed in $dir in $(($(date +%s) - start)) s" >&2
    up_to_date || { echo "$0: the install left no native claude/codex binary in $dir" >&2; exit 1; }
fi

claude="$(find_claude)"
codex="$(find_codex)"
is_native "$claude" || echo "$0: warning: $claude is not a native binary" >&2
is_native "$codex" || echo "$0: warning: $codex is not a native binary" >&2
echo "claude=$claude"
echo "codex=$codex"
