"""Start real servers on 127.0.0.1 for tests (uvicorn in a background thread)."""

from corral.serving import free_port
from corral.serving import serve_in_thread as serve

__all__ = ["free_port", "serve"]
