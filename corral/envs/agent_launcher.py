"""The sandbox side of a black-box agent run (CONTRACT STUB; see corral.envs.agent_bridge).

Standard library only: this file is copied into every sandbox beside the runner.
"""
