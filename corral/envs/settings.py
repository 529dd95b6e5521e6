"""The env server's defaults, each defined once: the server, its CLI, the rows that ask an env
server for episodes and the trainer's config take them from here.

Light on purpose (no FastAPI, no sandboxes): a trainer config or a row writer imports it.
"""

from __future__ import annotations

# Seconds one tool call may take on the env server before it answers with a timeout.
TOOL_TIMEOUT_S = 60.0
# Seconds a reset may take (building the task, starting its sandbox, waiting for capacity).
RESET_TIMEOUT_S = 600.0
# Seconds an episode may sit idle before the server reaps it.
IDLE_TIMEOUT_S = 600.0
# Seconds an authenticated WebSocket may wait before its first reset (a socket that plays
# nothing is closed).
FIRST_RESET_TIMEOUT_S = 120.0
