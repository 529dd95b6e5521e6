"""Integrations with other systems: slime and Miles (their rollout hooks, slime's sample
shapes) and black-box agents on this host with the episode's tools over MCP. The rollout core
they build on is :mod:`corral.rollouts`."""
