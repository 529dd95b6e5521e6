"""Harnesses: how to run one black-box agent (Claude Code, Codex CLI, any command) headless
in an episode's sandbox, pointed at its own gateway session."""
