"""Probe a corral server's transport with idle / slowloris / half-body sockets (real server).

Serves a small app with ``/health`` on 127.0.0.1 in a subprocess (``--mode hardened``: with
:func:`corral.transport.hardened_config` and default ``TransportLimits``, as ``run_server``
and ``serve_in_thread`` do; ``--mode baseline``: plain uvicorn as corral ran it before), opens
N hostile sockets of one kind, then times ``GET /health`` from a fresh, well-behaved client
and records how long the hostile sockets stay open (bounded by ``--hold``). Prints one JSON
line per attack. ``--server-nofile`` sets the server's RLIMIT_NOFILE, where the unbounded
server actually fails.

    PYTHONPATH=. python bench/transport_probe.py --sockets 300 --hold 30 --server-nofile 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time

import httpx

from corral.serving import free_port

# The transport is what is probed, so the app is the smallest one with the env server's
# /health; "baseline" is uvicorn as run_server configured it before the transport limits.
SERVE = """
import sys
import uvicorn
from fastapi import FastAPI, Request
app = FastAPI()
@app.get("/health")
async def health():
    return {"ok": True}
@app.post("/health")
async def post_health(request: Request):
    return {"ok": True, "bytes": len(await request.body())}
port = int(sys.argv[2])
if sys.argv[1] == "baseline":
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", timeout_keep_alive=75)
else:
    from corral.transport import TransportLimits, hardened_config
    uvicorn.Server(hardened_config(app, TransportLimits(), host="127.0.0.1", port=port,
                                   log_level="error")).run()
"""


async def _hostile(kind: str, port: int, hold: float) -> float:
    """Open one hostile socket; return how long the server kept it open (capped at hold)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened = time.monotonic()

    async def trickle() -> None:
        if kind == "idle":
            return
        if kind == "slowloris":
            head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-a: b\r\n" * 100000
            for byte in head:
                writer.write(bytes([byte]))
                await asyncio.sleep(0.5)
        if kind == "half-body":
            writer.write(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            while True:
                writer.write(b"x")
                await asyncio.sleep(0.5)

    sender = asyncio.ensure_future(trickle())
    try:
        await asyncio.wait_for(reader.read(), timeout=hold)  # until EOF: the server closed
    except (TimeoutError, ConnectionError):
        pass
    finally:
        sender.cancel()
        writer.close()
    return time.monotonic() - opened


async def probe(kind: str, port: int, n: int, hold: float) -> dict[str, object]:
    tasks = []
    for _ in range(n):
        tasks.append(asyncio.ensure_future(_hostile(kind, port, hold)))
        await asyncio.sleep(0)
    await asyncio.sleep(1.0)  # let the attack settle before the well-behaved client asks
    health: list[object] = []
    async with httpx.AsyncClient(timeout=5.0) as client:
        for _ in range(5):
            start = time.monotonic()
            try:
                r = await client.get(f"http://127.0.0.1:{port}/health")
                health.append((r.status_code, round(time.monotonic() - start, 3)))
            except httpx.HTTPError as exc:
                health.append((type(exc).__name__, round(time.monotonic() - start, 3)))
            await asyncio.sleep(0.5)
    lives = sorted(await asyncio.gather(*tasks, return_exceptions=False))
    return {
        "attack": kind,
        "sockets": n,
        "health": health,
        "lifetime_s": {
            "min": round(lives[0], 2),
            "median": round(lives[len(lives) // 2], 2),
            "max": round(lives[-1], 2),
            "held_to_cap": sum(x >= hold - 0.1 for x in lives),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sockets", type=int, default=300)
    parser.add_argument("--hold", type=float, default=30.0)
    parser.add_argument("--attacks", default="idle,slowloris,half-body")
    parser.add_argument("--server-nofile", type=int, default=0, help="RLIMIT_NOFILE for the server")
    parser.add_argument("--mode", choices=["baseline", "hardened"], default="hardened")
    args = parser.parse_args()
    for kind in args.attacks.split(","):
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-c", SERVE, args.mode, str(port)],
            preexec_fn=(
                lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (args.server_nofile,) * 2)
            )
            if args.server_nofile
            else None,
        )
        try:
            for _ in range(300):
                try:
                    httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
                    break
                except httpx.HTTPError:
                    time.sleep(0.1)
            result = asyncio.run(probe(kind, port, args.sockets, args.hold))
            print(json.dumps({"mode": args.mode, **result}), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
