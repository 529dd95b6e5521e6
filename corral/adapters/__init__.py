"""The episode player and the slime / Miles adapters."""
