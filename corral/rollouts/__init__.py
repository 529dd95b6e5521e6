"""The rollout core: rows in, scored rollouts with their training samples out.

- :mod:`corral.rollouts.rows`          rows (one episode to play: env, split, task) written from
  an env server and read back
- :mod:`corral.rollouts.player`        the episode player: one row through a gateway session and
  an env server's episode, the model driven by corral
- :mod:`corral.rollouts.harness_play`  the same interface with a black-box agent (a harness) in
  the episode's own sandbox
- :mod:`corral.rollouts.evals`         a split played ``n`` times: mean reward, standard error,
  failures counted apart

The trainer and the adapters (:mod:`corral.adapters`) build on these. They import the gateway's
client, the env server's client and :mod:`corral.samples`, never the trainer or the adapters
(tests/test_layering.py). Nothing is imported here: import the module you need.
"""
