#!/usr/bin/env bash
# Start or stop a private dockerd (its own data-root, socket and pidfile under DIR).
#   scripts/dockerd.sh start DIR   -> prints DOCKER_HOST=unix://DIR/docker.sock once it answers
#   scripts/dockerd.sh stop DIR    -> stops it (SIGTERM, then SIGKILL after 20 s)
# No bridge and no iptables: containers get network "none" or "host" only (see
# corral/sandboxes/docker.py). The data-root keeps built images between runs.
set -euo pipefail

cmd="${1:-}"
dir="${2:-}"
if [ -z "$cmd" ] || [ -z "$dir" ]; then
    echo "usage: $0 start|stop DIR" >&2
    exit 2
fi
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
sock="$dir/docker.sock"
pidfile="$dir/dockerd.pid"

running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }

case "$cmd" in
start)
    if ! running; then
        rm -f "$sock"
        # setsid: the daemon survives the caller's shell and its signals.
        setsid dockerd \
            --data-root "$dir/data" \
            --exec-root "$dir/exec" \
            --host "unix://$sock" \
            --pidfile "$pidfile" \
            --bridge=none --iptables=false --ip6tables=false --ip-masq=false \
            >"$dir/dockerd.log" 2>&1 </dev/null &
    fi
    for _ in $(seq 1 300); do
        if DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1; then
            echo "DOCKER_HOST=unix://$sock"
            exit 0
        fi
        sleep 0.1
    done
    echo "dockerd did not answer within 30 s; see $dir/dockerd.log:" >&2
    tail -n 20 "$dir/dockerd.log" >&2 || true
    exit 1
    ;;
stop)
    if running; then
        pid="$(cat "$pidfile")"
        kill "$pid"
        for _ in $(seq 1 200); do
            kill -0 "$pid" 2>/dev/null || exit 0
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    fi
    ;;
*)
    echo "usage: $0 start|stop DIR" >&2
    exit 2
    ;;
esac
