"""The gridsim RL example (``python examples/gridsim_rl/run.py``): see README.md here."""
