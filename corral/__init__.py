"""corral: an agentic RL gym.

Subpackages, one job each (dependencies point one way, checked by tests/test_layering.py:
trainer/adapters -> rollouts -> gateway, envs -> sandboxes, and the shared ``Sample`` contract
in ``corral.samples`` below them all; the gateway never imports the env, rollout, adapter or
trainer packages):

- ``corral.samples``   the training sample the gateway records and the trainer and adapters read
- ``corral.engines``   the engine protocol (SGLang's native API), its HTTP client, the local engine
- ``corral.gateway``   the OpenAI chat gateway that records every turn as training tokens, and
  the client of its admin API
- ``corral.envs``      env bundles served over HTTP + WebSocket
- ``corral.sandboxes`` where bundle code runs (local, bwrap, docker, e2b, kubernetes)
- ``corral.rollouts``  rows, the episode player, harness rollouts and evals
- ``corral.trainer``   the Megatron-core trainer
- ``corral.adapters``  integrations with other systems: slime / Miles, MCP agents
"""

__version__ = "0.1.0"
