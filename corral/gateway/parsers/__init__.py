"""Parsers that turn model text into OpenAI fields: tool calls and reasoning."""
