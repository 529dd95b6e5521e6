"""The Megatron-core trainer (issue 6)."""
