"""Env bundles served over HTTP + WebSocket (issue 3)."""
