"""The episode player and the slime / Miles adapters (issue 5)."""
