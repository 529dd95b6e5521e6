"""corral: an agentic RL gym.

Subpackages, one job each (dependencies point one way: adapters/trainer -> gateway,
envs -> sandboxes; the gateway never imports the trainer):

- ``corral.engines``   the engine protocol (SGLang's native API), its HTTP client, the local engine
- ``corral.gateway``   the OpenAI chat gateway that records every turn as training tokens
- ``corral.envs``      env bundles served over HTTP + WebSocket
- ``corral.sandboxes`` where bundle code runs (local, bwrap, docker, e2b, kubernetes)
- ``corral.trainer``   the Megatron-core trainer
- ``corral.adapters``  the episode player and the slime / Miles adapters
"""

__version__ = "0.1.0"
