"""The Megatron-core trainer."""
