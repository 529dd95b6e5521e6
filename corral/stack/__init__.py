"""One way to start each of corral's servers, in this process or as a child process.

- :mod:`corral.stack.engine`: the local engine
  (:class:`~corral.engines.local.settings.EngineSettings`).
- :mod:`corral.stack.gateway`: the gateway (:class:`~corral.gateway.launch.GatewayLaunch`).
- :mod:`corral.stack.env_server`: the env server (:class:`~corral.envs.settings.ServeSettings`).
- :mod:`corral.stack.local`: the embedded stack, the local engine and a gateway in threads
  (:func:`local_stack`, what ``corral run``, tests and benchmarks use).

Each service has an ``*_in_thread`` form (uvicorn in a thread of this process,
:func:`corral.serving.serve_in_thread`) and an ``*_in_process`` form (``corral <command>`` as a
child, :func:`corral.processes.serve_in_process`, its argv from the settings' ``to_argv()``).
Both are context managers that yield once the server answers and stop it when the block
exits. The trainer (:mod:`corral.trainer.services`), Ray's env-server actors, the slime adapter
and ``corral run`` start their servers through them.
"""

from __future__ import annotations

from corral.stack.local import StackURLs, local_stack

__all__ = ["StackURLs", "local_stack"]
